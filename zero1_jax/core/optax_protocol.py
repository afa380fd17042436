"""What optax's protocol asks of zero1's ``init`` / ``update`` besides arrays.

* ``update``'s first argument is named ``updates``, as in
  ``optax.TransformUpdateFn``: ``tx.update(updates=g, state=s, params=p)``
  (``reduce_on_plateau``'s own tests call it so). ``grads=`` is taken too
  (zero1's earlier name).
* ``state=None`` for an inner optimizer that keeps no state
  (``optax.stateless``, ``scale``, ``clip``: optax's tests update those with
  ``None``): zero1 starts a fresh state, as ``tx.init(params)`` would make
  (:func:`check_none_state`), and returns the new one.
* ``optax.tree_utils.tree_map_params(tx, f, state, ...)`` calls ``tx.init``
  on a placeholder for the parameter tree: :func:`placeholder_state` gives
  the state with the inner optimizer's placeholders, so ``f`` maps its
  parameter-shaped trees (the padded, data-sharded moments) and the master
  copies count as other fields (their tree holds None where a param is its
  own master). For the shardings of zero1's state use
  :func:`zero1_jax.specs` / :func:`zero1_jax.state_shardings`: a
  parameter's spec mapped onto its moments replicates them over the data
  axis (tx.update then warns, core/placement.py).

Example:
  >>> updates_arg(None, {"grads": 1, "value": 2})
  (1, {'value': 2})
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero1_jax.core import layout as lay
from zero1_jax.core import precision
from zero1_jax.core.state import Zero1State

try:   # optax's parameter placeholder (tree_map_params); private there
  from optax.tree_utils._state_utils import _ParamsPlaceholder as _Placeholder
except ImportError:  # pragma: no cover - another optax: no such path
  _Placeholder = ()


class _Master:
  """Where a placeholder state has zero1's master copies: not a parameter
  tree for ``tree_map_params`` (a leaf that is not optax's placeholder)."""

  def __repr__(self):
    return "<zero1 master copies>"


_SCALARS = (bool, int, float, complex)


def arrays(tree: Any) -> Any:
  """Python scalar leaves (float, int, complex, bool) as jnp arrays, as
  optax's init and update make them (``jnp.zeros_like(1.0)`` is a float32
  scalar); other leaves as :func:`no_objects` leaves them."""
  return jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, _SCALARS)
                      else x, no_objects(tree))


def no_objects(tree: Any) -> Any:
  """``tree`` with None at each leaf that is neither an array nor a Python
  scalar (an Equinox model's activation function, a string): nothing to
  train there, as optax's ``sgd`` reads it. Boxes and Variables stay."""
  return jax.tree.map(lambda x: x if isinstance(x, _SCALARS) or (
      hasattr(x, "dtype") and hasattr(x, "shape")) else None, tree)


def untrained(params: Any, grads: Any) -> Any:
  """``params`` with None where ``grads`` holds None at a leaf that is no
  float array (an Equinox model passed whole to ``tx.update``: its int and
  bool fields, which ``eqx.filter_grad`` gives None), as optax's updates
  skip them; ``params`` as it is where the trees differ otherwise."""
  is_none = lambda x: x is None
  try:
    return jax.tree.map(
        lambda g, p: None if g is None and not jnp.issubdtype(
            getattr(p, "dtype", np.dtype(object)), jnp.inexact) else p,
        grads, params, is_leaf=is_none)
  except (ValueError, TypeError):
    return params


def is_placeholder(params: Any) -> bool:
  """Whether ``tx.init`` is handed tree_map_params' placeholder."""
  return bool(_Placeholder) and isinstance(params, _Placeholder)


def placeholder_state(inner: optax.GradientTransformation,
                      loss_scale: precision.LossScaleState) -> Zero1State:
  """:class:`Zero1State` with ``inner.init(placeholder)``'s placeholders."""
  return Zero1State(_Master(), inner.init(_Placeholder()), loss_scale)


def updates_arg(updates: Any, extra_args: dict) -> tuple[Any, dict]:
  """``(updates, the other keyword arguments)``: ``grads=`` taken for
  ``updates``; TypeError if neither or both are given."""
  if "grads" in extra_args:
    if updates is not None:
      raise TypeError("zero1: update got both updates= and grads=; pass the "
                      "gradients once (optax names them updates).")
    extra_args = dict(extra_args)
    updates = extra_args.pop("grads")
  if updates is None:
    raise TypeError("zero1: update needs the gradients: tx.update(updates, "
                    "state, params).")
  return updates, extra_args


STATEFUL = (
    "zero1: update got state=None, but {why}. Pass the state "
    "tx.init(params) returned (and then the one each update returns); "
    "state=None is for an inner optimizer that keeps no state, as in optax.")


def leafless(state: Any) -> bool:
  """Whether ``state`` is an empty state of optax's own (``{}``,
  ``optax.EmptyState()``), as optax's tests hand a stateless transformation:
  read as None (zero1's own state always holds its loss-scale scalars)."""
  return not isinstance(state, Zero1State) and not jax.tree.leaves(state)


def check_none_state(inner: optax.GradientTransformation, params: Any,
                     loss_scale: precision.LossScale | None) -> None:
  """ValueError unless ``update(..., state=None, ...)`` can start from a
  fresh state: the inner optimizer keeps no state (no leaves on these
  params), and no dynamic loss scale is carried (fp16 params)."""
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x),
                                                       lay.leaf_dtype(x)),
                        params)
  try:
    leaves = jax.tree.leaves(jax.eval_shape(inner.init, shapes))
  except Exception:  # noqa: BLE001 - init fails on whole params: tx.init says why
    leaves = []
  if leaves:
    raise ValueError(STATEFUL.format(
        why=f"the inner optimizer keeps state ({len(leaves)} arrays)"))
  fp16 = any(lay.leaf_dtype(x) == jnp.float16 for x in jax.tree.leaves(params))
  if (loss_scale is None and fp16) or isinstance(loss_scale,
                                                 precision.DynamicLossScale):
    raise ValueError(STATEFUL.format(
        why="a dynamic loss scale (fp16) is state carried between steps"))
