"""zero1's refusal of an inner optimizer, in words.

:data:`REFUSAL` when it is not elementwise (the checks of
:mod:`.elementwise` say which operation, :mod:`.blame` which
transformation), :data:`CANNOT_RUN` when its API does not fit the call zero1
makes on the shards; :class:`Refused` raises either.

Example:
  >>> refusal("reduce_sum on parameter-shaped data").startswith(
  ...     "zero1: the inner optimizer is not elementwise (reduce_sum")
  True
"""

from __future__ import annotations

REFUSAL = (
    "zero1: the inner optimizer is not elementwise ({why}); ZeRO-1 runs it on "
    "1/N slices of each parameter, which would silently change its result. "
    "Use it unsharded (plain data parallel), or replace that transform with "
    "an elementwise one (adam, adamw, lion, sgd, rmsprop, adagrad, ...); for "
    "gradient clipping pass zero1(..., max_grad_norm=...) instead of "
    "optax.clip_by_global_norm; to skip steps whose gradients hold inf/nan "
    "(optax.apply_if_finite, zero_nans) pass "
    "zero1(..., loss_scale=z1.NoLossScale(skip_nonfinite=True)). If you "
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


def refusal(why: str, where: str = "") -> str:
  """The refusal message for ``why``: :data:`CANNOT_RUN` when the optimizer's
  API does not fit zero1's call, else :data:`REFUSAL` (not elementwise);
  ``where`` (:func:`.blame.locate`: the refused transformation and its
  place) leads the parenthesis."""
  shown = f"{where}: {why}" if where else why
  if not why.startswith(_API_REASONS):
    return REFUSAL.format(why=shown)
  extra = ""
  if ("required keyword-only argument" in why or "required positional" in why
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


def brief(e: Exception) -> str:
  """An exception in one line: its type and the first 200 characters."""
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
