"""Extra ``update`` arguments in the elementwise check.

zero1's ``update(updates, state, params, **extra_args)`` forwards extra
keyword arguments to the inner optimizer as ``optax.chain`` does
(``optax.with_extra_args_support``): a loss ``value=`` for
``reduce_on_plateau``, whatever a stateful schedule of
``inject_hyperparams`` or a ``conditionally_mask`` condition reads. The check
at ``tx.init`` cannot know them; an optimizer whose ``update`` cannot be
traced without them (:func:`deferrable`) is checked at its first update
instead, with the arguments it is given, and refused there only if it is
not elementwise with them (or they are missing).

In the check, an argument is an input the same on every device (zero1
hands each device the value it was given), not parameter-shaped data. A
non-scalar one that meets a shard broadcasts against it as against the
whole leaf only if it has size 1 along the shard dim (the same per row), and
otherwise fails to trace there (a refusal); where it makes the shard's
result another shape, the jaxpr check refuses the broadcast. The numeric
probe passes ones of each argument's shape and dtype.

Example:
  >>> import jax.numpy as jnp
  >>> arrays, rebuild = split({"value": jnp.float32(2.0), "name": "x"})
  >>> [a.shape for a in arrays], rebuild([7.0])
  ([()], {'name': 'x', 'value': 7.0})
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero1_jax.core import jaxpr_check as jc


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, float, int, complex,
                        bool)) or isinstance(x, jax.ShapeDtypeStruct)


def split(extra: dict | None) -> tuple[list, Callable[[list], dict]]:
  """``(abstract arrays, rebuild)``: the array-like leaves of ``extra`` as
  ShapeDtypeStructs, and a function putting values for them back in place
  (other leaves kept as they are)."""
  leaves, treedef = jax.tree.flatten(extra or {})
  is_arr = [_is_array(x) for x in leaves]
  arrays = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
            for x, a in zip(leaves, is_arr) if a]

  def rebuild(values: list) -> dict:
    it = iter(values)
    return treedef.unflatten([next(it) if a else x
                              for x, a in zip(leaves, is_arr)])
  return arrays, rebuild


def key(extra: dict | None) -> tuple | None:
  """What a verdict with these arguments depends on (names, shapes,
  dtypes); None where a leaf is not an array (its value is unknown)."""
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(extra or {})[0]:
    if not _is_array(x):
      return None
    out.append((jax.tree_util.keystr(path), tuple(jnp.shape(x)),
                str(jnp.result_type(x))))
  return tuple(out)


def taints(arrays: list) -> list:
  """The taint of each argument in the jaxpr check: none (module docstring)."""
  return [jc.Taint(False) for _ in arrays]


def stand_ins(arrays: list) -> list:
  """Ones of each argument's shape and dtype, for the numeric probe."""
  return [np.ones(a.shape, a.dtype) for a in arrays]


def updater(inner: optax.GradientTransformation,
            rebuild: Callable[[list], dict]) -> Callable:
  """``(g, s, q, values) -> inner.update(g, s, q, **extra)``: forwarded as
  zero1's update forwards them (none when there are none)."""
  def update(g, s, q, values=()):
    extra = rebuild(list(values))
    if not extra:
      return inner.update(g, s, q)
    return optax.with_extra_args_support(inner).update(g, s, q, **extra)
  return update


def takes_extra(inner: optax.GradientTransformation) -> bool:
  """Whether ``inner.update`` takes keyword arguments beyond optax's three."""
  try:
    sig = inspect.signature(inner.update)
  except (TypeError, ValueError):
    return False
  return any(p.kind in (p.VAR_KEYWORD, p.KEYWORD_ONLY)
             for p in sig.parameters.values())


UNTRACEABLE = "its update(grads, state, params) cannot be traced"
# What a function or a dict says when an argument it reads is not there.
_MISSING = ("TypeError: ", "KeyError: ")


def deferrable(inner: optax.GradientTransformation, why: str | None) -> bool:
  """A refusal at ``tx.init`` that the arguments of the first update may
  lift: ``update`` takes extra keyword arguments and could not be traced
  without them (a required argument missing, a key not found)."""
  if not (why and why.startswith(UNTRACEABLE) and takes_extra(inner)):
    return False
  error = why.split(": ", 1)[-1]
  return error.startswith(_MISSING) and (
      error.startswith("KeyError") or "missing" in error or "required" in error)


def missing(why: str | None) -> set:
  """The argument names a refusal says were missing (``missing 1 required
  keyword-only argument: 'value'``, ``KeyError: 'addendum'``)."""
  import re
  if not why:
    return set()
  error = why.split(": ", 1)[-1]
  if not (error.startswith("KeyError") or "missing" in error):
    return set()
  return set(re.findall(r"'([A-Za-z_][A-Za-z0-9_]*)'", error.split(":", 1)[-1]))
