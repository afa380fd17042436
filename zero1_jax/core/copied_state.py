"""One device's part of the state copied to every device: said at the first update.

Under ``jax.pmap`` each device holds its own 1/N shards of zero1's state,
stacked one per device. flax's pmap examples (imagenet, wmt) handle a state
as a replicated one: ``jax_utils.unreplicate(state)`` (device 0's copy) to
save, evaluate or log it, and ``jax_utils.replicate`` of what they restored.
With zero1's state that hands every device device 0's shards: the other
devices' moments are gone, and the steps after it run on the wrong ones,
with no error (each shard still has the right shape).

:func:`warn_if_copied` runs beside :func:`.fresh_state.warn_if_new`, where
the update is traced, on the host: it finds the owner the step was called
with (a ``TrainState``, an ``nnx.Optimizer``) and reads the first leaves
of its inner state that are split over the devices and not all 0. A state
of zero1's own holds different data on each device there; where two such
leaves (or the only one) hold the same data on every local device, it warns
once. A legitimate state stops the scan at its first such leaf, after
reading two of its shards. Nothing of it is in the compiled step.

>>> import numpy as np
>>> from zero1_jax.core import copied_state
>>> copied_state.same_everywhere([np.ones(3), np.ones(3)])
True
>>> copied_state.same_everywhere([np.ones(3), np.arange(3.0)])
False
>>> copied_state.same_everywhere([np.zeros(3), np.zeros(3)]) is None   # says nothing
True
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zero1_jax.core import fresh_state

COPIED = (
    "zero1: every device holds the same shard of the optimizer state "
    "({paths} are equal on all {n} local devices). Under jax.pmap each "
    "device keeps its own 1/N of it, stacked one per device; a state copied "
    "from one device to all (flax's jax_utils.replicate of "
    "jax_utils.unreplicate(state), as flax's pmap examples save, restore "
    "and evaluate one) has lost the other devices' shards, and training "
    "goes on with the wrong moments. Keep the state as pmap stacks it: save "
    "jax.device_get(state) (every device's shard) and hand it back to pmap "
    "as it came out (in_axes=0), or step in plain jax.jit on a mesh, where "
    "the state is global (docs/limits_faq.md, jax.pmap).")


def same_everywhere(pieces: Sequence[Any]) -> bool | None:
  """Whether ``pieces`` (one leaf's data on each device) are all equal;
  None where they say nothing (fewer than 2, or the first all 0, as a new
  state's are)."""
  if len(pieces) < 2:
    return None
  first = np.asarray(pieces[0])
  if first.size < 2 or not first.any():
    return None
  return all(np.array_equal(first, np.asarray(p)) for p in pieces[1:])


def _pieces(x: Any) -> list | None:
  """The local device pieces of a concrete float array split over
  devices (a pmap-stacked or sharded one), lazily read; None otherwise."""
  x = fresh_state._value(x)
  if (not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer)
      or x.is_deleted() or not jnp.issubdtype(x.dtype, jnp.inexact)
      or x.sharding.is_fully_replicated):
    return None
  return [s.data for s in x.addressable_shards]


def copied_paths(inner: Any) -> tuple[list[str], int] | None:
  """``(paths, devices)`` of the leaves found equal on every local device,
  where the scan says the state was copied; None where it says not (or
  nothing)."""
  found: list[str] = []
  devices = 0
  for path, x in jax.tree_util.tree_flatten_with_path(inner)[0]:
    pieces = _pieces(x)
    if pieces is None:
      continue
    same = same_everywhere(pieces)
    if same is None:
      continue
    if not same:
      return None
    found.append("opt_state.inner" + jax.tree_util.keystr(path))
    devices = len(pieces)
    if len(found) == 2:
      break
  return (found, devices) if found else None


_SAID: set = set()


def warn_if_copied(tx: Any, strip: Callable[[Any], Any]) -> None:
  """Where the update is traced inside pmap or shard_map: warn
  (:data:`COPIED`), once per process, if the owner the step was called
  with holds the same inner-state shard on every local device."""
  owner = fresh_state.concrete_owner(tx)
  if owner is None:
    return
  try:
    found = copied_paths(strip(owner.opt_state).inner)
  except (AttributeError, TypeError):   # not a zero1 state (someone else's)
    return
  if found is None:
    return
  paths, n = found
  text = COPIED.format(paths=" and ".join(paths), n=n)
  if text not in _SAID:
    _SAID.add(text)
    warnings.warn(text, UserWarning, stacklevel=fresh_state._callers_level())
