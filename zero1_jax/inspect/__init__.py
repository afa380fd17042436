"""Read what a compiled step costs: per-device memory, collectives, overlap.

``overlap`` (:mod:`zero1_jax.inspect.overlap_report`) says per collective
what compute it could hide behind; :mod:`zero1_jax.inspect.hlo_graph` parses
the HLO text.

Example:
  >>> import jax, jax.numpy as jnp
  >>> f = jax.jit(lambda x: x * 2)
  >>> collectives(f, jnp.ones(4))
  {}
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple

import numpy as np

from zero1_jax.inspect.hlo_graph import (COLLECTIVES, group_size,
                                         last_tuple_element, shape_bytes)
from zero1_jax.inspect.overlap_report import (Overlap, hlo_overlap, overlap,
                                             overlap_summary)
from zero1_jax.inspect import gpu, schedule  # noqa: F401  (z1.inspect.gpu.mesh, ...)

_LINE = re.compile(r"=\s*(?P<out>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                   r"(?P<kind>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\(")


class Collective(NamedTuple):
  count: int    # ops of this kind in the optimized HLO (a tuple op counts once:
                # the CPU backend combines all-reduces, not the others)
  bytes: int    # size of the full (unsharded) buffers they reduce or gather
  traffic: int  # ring volume per device in the ZeRO paper's units: all-reduce
                # counts 2x its buffer, reduce-scatter and all-gather 1x


def hlo_collectives(hlo_text: str) -> dict[str, Collective]:
  """Counts collectives in optimized HLO text (``compiled.as_text()``).

  Async pairs count once, at their ``-start``; an all-gather-start or
  reduce-scatter-start returns ``(operands, results)`` (the GPU form), of
  which only the results are counted; so does an all-reduce-start printed
  ``((operands), results)`` (jax 0.12's GPU form; jax 0.10's prints the
  results alone, a tuple of them when XLA combined several)."""
  out: dict[str, list[int]] = {}
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if not m:
      continue
    kind, shape = m.group("kind"), m.group("out")
    if m.group("start") and (
        kind in ("all-gather", "reduce-scatter") and shape.startswith("(")
        or kind == "all-reduce" and shape.startswith("((")):
      shape = last_tuple_element(shape)
    size = shape_bytes(shape)
    if kind == "reduce-scatter":
      size *= group_size(line)   # the output is one device's piece
    c = out.setdefault(kind, [0, 0])
    c[0] += 1
    c[1] += size
  return {k: Collective(c, b, 2 * b if k == "all-reduce" else b)
          for k, (c, b) in sorted(out.items())}


def _compiled(fn: Callable, *args, **kwargs):
  if hasattr(fn, "as_text") and hasattr(fn, "memory_analysis"):
    return fn
  return fn.lower(*args, **kwargs).compile()


def collectives(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, Collective]:
  """Collectives of a jitted ``fn`` on ``args`` (or of a compiled object)."""
  return hlo_collectives(_compiled(fn, *args, **kwargs).as_text())


def memory(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, int]:
  """Per-device bytes of a jitted ``fn``'s compiled program."""
  m = _compiled(fn, *args, **kwargs).memory_analysis()
  keys = ("argument_size_in_bytes", "output_size_in_bytes",
          "alias_size_in_bytes", "temp_size_in_bytes")
  out = {k.replace("_size_in_bytes", ""): int(getattr(m, k)) for k in keys}
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
HOST_SPACE = "S(5)"   # XLA's host memory space, as a layout prints it


def _entry_layout(hlo_text: str) -> tuple[str, str]:
  """``(arguments, outputs)`` text of the module's entry computation layout."""
  start = hlo_text.index("entry_computation_layout={") + len(
      "entry_computation_layout={")
  depth, i = 1, start
  while depth:
    depth += {"{": 1, "}": -1}.get(hlo_text[i], 0)
    i += 1
  args, _, outs = hlo_text[start:i - 1].partition(")->")
  return args, outs


