"""Multi-process training on ``jax.distributed``: joining, and feeding each
process only its part of the global batch.

Every process runs the same program; ``jax.distributed.initialize`` joins
them into one runtime whose ``jax.devices()`` spans all processes, so a mesh
over ``jax.devices()`` is the global data-parallel mesh and zero1_jax's
collectives cross processes unchanged (gloo on CPU, NCCL on GPU).

Example (two shells on one machine, 2 CPU devices each)::

    z1.distributed.initialize("127.0.0.1:12355", num_processes=2, process_id=0)
    z1.distributed.initialize("127.0.0.1:12355", num_processes=2, process_id=1)
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zero1_jax.distributed import cache_guard
from zero1_jax.distributed.peer_watch import PeerWatch  # noqa: F401 - public here

log = logging.getLogger("zero1_jax")


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               *, auto: bool = False, heartbeat_timeout_seconds: int = 100,
               initialization_timeout: int = 300) -> bool:
  """Joins this process to a multi-process JAX runtime.

  Args:
    coordinator_address: ``host:port`` of process 0 (default: the
      ``JAX_COORDINATOR_ADDRESS`` environment variable, when the other two
      are given).
    num_processes, process_id: this job's size and this process's rank.
    auto: let JAX detect them from the cluster environment (SLURM, Open MPI,
      ``JAX_COORDINATOR_ADDRESS`` ...), as ``jax.distributed.initialize()``
      does with no arguments. With no coordinates given this is switched on
      by itself when :func:`cluster_environment` sees a multi-task job.
    heartbeat_timeout_seconds: a process that stops answering for this long
      makes the others fail instead of hanging.
    initialization_timeout: how long to wait for every process to join
      (a process never started, or a ``process_id`` given twice, fails
      only then).

  Returns:
    True if a multi-process runtime was started (or had been: a second call,
    or one after ``jax.distributed.initialize()``, joins nothing and only
    checks that the coordinates it was given match the running job), False
    for a single process (no coordinates given and ``auto`` off).
  """
  if is_initialized():   # joined already: zero1-train, then engine.initialize
    _check_joined(num_processes, process_id)
    return True
  env_address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if coordinator_address is None and env_address and (
      num_processes is not None or process_id is not None):
    coordinator_address = env_address   # JAX's variable names process 0 only
  given = [coordinator_address, num_processes, process_id]
  if all(v is None for v in given):
    auto = auto or cluster_environment()
    if not auto:
      return False
  if not auto and any(v is None for v in given):
    raise ValueError(
        "multi-process training needs coordinator_address, num_processes and "
        "process_id together (zero1-train: --coordinator_address, "
        "--num_processes, --process_id), or auto-detection from the cluster "
        f"environment; got {given}.")
  if not auto and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id {process_id} must be in [0, "
                     f"{num_processes}) (num_processes={num_processes}).")
  kwargs = dict(heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                initialization_timeout=initialization_timeout)
  if not auto:
    kwargs.update(coordinator_address=coordinator_address,
                  num_processes=num_processes, process_id=process_id)
  if not auto:   # the wait below is silent: a missing or doubled process
    log.info("process %d of %d: joining the job at %s (waits up to %d s for "
             "all %d; a process_id given twice or one never started fails "
             "only then)", process_id, num_processes, coordinator_address,
             initialization_timeout, num_processes)
  try:
    jax.distributed.initialize(**kwargs)
  except RuntimeError as e:
    if "must be called before" not in str(e):
      raise
    raise RuntimeError(
        f"joining the multi-process job ({_job_source(auto)}) must come "
        f"before anything starts JAX's backend (jax.devices(), a mesh, a "
        f"jnp array, a computation): call z1.distributed.initialize() (or "
        f"z1.initialize(...)) first, and build the parameters with numpy or "
        f"after it") from None
  except ValueError as e:
    if auto and env_address and "number of processes" in str(e).lower():
      raise ValueError(
          f"JAX_COORDINATOR_ADDRESS={env_address} names process 0 only: give "
          f"this process's coordinates too, --num_processes and --process_id "
          f"(z1.distributed.initialize(num_processes=..., process_id=...)); "
          f"SLURM and Open MPI set them for you") from None
    raise
  log.info("process %d of %d joined; %d local / %d global devices",
           jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count())
  cache_guard.turn_off_if_it_hangs()
  return True


def is_initialized() -> bool:
  """Whether this process has joined a ``jax.distributed`` runtime (by
  :func:`initialize` or by ``jax.distributed.initialize`` directly)."""
  probe = getattr(jax.distributed, "is_initialized", None)   # jax >= 0.4.36
  if probe is not None:
    return bool(probe())
  from jax._src import distributed as jax_distributed   # older jax
  return jax_distributed.global_state.client is not None


def _check_joined(num_processes: int | None, process_id: int | None) -> None:
  """Coordinates given to a second join must be the running job's."""
  if num_processes is not None and num_processes != jax.process_count():
    raise ValueError(f"num_processes={num_processes}, but this process "
                     f"already joined a job of {jax.process_count()}.")
  if process_id is not None and process_id != jax.process_index():
    raise ValueError(f"process_id={process_id}, but this process already "
                     f"joined as process {jax.process_index()}.")
  log.debug("already joined: process %d of %d", jax.process_index(),
            jax.process_count())


