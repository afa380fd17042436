"""Dynamic loss scaling with DeepSpeed's semantics, as a pure state machine.

DeepSpeed's ``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/
loss_scaler.py) after every optimizer step:

* overflow: if ``hysteresis == 1`` (or the configured hysteresis is 1), the
  scale is divided by 2, never below ``min_loss_scale``; otherwise the
  remaining hysteresis is decremented and the scale kept. The step index is
  remembered as the last overflow. The step itself is skipped.
* no overflow: with ``consecutive_hysteresis`` the hysteresis is refilled.
  Let ``stable = step - last_overflow - 1``; when ``stable > 0`` and
  ``stable % loss_scale_window == 0`` the scale doubles (refilling the
  hysteresis when not consecutive).
* the step index advances in both cases.

DeepSpeed raises when an overflow happens at the minimum scale; a jitted step
cannot raise, so the state keeps the scale at the minimum and
:class:`zero1_jax.deepspeed.engine.Engine` raises on the host instead.

Example:
  >>> cfg = DynamicLossScale(initial_scale_power=4, loss_scale_window=2,
  ...                        hysteresis=1)
  >>> s = cfg.init()
  >>> s = cfg.update(s, overflow=True)
  >>> float(s.scale)
  8.0
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass, data_fields=(
    "scale", "step", "last_overflow", "hysteresis"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class LossScaleState:
  """Loss-scaler state; every field is a replicated scalar.

  A dataclass, not a NamedTuple, so that ``optax.tree_utils.tree_get`` /
  ``tree_set``, which match the fields of NamedTuples and dicts by name,
  find ``reduce_on_plateau``'s ``scale`` alone in a zero1 state, as in
  optax's (its paths, ``loss_scale.scale``, are a NamedTuple's).
  """

  scale: jax.Array              # f32[]  current loss scale (1.0 when off)
  step: jax.Array               # i32[]  DeepSpeed's cur_iter
  last_overflow: jax.Array      # i32[]  DeepSpeed's last_overflow_iter
  hysteresis: jax.Array         # i32[]  DeepSpeed's cur_hysteresis

  def __post_init__(self):
    _for_flax()

  def _replace(self, **fields) -> "LossScaleState":   # NamedTuple's reads
    return dataclasses.replace(self, **fields)

  def _asdict(self) -> dict:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_FLAX: list = []


def _for_flax() -> None:
  """:class:`LossScaleState` in ``flax.serialization``'s registry, once flax
  is loaded: ``to_state_dict`` / ``to_bytes`` / ``from_bytes`` read it as
  the NamedTuple it was, field by field (big_vision names a state's leaves
  through ``to_state_dict``; an unregistered class is left an object there,
  and ``to_bytes`` refuses it)."""
  ser = sys.modules.get("flax.serialization")
  if _FLAX or ser is None:
    return
  _FLAX.append(ser)
  names = [f.name for f in dataclasses.fields(LossScaleState)]
  ser.register_serialization_state(
      LossScaleState,
      lambda s: {k: ser.to_state_dict(getattr(s, k)) for k in names},
      lambda s, d: s._replace(**{k: ser.from_state_dict(getattr(s, k), d[k], name=k)
                                 for k in names}),
      override=True)


def _count(state: LossScaleState, overflow) -> LossScaleState:
  """One more step; ``last_overflow`` set to it if it overflowed."""
  return state._replace(
      step=state.step + 1,
      last_overflow=jnp.where(overflow, state.step, state.last_overflow))


@dataclasses.dataclass(frozen=True)
class NoLossScale:
  """No loss scaling (fp32 and bf16 training).

  By default every step is applied, as in optax. ``skip_nonfinite=True``
  skips a step whose global gradient norm is inf/nan (master weights and
  inner state kept, so Adam's count and the lr schedule do not advance), as
  DeepSpeed 0.19's ZeRO-1 does for fp32 and for bf16 with
  ``check_grad_overflow``.
  """

  skip_nonfinite: bool = False
  dynamic: bool = dataclasses.field(default=False, init=False)

  def init(self) -> LossScaleState:
    return _state(1.0, 1)

  def update(self, state: LossScaleState, overflow) -> LossScaleState:
    # No scale to change; the counters say where a non-finite step was (in
    # plain jit, where no metrics come back): ``last_overflow`` is the
    # ``step`` of the latest one, -1 if none
    return _count(state, overflow)

  @property
  def skips_on_overflow(self) -> bool:
    return self.skip_nonfinite


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """A fixed loss scale (DeepSpeed ``fp16.loss_scale`` > 0).

  Like DeepSpeed's static ``LossScaler``, overflowing steps are skipped.
  """

  scale: float
  dynamic: bool = dataclasses.field(default=False, init=False)

  def __post_init__(self):
    if not self.scale > 0:
      raise ValueError(f"loss scale must be > 0, got {self.scale}")

  def init(self) -> LossScaleState:
    return _state(self.scale, 1)

  def update(self, state: LossScaleState, overflow) -> LossScaleState:
    return _count(state, overflow)

  @property
  def skips_on_overflow(self) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """DeepSpeed's dynamic loss scaler; the defaults are DeepSpeed's fp16 ones."""

  initial_scale_power: int = 16
  loss_scale_window: int = 1000
  hysteresis: int = 2
  consecutive_hysteresis: bool = False
  min_loss_scale: float = 1.0
  scale_factor: float = 2.0
  dynamic: bool = dataclasses.field(default=True, init=False)

  def __post_init__(self):
    if self.loss_scale_window < 1:
      raise ValueError("loss_scale_window must be >= 1, got "
                       f"{self.loss_scale_window}")
    if self.hysteresis < 1:
      raise ValueError(f"hysteresis must be >= 1, got {self.hysteresis}")
    if not self.min_loss_scale > 0:
      raise ValueError(f"min_loss_scale must be > 0, got {self.min_loss_scale}")

  def init(self) -> LossScaleState:
    return _state(2.0 ** self.initial_scale_power, self.hysteresis)

  @property
  def skips_on_overflow(self) -> bool:
    return True

  def update(self, state: LossScaleState, overflow) -> LossScaleState:
    overflow = jnp.asarray(overflow)
    # Overflow branch.
    shrink = (self.hysteresis == 1) | (state.hysteresis == 1)
    o_scale = jnp.where(shrink, jnp.maximum(state.scale / self.scale_factor,
                                            self.min_loss_scale), state.scale)
    o_hyst = jnp.where(shrink, state.hysteresis, state.hysteresis - 1)
    # No-overflow branch.
    stable = state.step - state.last_overflow - 1
    grow = (stable > 0) & (stable % self.loss_scale_window == 0)
    n_scale = jnp.where(grow, state.scale * self.scale_factor, state.scale)
    refill = jnp.int32(self.hysteresis)
    if self.consecutive_hysteresis:
      n_hyst = refill
    else:
      n_hyst = jnp.where(grow, refill, state.hysteresis)
    return LossScaleState(
        scale=jnp.where(overflow, o_scale, n_scale).astype(jnp.float32),
        step=state.step + 1,
        last_overflow=jnp.where(overflow, state.step, state.last_overflow),
        hysteresis=jnp.where(overflow, o_hyst, n_hyst).astype(jnp.int32))


LossScale = NoLossScale | StaticLossScale | DynamicLossScale


def loss_factor(policy: LossScale, state: LossScaleState) -> jax.Array:
  """What the loss is multiplied by before differentiating: ``state.scale``,
  or without loss scaling 1 (a constant XLA drops: the same values), as
  :func:`scale_of` reads it."""
  if isinstance(policy, NoLossScale):
    return jnp.ones((), jnp.float32)
  return state.scale


def scale_of(policy: LossScale, state: LossScaleState) -> jax.Array:
  """The factor the loss was multiplied by: ``state.scale``, or 1 without
  loss scaling whatever the state holds."""
  if isinstance(policy, NoLossScale):
    # 1, but read from the state as before (XLA folds 0 * x only for
    # integers): with a constant 1 XLA rewrites the gradients' scaling
    # arithmetic and rounds otherwise (tests/test_fp32_master.py holds a
    # stored run bitwise).
    return 1 + 0 * state.scale
  return state.scale


def for_params(given: LossScale | None, params) -> LossScale:
  """The policy a step on ``params`` uses: ``given`` (``zero1(loss_scale=)``),
  else :class:`DynamicLossScale` (DeepSpeed's defaults) when any parameter
  is float16, else :class:`NoLossScale`."""
  if given is not None:
    return given
  fp16 = any(jnp.dtype(x.dtype) == jnp.float16 for x in jax.tree.leaves(params))
  return DynamicLossScale() if fp16 else NoLossScale()


def _state(scale: float, hysteresis: int) -> LossScaleState:
  return LossScaleState(scale=jnp.asarray(scale, jnp.float32),
                        step=jnp.asarray(0, jnp.int32),
                        last_overflow=jnp.asarray(-1, jnp.int32),
                        hysteresis=jnp.asarray(hysteresis, jnp.int32))