def memory_spaces(fn: Callable, *args: Any, **kwargs: Any
                  ) -> dict[str, dict[str, int]]:
  """Per-device bytes of a jitted ``fn``'s arguments and outputs by memory
  space: ``{"device": {"arguments": b, "outputs": b}, "host": {...}}``.

  Read from the compiled module's entry layout, where XLA marks a buffer in
  host memory ``S(5)``; every backend prints it, while ``memory_analysis()``
  reports host bytes apart only where host and device memory differ (GPU,
  TPU: its ``host_*`` fields), and counts them as device bytes on CPU.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> memory_spaces(jax.jit(lambda x: x + 1), jnp.ones(4))
    {'device': {'arguments': 16, 'outputs': 16}, 'host': {'arguments': 0, 'outputs': 0}}
  """
  import math
  from zero1_jax.inspect.hlo_graph import ITEMSIZE
  out = {"device": {"arguments": 0, "outputs": 0},
         "host": {"arguments": 0, "outputs": 0}}
  for part, text in zip(("arguments", "outputs"),
                        _entry_layout(_compiled(fn, *args, **kwargs).as_text())):
    for dt, dims, lay in _ARRAY.findall(text):
      size = math.prod(int(d) for d in dims.split(",") if d) * ITEMSIZE.get(dt, 4)
      out["host" if HOST_SPACE in lay else "device"][part] += size
  return out


def device_bytes(tree: Any, device=None, memory_kind: str | None = None
                 ) -> int:
  """Bytes of ``tree``'s arrays that live on ``device`` (default: the first
  device any leaf lives on), measured from ``addressable_shards``; with
  ``memory_kind`` (e.g. ``"pinned_host"``: offloaded state), only arrays
  placed in that memory."""
  total = 0
  for x in __import__("jax").tree.leaves(tree):
    shards = getattr(x, "addressable_shards", None)
    if memory_kind is not None and getattr(getattr(x, "sharding", None),
                                           "memory_kind", None) != memory_kind:
      continue
    if shards is None:
      total += np.asarray(x).nbytes
      continue
    if device is None:
      device = shards[0].device
    total += sum(s.data.nbytes for s in shards if s.device == device)
  return total


# -- will it fit? ------------------------------------------------------------

CAPACITY_ENV = "ZERO1_DEVICE_MEMORY_BYTES"   # overrides capacity(): bytes/device


class MemoryEstimate(NamedTuple):
  """Bytes one data-parallel device needs for a ZeRO-1 step (see :func:`estimate`)."""
  params: int        # replicated parameters, compute dtype
  grads: int         # full local gradients and the fp32 reduce buffers
  state: int         # 1/N of the fp32 master copy and optimizer moments
  activations: int   # what the backward pass keeps of one micro-batch

  @property
  def per_device(self) -> int:
    return self.params + self.grads + self.state + self.activations


