"""A zero1 state that is new where the training is not: said at its first update.

flax's ``checkpoints.restore_checkpoint`` of an optax run's checkpoint into
a ``TrainState`` whose tx is zero1 restores the params and the step and fills
zero1's state from the target: moments 0, count 0. The learning-rate warmup
restarts and the run drifts from optax's own continuation (0.17, the largest
weight difference after 20 steps), with no error. orbax's restore with
``partial_restore=True``, which its structure error suggests, does the same.
The state alone cannot tell: it is what ``tx.init`` makes. Its owner can:
flax's ``TrainState.apply_gradients`` and ``nnx.Optimizer.update`` call
``tx.update`` without their step, so :func:`owner_step` finds the object
calling it (one whose ``tx`` is this transformation).

:func:`warn_if_new` runs where the update is traced (or run eagerly), on the
host, never in the compiled step: it finds the owner the step was called
with, whose values are concrete in the caller's frames (the jitted
function's arguments, the loop's variable), and warns, once, where its step
is past 0 while zero1 has run no update on its state (``loss_scale.step``
0) and the inner state is as ``init`` makes it (its integer counts 0, its
parameter-shaped leaves 0), naming what restores the optimizer state:
``z1.flax.restore_checkpoint`` and ``z1.from_optax_state``. A check inside
the step (a ``jax.debug.callback`` under ``lax.cond``) cost 2.1x the step on
an H200 (BERT-base fp32: 21.9 ms against 10.4 without; it syncs the host
with the device every step and takes jax's C++ dispatch away), so there is
none. What that leaves unsaid: a new state given to a step already
compiled in this process (no trace), or a step called with an owner that no
caller's frame holds. Nor is it said where the owner's flax ``DynamicScale``
shows only overflows so far (:func:`overflowing`): those steps keep the
state new.

>>> import warnings, jax, optax, zero1_jax as z1
>>> from flax.training import train_state
>>> mesh = jax.make_mesh((1,), ("data",))
>>> tx = z1.zero1(optax.adam(1e-3), axis_name="data", mesh=mesh)
>>> s = train_state.TrainState.create(apply_fn=None, params={"w": jax.numpy.ones(8)}, tx=tx)
>>> with warnings.catch_warnings(record=True) as said:
...   warnings.simplefilter("always")
...   _ = jax.jit(lambda s: s.apply_gradients(grads=s.params))(s.replace(step=3))
>>> "optimizer state is new" in str(said[-1].message)
True
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


NEW_STATE = (
    "zero1: the optimizer state is new (zero1 has run no update on it and "
    "its counts and moments are 0) but the training's step is {step}: a "
    "checkpoint of an optax run restored with flax's "
    "checkpoints.restore_checkpoint (or orbax's restore with "
    "partial_restore=True) fills zero1's state from the target, so the "
    "moments and the learning-rate schedule restart. Restore it with "
    "z1.flax.restore_checkpoint(ckpt_dir, state) (optax or zero1 "
    "checkpoints), or convert the optax state you restored with "
    "z1.from_optax_state(tx, optax_state, params).")


def _value(x: Any) -> Any:
  """``x`` with an nnx Variable's wrapper taken off."""
  return x.get_value() if hasattr(x, "get_value") else x


def owner_step(tx: Any, frames: int = 3) -> Any:
  """The ``step`` of the object whose ``tx`` is ``tx`` and that called
  ``tx.update`` (flax ``TrainState``, ``nnx.Optimizer``), within ``frames``
  callers of :func:`zero1_jax.zero1`'s update; None where there is none."""
  f = sys._getframe(2)   # update's caller
  for _ in range(frames):
    if f is None:
      return None
    owner = f.f_locals.get("self")
    if owner is not None and getattr(owner, "tx", None) is tx:
      step = getattr(owner, "step", None)
      if step is None:
        return None
      step = _value(step)
      return step if jnp.ndim(step) == 0 else None
    f = f.f_back
  return None


def _concrete(x: Any) -> bool:
  """A number or an array with a value (not a tracer, not a spec, not an
  array donated to an earlier step and deleted)."""
  x = _value(x)
  if isinstance(x, jax.core.Tracer):
    return False
  if isinstance(x, jax.Array):
    return not x.is_deleted()
  return isinstance(x, (int, np.integer, np.ndarray))


def _candidates(v: Any):
  """``v`` and, one level down, what a tuple, list or dict holds (a
  jitted function's ``args``)."""
  yield v
  if isinstance(v, (tuple, list)) and len(v) <= 64:
    yield from v
  elif isinstance(v, dict) and len(v) <= 64:
    yield from v.values()


def _owns(c: Any, tx: Any) -> bool:
  """Whether ``c`` holds ``tx`` with a concrete step and a state. Any
  object of a caller's frame is asked: one whose attributes raise is not
  an owner."""
  try:
    return (getattr(c, "tx", None) is tx and hasattr(c, "opt_state")
            and _concrete(c.step))
  except Exception:   # noqa: BLE001 - a property of someone else's object
    return False