def _job_source(auto: bool) -> str:
  if not auto:
    return "coordinates given"
  found = [f"{v}={os.environ[v]}" for v in ("JAX_COORDINATOR_ADDRESS",
                                             *_CLUSTER_SIZE_VARS)
           if os.environ.get(v)]
  return "detected from " + ", ".join(found) if found else "auto-detected"


_CLUSTER_SIZE_VARS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def cluster_environment() -> bool:
  """True when a launcher set up a multi-process job in the environment:
  JAX's own ``JAX_COORDINATOR_ADDRESS``, or SLURM / Open MPI / PMI with more
  than one task (what ``jax.distributed.initialize()`` auto-detects)."""
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return True
  for var in _CLUSTER_SIZE_VARS:
    try:
      if int(os.environ.get(var, "1")) > 1:
        return True
    except ValueError:
      continue
  return False


def leave(timeout_s: float = 15.0) -> bool:
  """Leaves the multi-process runtime, waiting at most ``timeout_s``.

  ``jax.distributed.shutdown`` (also run at interpreter exit) waits up to
  five minutes for every process to leave with it. After a Ctrl-C one
  process may be blocked in a step the interrupted ones never join: it
  cannot leave, and the others would wait for it. Returns True when every
  process left together; False when the wait timed out (the caller should
  then exit with ``os._exit``: the runtime is still waiting inside).

  Example::

    if not z1.distributed.leave():
      os._exit(130)
  """
  t = threading.Thread(target=jax.distributed.shutdown, daemon=True,
                       name="zero1-leave")
  t.start()
  t.join(timeout_s)
  return not t.is_alive()


def is_main_process() -> bool:
  return jax.process_index() == 0


def local_rows(global_size: int, mesh: jax.sharding.Mesh, axis: str = "data"
               ) -> slice:
  """The rows of a ``P(axis)``-sharded batch that this process's devices hold.

  Raises:
    ValueError: this process's devices are not contiguous on the axis (build
      the mesh over ``jax.devices()``, which orders devices by process).
  """
  n = mesh.shape[axis]
  if global_size % n:
    raise ValueError(f"global batch {global_size} is not divisible by the "
                     f"{n} devices of axis '{axis}'.")
  order = list(mesh.devices.reshape(-1)) if len(mesh.axis_names) == 1 else None
  if order is None:
    raise ValueError("local_rows supports 1-D data meshes only.")
  mine = [i for i, d in enumerate(order) if d.process_index == jax.process_index()]
  if mine != list(range(mine[0], mine[0] + len(mine))):
    raise ValueError("this process's devices are not contiguous on the data "
                     "axis; build the mesh over jax.devices().")
  per = global_size // n
  return slice(mine[0] * per, (mine[-1] + 1) * per)


def global_batch(batch: Any, mesh: jax.sharding.Mesh, axis: str = "data", *,
                 process_local: bool = False) -> Any:
  """A global, ``P(axis)``-sharded batch from host data on every process.

  With ``process_local=False`` every process passes the whole global batch
  (e.g. a deterministic data pipeline) and keeps only its rows; with True it
  passes only its own rows (``local_rows``), in order.
  """
  sharding = NamedSharding(mesh, P(axis))
  nproc = jax.process_count()

  def one(x):
    x = np.asarray(x)
    total = x.shape[0] * (nproc if process_local else 1)
    local = x if process_local else x[local_rows(total, mesh, axis)]
    return jax.make_array_from_process_local_data(
        sharding, local, (total,) + x.shape[1:])

  return jax.tree.map(one, batch)


def check_same_batch(batch: Any, where: str) -> None:
  """Raises ValueError unless every process passed an equal ``batch`` (a
  checksum of each host leaf, compared across processes: one tiny
  collective). The engine's ``train_batch`` takes the same global batch on
  every process and keeps each one's rows; different batches would train
  silently on a mix of them. Leaves that are already global ``jax.Array``s
  are not checked."""
  import zlib
  from jax.experimental import multihost_utils
  leaves = [x for x in jax.tree.leaves(batch)
            if not isinstance(x, jax.Array) or x.is_fully_addressable]
  # int32 values: without jax_enable_x64 an int64 would be cut to 32 bits on
  # one side of the comparison only
  sums = np.array([zlib.crc32(np.ascontiguousarray(x).tobytes()) & 0x7FFFFFFF
                   for x in leaves], np.int32)
  try:
    multihost_utils.assert_equal(sums, f"{where}: not the same batch")
  except AssertionError:
    raise ValueError(
        f"{where}: the processes passed different batches (process "
        f"{jax.process_index()} of {jax.process_count()}). Every process "
        f"passes the same global batch and keeps its own rows; to feed only "
        f"local rows, build the global array with "
        f"z1.distributed.global_batch(rows, mesh, process_local=True)") from None

