"""zero1's refusal of an inner optimizer, in words.

:data:`REFUSAL` when it is not elementwise (the checks of
:mod:`.elementwise` say which operation, :mod:`.blame` which
transformation), :data:`DTYPE` when it decides by a parameter's dtype,
:data:`CANNOT_RUN` when its API does not fit the call zero1
makes on the shards, :data:`NESTED` when it is a wrapper zero1 goes inside
of (``optax.lookahead``, ``optax.contrib.sam``: the message gives that
form); :class:`Refused` raises any of them.

Example:
  >>> refusal("reduce_sum on parameter-shaped data").startswith(
  ...     "zero1: the inner optimizer is not elementwise (reduce_sum")
  True
"""

from __future__ import annotations

import optax

REFUSAL = (
    "zero1: the inner optimizer is not elementwise ({why}); ZeRO-1 runs it on "
    "1/N slices of each parameter, which would silently change its result. "
    "Use it unsharded (plain data parallel), or replace that transform with "
    "an elementwise one (adam, adamw, lion, sgd, rmsprop, adagrad, ...); for "
    "gradient clipping pass zero1(..., max_grad_norm=...) instead of "
    "optax.clip_by_global_norm; to skip steps whose gradients hold inf/nan "
    "(as optax.apply_if_finite does) pass "
    "zero1(..., loss_scale=z1.NoLossScale(skip_nonfinite=True)) (that skips "
    "the step, where optax.zero_nans zeroes the entries and still steps). If you "
    "know it to be elementwise (every number it computes for an element "
    "depends on that element alone), zero1(..., check_elementwise=False) "
    "skips this check.")


# Reasons that are not about elementwise arithmetic: the optimizer's API does
# not fit what zero1 calls (extra update arguments, a state that changes
# structure, an init or update that fails on the shards zero1 hands it).
CANNOT_RUN = (
    "zero1: the inner optimizer cannot run under zero1 ({why}). zero1 calls "
    "init(params) and update(grads, state, params) on each device's 1/N "
    "shards of the parameters (with the extra keyword arguments tx.update "
    "is given), and keeps the state's structure as init made it.{extra} Use "
    "it unsharded (plain data "
    "parallel), or an optimizer that fits that call; zero1(..., "
    "check_elementwise=False) skips this check if the check itself is what "
    "fails.")
_API_REASONS = ("its init fails on", "its state structure depends",
                "its update(grads, state, params) cannot be traced",
                "its updates or new state have another structure",
                "its update fails on the probe")


# Reasons that are a decision by dtype (:mod:`.dtype_check`): elementwise,
# but another computation on a bf16 param's fp32 master.
DTYPE = (
    "zero1: the inner optimizer decides by dtype ({why}). zero1 runs it on "
    "each bfloat16 or float16 parameter's float32 master (as DeepSpeed's "
    "bf16 optimizer does), where that decision would silently come out "
    "otherwise than on the params. Decide by path or name (a mask or labels "
    "from jax.tree_util.tree_map_with_path), or keep those params in "
    "float32; zero1(..., check_elementwise=False) skips this check.")
_DTYPE_REASONS = ("its update runs other operations on params in their own",
                  "its init runs other operations on params in their own",
                  "its state has another structure for params in their own")


# Wrappers zero1 goes inside of: they call their optimizer on whole
# gradients, and what they do around it does not fit zero1's call. Their
# name (blame.name) -> (why not around, the form to use).
NEST_INSIDE = {
    "optax.lookahead": (
        "its params are optax.LookaheadParams (fast and slow weights) while "
        "the gradients are the fast weights' only; zero1 shards one tree of "
        "params, gradients and updates",
        "optax.lookahead(z1.zero1(fast_optimizer, axis_name=...), "
        "sync_period, slow_step_size), called with the LookaheadParams as "
        "before: the fast optimizer's state is sharded 1/N; the slow "
        "weights stay whole, as the params do"),
    "optax.contrib.sam": (
        "its adversarial step usually normalizes the whole gradient "
        "(optax.contrib.normalize), and with opaque_mode=True its update "
        "evaluates grad_fn at perturbed params, which zero1 would hand it "
        "as 1/N shards",
        "optax.contrib.sam(z1.zero1(optimizer, axis_name=...), "
        "adv_optimizer, ...): the outer optimizer's state is sharded 1/N; "
        "the adversarial optimizer runs on the whole gradients"),
}
NESTED = ("zero1: {name} cannot run inside zero1 ({shown}): {reason}. Put "
          "zero1 inside it instead: {fix}. That form runs in a step of your "
          "own (tx.init / tx.update under jax.jit); z1.train_step and the "
          "DeepSpeed engine call zero1 themselves and take no wrapper around "
          "it.")


def refusal(why: str, where: str = "") -> str:
  """The refusal message for ``why``: :data:`NESTED` when ``where`` is a
  wrapper of :data:`NEST_INSIDE`, :data:`DTYPE` when it decides by dtype,
  :data:`CANNOT_RUN` when the optimizer's API does not fit zero1's call,
  else :data:`REFUSAL` (not elementwise);
  ``where`` (:func:`.blame.locate`: the refused transformation and its
  place) leads the parenthesis."""
  shown = f"{where}: {why}" if where else why
  name = _nested_in(where)
  if name:
    reason, fix = NEST_INSIDE[name]
    return NESTED.format(name=name, shown=shown, reason=reason, fix=fix)
  if why.startswith(_DTYPE_REASONS):
    return DTYPE.format(why=shown)
  if not why.startswith(_API_REASONS):
    return REFUSAL.format(why=shown)
  extra = ""
  if "'value_fn'" in why:
    extra = (" It is a line search: its update evaluates value_fn at trial "
             "params, the whole params each time, while zero1 updates each "
             "device's 1/N of them, so no argument zero1 passes makes it "
             "run. Use it unsharded (plain data parallel).")
  elif ("required keyword-only argument" in why or "required positional" in why
        or "KeyError" in why):
    extra = (" This one needs more (a loss value=, a schedule's argument, a "
             "per-example gradient or a function to evaluate): zero1 forwards "
             "tx.update's extra keyword arguments, tx.update(..., "
             "value=loss), and checks the optimizer with scalars for them at "
             "init; z1.train_step passes none.")
  return CANNOT_RUN.format(why=shown, extra=extra)


class Refused(ValueError):
  """The refusal ValueError (:func:`refusal`); ``why`` names the reason,
  ``where`` the refused transformation (may be empty)."""

  def __init__(self, why: str, where: str = ""):
    super().__init__(refusal(why, where))
    self.why, self.where = why, where


def _nested_in(where: str) -> str | None:
  """The :data:`NEST_INSIDE` wrapper ``where`` names as the refused part or
  as what holds it (``optax.contrib.normalize (..., in optax.contrib.sam)``)."""
  for name in NEST_INSIDE:
    if where.split(" (")[0] == name or f"in {name})" in where:
      return name
  return None


def check_params(params) -> None:
  """Raises :class:`Refused` for params zero1 cannot take whatever its
  inner optimizer: optax.LookaheadParams (checked at ``tx.init`` and
  ``tx.update`` also when ``check_elementwise=False``)."""
  if isinstance(params, optax.LookaheadParams):
    raise Refused("given optax.LookaheadParams",
                  "optax.lookahead")


def brief(e: Exception) -> str:
  """An exception in one line: its type and the first 200 characters."""
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