def concrete_owner(tx: Any, frames: int = 64) -> Any:
  """The nearest object in the callers' frames whose ``tx`` is ``tx`` and
  whose ``step`` is a value, not a tracer: the owner the traced step was
  called with (in the jitted function's arguments, found before the loop's
  other variables). None where no frame holds one."""
  f = sys._getframe(1)
  for _ in range(frames):
    if f is None:
      return None
    for v in list(f.f_locals.values()):
      for c in _candidates(v):
        if _owns(c, tx):
          return c
    f = f.f_back
  return None


def _telling(state: Any) -> list:
  """The inner state's leaves that a new state has at 0: integer scalars
  (counts) and parameter-shaped floats (moments), not hyperparameters."""
  out = []
  for x in jax.tree.leaves(state.inner):
    dt = jnp.result_type(x)
    if ((jnp.issubdtype(dt, jnp.integer) and jnp.ndim(x) == 0)
        or (jnp.issubdtype(dt, jnp.inexact) and jnp.ndim(x) > 0)):
      out.append(x)
  return out


def _scalar(x: Any) -> Any:
  """A replicated scalar's value on this host (its first local copy: no
  collective, so it holds in a multi-process run too); stacked one per
  device by ``jax.pmap``, the first device's."""
  x = _value(x)
  if isinstance(x, jax.Array):
    x = x.addressable_data(0)
  x = np.asarray(x)
  return x.reshape(-1)[0] if x.ndim and x.size else x


def _all_zero(x: Any) -> bool:
  """Whether this process's pieces of ``x`` are all 0 (no collective). Read
  only where the scalars say the state is new: once a run, a shard at a
  time, stopping at the first nonzero."""
  if not isinstance(x, jax.Array):
    return not np.any(np.asarray(x))
  return not any(np.any(np.asarray(s.data)) for s in x.addressable_shards)


def is_new(step: Any, state: Any) -> bool:
  """``step`` > 0 while ``state`` (a concrete zero1 state) is as ``init``
  makes it. The scalars first; only where they say so are the moments
  read. A migrated state has a nonzero count or moment but in contrived
  cases (every moment element of this process's shards 0)."""
  leaves = [step, state.loss_scale.step, *_telling(state)]
  if not all(map(_concrete, leaves)):
    return False
  if int(_scalar(step)) <= 0 or int(_scalar(state.loss_scale.step)) != 0:
    return False
  for x in leaves[2:]:
    if jnp.ndim(x) == 0 and np.any(_scalar(x)):
      return False
  return all(_all_zero(x) for x in leaves[2:] if jnp.ndim(x) > 0)


def overflowing(owner: Any, step: Any) -> bool:
  """Whether ``owner`` carries flax's ``DynamicScale`` whose last step was
  not finite (``fin_steps`` 0), at a ``step`` of at most :data:`OVERFLOWS`.
  flax's fp16 loops (its imagenet example) keep the optimizer state on such
  a step, so while every step so far has overflowed the state is new at a
  step past 0 by design: nothing to say. A run restored from a checkpoint
  has its dynamic scale restored too, with the finite steps it counted;
  only one saved right after an overflow has ``fin_steps`` 0, and past
  :data:`OVERFLOWS` steps it is still warned about."""
  fin = getattr(getattr(owner, "dynamic_scale", None), "fin_steps", None)
  return (fin is not None and _concrete(fin) and int(_scalar(fin)) == 0
          and int(_scalar(step)) <= OVERFLOWS)


# Overflows in a row that a dynamic scale can explain: flax's starts at 2^16
# and halves on each one; 64 take it to 2^-48, where a loss still
# overflowing is not finite unscaled either, and no scale is to blame.
OVERFLOWS = 64


_SAID: set = set()


def warn_if_new(tx: Any, strip: Callable[[Any], Any]) -> None:
  """Where the update is traced or run: warn (:data:`NEW_STATE`), once per
  process, if the owner the step was called with (:func:`concrete_owner`)
  has a step past 0 and a new zero1 state (:func:`is_new`). ``strip``
  takes the owner's wrappers (nnx Variables, boxes) off its state."""
  owner = concrete_owner(tx)
  if owner is None:
    return
  step, state = _value(owner.step), strip(owner.opt_state)
  if is_new(step, state) and not overflowing(owner, step):
    text = NEW_STATE.format(step=int(_scalar(step)))
    if text not in _SAID:
      _SAID.add(text)
      warnings.warn(text, UserWarning, stacklevel=_callers_level())


_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "zero1_jax", "equinox")


def _callers_level() -> int:
  """The ``stacklevel`` of the first frame outside jax, flax, optax and
  zero1 (the line that called the step), for the warning to point at."""
  f, level = sys._getframe(2), 2   # warn_if_new's caller is level 2
  while f is not None:
    if str(f.f_globals.get("__name__", "")).split(".")[0] not in _LIBRARIES:
      return level
    f, level = f.f_back, level + 1
  return 2
