"""DeepSpeed's optimizer-memory lines, as a job starts.

DeepSpeed's ZeRO optimizer reports, once per job (rank 0), what building its
sharded state did to memory. :func:`zero1_jax.initialize` logs the equivalent
(:func:`log`: process 0, INFO on the ``zero1_jax`` logger, shown as
DeepSpeed shows its lines unless the program set up logging): the stage, the
optimizer state's bytes replicated ("Before") and on the device ("After"),
measured from the live sharded arrays. zero1-train prints the same lines
itself on every process, for its own ranks and beside its memory estimate
(cli/common.py), with ``initialize`` inside :func:`quiet`.

Example (experiments/examples/deepspeed_port/train.py on 4 devices)::

  engine = z1.initialize(config=ds_config, loss_fn=loss_fn, params=params)
  # [Rank 0] Zero Stage 1: optimizer state partitioned
  # [Rank 0] Before: optimizer state 0.0002462 GiB per device
  # [Rank 0] After : optimizer state 6.156e-05 GiB per device (1/4)
  # [Rank 0] AllGather bucket size: 500000000
  # [Rank 1-3] the same as Rank 0
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Any, Callable, Iterator, NamedTuple

import jax

from zero1_jax import distributed, inspect

_GiB = 1024 ** 3
_log = logging.getLogger(__name__)
_quiet = contextvars.ContextVar("zero1_jax_memory_log_quiet", default=False)


class MemoryLines(NamedTuple):
  lines: list[str]           # "[Rank r] ..." for this process's ranks
  per_rank: dict[int, int]   # rank -> optimizer-state bytes on its device
  replicated: int            # the state's bytes were it replicated (global)
  stage: int                 # the ZeRO stage that runs (1 or 2)


def _ranks(ranks: list[int]) -> str:
  if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
    return f"{ranks[0]}-{ranks[-1]}"
  return ", ".join(map(str, ranks))


def memory_lines(engine: Any,
                 extra: Callable[[int, str], list[str]] | None = None
                 ) -> MemoryLines:
  """This process's lines, as DeepSpeed prints them: for the first rank
  (device) it holds and for any other whose bytes differ; ranks holding the
  same bytes are one line ("the same as"), not N identical blocks.

  Args:
    engine: a :class:`zero1_jax.Engine`.
    extra: ``extra(rank, unit) -> lines`` printed after a rank's After line
      (zero1-train's memory estimate); ``unit`` is "GPU" or "device".
  """
  state = (engine.opt_state.master, engine.opt_state.inner)
  n = engine.mesh.shape[engine.axis_name]
  stage = engine.tx.config.stage
  what = ("optimizer state and gradients" if stage == 2 else "optimizer state")
  before = sum(x.nbytes for x in jax.tree.leaves(state))
  lines: list[str] = []
  per_rank: dict[int, int] = {}
  same: list[int] = []
  for r, d in enumerate(engine.mesh.devices.flat):
    if d.process_index != jax.process_index():
      continue
    per_rank[r] = inspect.device_bytes(state, d)
    first = next(iter(per_rank))
    if r != first and per_rank[r] == per_rank[first]:
      same.append(r)
      continue
    unit = "GPU" if d.platform == "gpu" else "device"   # DeepSpeed's "per GPU"
    lines.append(f"[Rank {r}] Zero Stage {stage}: {what} partitioned")
    lines.append(f"[Rank {r}] Before: optimizer state {before / _GiB:.4g} GiB "
                 f"per {unit}")
    host = inspect.device_bytes(state, d, memory_kind="pinned_host")
    if host:   # offload_optimizer: the sharded state lives in host memory
      lines.append(f"[Rank {r}] After : optimizer state {per_rank[r] - host} "
                   f"bytes (counts, scalars) on the {unit}, {host / _GiB:.4g} "
                   f"GiB in pinned host memory for it (offload_optimizer: "
                   f"cpu; 1/{n})")
    else:
      lines.append(f"[Rank {r}] After : optimizer state "
                   f"{per_rank[r] / _GiB:.4g} GiB per {unit} (1/{n})")
    lines += extra(r, unit) if extra else []
    lines.append(f"[Rank {r}] AllGather bucket size: "
                 f"{int(engine.config.zero.allgather_bucket_size)}")
  if same:
    lines.append(f"[Rank {_ranks(same)}] the same as Rank {next(iter(per_rank))}")
  return MemoryLines(lines, per_rank, before, stage)


def log(engine: Any) -> None:
  """:func:`memory_lines` at INFO on process 0 (DeepSpeed's rank 0), the
  other processes silent; nothing inside :func:`quiet`."""
  if _quiet.get() or not distributed.is_main_process():
    return
  for line in memory_lines(engine).lines:
    _log.info("%s", line)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
  """``initialize`` logs no memory lines inside (zero1-train prints its
  own, with the estimate, on every process)."""
  token = _quiet.set(True)
  try:
    yield
  finally:
    _quiet.reset(token)
