"""A zero1 state that is new where the training is not: said at its first update.

flax's ``checkpoints.restore_checkpoint`` of an optax run's checkpoint into
a ``TrainState`` whose tx is zero1 restores the params and the step and fills
zero1's state from the target: moments 0, count 0. The learning-rate warmup
restarts and the run drifts from optax's own continuation (0.17, the largest
weight difference after 20 steps), with no error. orbax's restore with
``partial_restore=True``, which its structure error suggests, does the same.
The state alone cannot tell: it is what ``tx.init`` makes. Its owner can:
flax's ``TrainState.apply_gradients`` and ``nnx.Optimizer.update`` call
``tx.update`` without their step, so :func:`owner_step` reads the step of
the object calling it (one whose ``tx`` is this transformation), and
:func:`warn_if_new` warns, at run time and once, where that step is past 0
while zero1 has run no update on this state (``loss_scale.step`` 0) and the
inner state is as ``init`` makes it (its integer counts 0, its
parameter-shaped leaves 0), naming what restores the optimizer state:
``z1.flax.restore_checkpoint`` and ``z1.from_optax_state``.

A state made fresh on purpose mid-run (``state.replace(opt_state=
tx.init(params))``) is said too, once.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zero1_jax.core import platform as platforms

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
      if hasattr(step, "get_value"):   # an nnx Variable
        step = step.get_value()
      return step if jnp.ndim(step) == 0 else None
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


def _say(step, *leaves) -> None:
  """Runs per device on its own pieces (no collective): warns if they are
  all 0. A migrated state has a nonzero count or moment on every device but
  in contrived cases (every moment element of a device's shards 0)."""
  if not any(np.any(np.asarray(x)) for x in leaves):
    text = NEW_STATE.format(step=int(np.asarray(step)))
    with _LOCK:   # the devices' callbacks may run side by side: say it once
      if text in _SAID:
        return
      _SAID.add(text)
    warnings.warn(text, UserWarning)


_SAID: set = set()
_LOCK = threading.Lock()


def _runs_here() -> bool:
  """Whether the program being traced can run on this machine, and so call
  back to the host: not one compiled for devices jax has no backend for
  (``z1.inspect.gpu``'s compile-only GPUs, where lowering the callback
  failed with "Unknown backend: 'gpu'"). Such a program never runs: no
  state of it to warn about."""
  try:
    jax.devices(platforms.resolve())
  except RuntimeError:
    return False
  return True


def warn_if_new(state: Any, step: Any) -> None:
  """At run time: warn (:data:`NEW_STATE`) where ``step`` > 0 and ``state``
  is new. The scalars are compared in the step (two compares); only where
  they say so does each device read its own counts and moment shards, on
  the host, for a new state's zeros (a callback per device, no collective)."""
  if not _runs_here():
    return
  step = jnp.asarray(step)
  maybe = (step > 0) & (state.loss_scale.step == 0)
  leaves = _telling(state)
  jax.lax.cond(maybe, lambda: jax.debug.callback(_say, step, *leaves,
                                                 partitioned=True),
               lambda: None)
