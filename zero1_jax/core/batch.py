"""What a batch must look like: every leaf has the same leading (batch)
axis, and its size splits into micro-batches over the devices. Errors name
the leaves and the fix.

Example:
  >>> import numpy as np
  >>> batch_size({"x": np.ones((8, 5)), "y": np.ones(8)}, accum=2, n=2)
  8
"""

from __future__ import annotations

import jax
import numpy as np


def leading_size(batch) -> int:
  """The leading (batch) size every leaf of ``batch`` shares; ValueError
  naming the leaves that have none (scalars) or another one."""
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise ValueError("zero1: the batch has no arrays")
  scalars = [jax.tree_util.keystr(p) for p, x in leaves if np.ndim(x) == 0]
  if scalars:
    raise ValueError(
        f"zero1: batch leaf {', '.join(scalars)} is a scalar; every batch "
        f"leaf is split over the devices along its leading (batch) axis. Pass "
        f"a constant to the loss through a closure or functools.partial, or "
        f"give it the batch axis (np.full((batch_size,), value)).")
  sizes = {}
  for p, x in leaves:
    sizes.setdefault(np.shape(x)[0], []).append(jax.tree_util.keystr(p))
  if len(sizes) != 1:
    shown = "; ".join(f"{', '.join(ps[:3])}{', ...' if len(ps) > 3 else ''}: "
                      f"{b}" for b, ps in sorted(sizes.items()))
    raise ValueError(f"zero1: every batch leaf needs the same leading (batch) "
                     f"size; got {shown}.")
  return next(iter(sizes))


def batch_size(batch, accum: int, n: int) -> int:
  """The global batch size; ValueError naming the fix if it cannot be split
  into ``accum`` micro-batches over ``n`` devices."""
  b = leading_size(batch)
  if b % (accum * n):
    raise ValueError(
        f"zero1: batch size {b} is not divisible by grad_accum_steps "
        f"({accum}) x data-parallel devices ({n}) = {accum * n}. Use a batch "
        f"size that is a multiple of {accum * n}.")
  return b