def estimate(num_params: int, num_devices: int, *, param_itemsize: int = 4,
             state_bytes_per_param: int = 12, activation_bytes: int = 0,
             stage: int = 1, largest_leaf: int = 0) -> MemoryEstimate:
  """Analytic per-device bytes of a ZeRO-1 (or ZeRO-2) step, before anything
  is allocated.

  Parameters are whole on every device. Gradients count as the compute-dtype
  gradient plus an fp32 copy for the reduction and the update: whole with
  ``stage=1``; with ``stage=2`` only this device's 1/N shards, plus ``largest_leaf``
  elements of whole gradients alive until their reduce-scatter runs (the
  caller's figure: e.g. the largest leaf and one bucket of small ones). The master copy and optimizer moments
  (``state_bytes_per_param``: 12 for Adam with bf16/fp16 params, 8 with fp32
  params, which are their own master) are split N ways;
  ``activation_bytes`` is the caller's model-specific figure for one
  micro-batch.

  >>> e = estimate(1_000_000, 4, param_itemsize=2, activation_bytes=10)
  >>> e.params, e.grads, e.state, e.per_device
  (2000000, 6000000, 3000000, 11000010)
  >>> estimate(1_000_000, 4, param_itemsize=2, stage=2, largest_leaf=1000).grads
  1506000
  """
  per_param = param_itemsize + 4
  if stage == 2:
    grads = -(-num_params * per_param // num_devices) + largest_leaf * per_param
  else:
    grads = num_params * per_param
  return MemoryEstimate(
      params=num_params * param_itemsize, grads=grads,
      state=-(-num_params * state_bytes_per_param // num_devices),
      activations=int(activation_bytes))


def _host_available() -> int:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  import os
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def capacity(devices) -> tuple[int, str]:
  """``(bytes each of ``devices`` can hold, where that figure comes from)``.

  GPU/TPU: the allocator's limit (``memory_stats()['bytes_limit']``), the
  smallest over ``devices``. Simulated CPU devices share the host's RAM: the
  available memory (``MemAvailable``) divided among the simulated devices
  of every process on this host (:func:`processes_on_this_host`).
  The environment variable ``ZERO1_DEVICE_MEMORY_BYTES`` overrides both.
  """
  import os
  env = os.environ.get(CAPACITY_ENV)
  if env:
    return int(float(env)), f"{CAPACITY_ENV}={env}"
  limits = []
  for d in devices:
    stats = None
    try:
      stats = d.memory_stats()
    except Exception:  # pylint: disable=broad-except  (CPU: unsupported)
      pass
    if stats and stats.get("bytes_limit"):
      limits.append(int(stats["bytes_limit"]))
  if limits and len(limits) == len(devices):
    return min(limits), f"{devices[0].platform.upper()} allocator limit"
  import jax
  local = [d for d in devices if d.process_index == jax.process_index()] or devices
  avail = _host_available()
  procs = processes_on_this_host()
  sharing = len(local) * procs
  per = f" ({len(local)} in each of {procs} processes)" if procs > 1 else ""
  return avail // sharing, (f"{avail / 1024**3:.1f} GiB of available host RAM "
                            f"shared by {sharing} simulated devices{per}")


# Processes of the job on this host, as launchers export it: zero1-train's
# own local launcher, torchrun, Open MPI, MPICH/Intel MPI (first match); then
# SLURM's per-node lists (processes_on_this_host).
LOCAL_PROCESSES_ENV = ("ZERO1_LOCAL_PROCESSES", "LOCAL_WORLD_SIZE",
                       "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
# SLURM: tasks of each node of the step (srun), else of the job (sbatch);
# --ntasks-per-node's value alone, last (srun -n N does not set it).
SLURM_TASKS_ENV = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def slurm_tasks_per_node(spec: str) -> list[int]:
  """SLURM's compressed per-node counts, expanded: ``2(x3),1`` -> [2, 2, 2, 1].

  >>> slurm_tasks_per_node("2(x3),1"), slurm_tasks_per_node("4")
  ([2, 2, 2, 1], [4])

  Raises:
    ValueError: not in that form.
  """
  out = []
  for part in spec.replace(" ", "").split(","):
    count, _, times = part.partition("(x")
    if times and not times.endswith(")"):
      raise ValueError(f"not SLURM's tasks-per-node form: {spec!r}")
    out += [int(count)] * (int(times[:-1]) if times else 1)
  if not out or min(out) < 1:
    raise ValueError(f"not SLURM's tasks-per-node form: {spec!r}")
  return out


def processes_on_this_host(environ=None) -> int:
  """How many processes of the job share this host's RAM (1 if no launcher
  says): the local size an MPI or zero1-train's launcher exports, else
  SLURM's count for this node (``SLURM_STEP_TASKS_PER_NODE`` at index
  ``SLURM_NODEID``: ``2(x3),1`` gives 1 on the fourth node), else
  ``SLURM_NTASKS_PER_NODE``.

  >>> processes_on_this_host({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"})
  1
  """
  import os
  env = os.environ if environ is None else environ
  for name in LOCAL_PROCESSES_ENV:
    value = env.get(name, "").strip()
    if value.isdigit() and int(value) >= 1:
      return int(value)
  node = env.get("SLURM_NODEID", "0").strip()
  for name in SLURM_TASKS_ENV:
    try:
      counts = slurm_tasks_per_node(env[name])
    except (KeyError, ValueError):
      continue
    if node.isdigit() and int(node) < len(counts):
      return counts[int(node)]
  value = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0].split(",")[0].strip()
  if value.isdigit() and int(value) >= 1:
    return int(value)
  return 1
