"""The inner optimizer's state on 1/N shards: which leaves are sharded.

ZeRO-1 hands the inner optimizer this device's shard of every parameter
(:func:`shard_inputs`). Its state must then be shaped like those shards or
replicated (counts, hyperparameters, keys): :func:`state_shard_dims` reads
which state leaf is sharded on which dim, like which parameter, from two
abstract inits, and refuses state shaped like no parameter shard
(adafactor's factored moments).

Example:
  >>> import jax.numpy as jnp, optax
  >>> from zero1_jax.core import layout as lay
  >>> _, dims, _, owners = state_shard_dims(
  ...     optax.adam(1e-3), lay.plan({"w": jnp.zeros((5, 3))}, 4))
  >>> dims, owners   # count, mu, nu: mu and nu on w's shard dim (3 -> 4)
  ([None, 1, 1], [None, 0, 0])
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero1_jax.core import layout as lay
from zero1_jax.core.refusal import Refused, brief


def leaf_dtype(spec: lay.LeafSpec, dtype: Any) -> np.dtype:
  """The dtype the inner optimizer sees at a leaf: its master dtype
  (:func:`.layout.master_dtype`) for the configured master ``dtype``."""
  return lay.master_dtype(spec.dtype, dtype)


def shard_inputs(layout: lay.Layout, dtype: Any) -> Any:
  """The param-structured tree of ShapeDtypeStructs the inner optimizer sees
  on one device (None at static leaves)."""
  return layout.inner_tree([jax.ShapeDtypeStruct(s.shard_shape,
                                                 leaf_dtype(s, dtype))
                            for s in layout.leaves])


def _handed(layout: lay.Layout) -> str:
  """What zero1 hands the inner optimizer, in words (for init failures)."""
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(
      layout.treedef.unflatten(range(len(layout.leaves))))[0]]
  static = [p for p, s in zip(paths, layout.leaves) if s.kind == lay.STATIC]
  if not static:
    return "the parameter shards zero1 hands it"
  return ("the parameter tree zero1 hands it (None at the integer and "
          f"zero-size leaves {', '.join(static)}, which it never updates)")


def state_shard_dims(inner: optax.GradientTransformation, layout: lay.Layout,
                     dtype: Any = jnp.float32) -> tuple[Any, list, list, list]:
  """``(treedef, dims, shapes, owners)`` of ``inner``'s state on ``layout``'s
  shards: per state leaf, the dim it is sharded on like its parameter, or
  None (replicated: counts, hyperparameters, keys, scalar-parameter moments,
  moments of leaves not split over the data axis); and the index of the
  parameter leaf it is shaped like, or None (nothing parameter-shaped).

  ``inner.init`` is evaluated abstractly on the shard shapes and again with
  leaf ``i``'s shard dim (dim 0 for an unsplit, non-scalar leaf) grown by
  ``i + 1``; a leaf whose shape moves must be shaped like leaf ``i``'s shard
  in both, else :class:`Refused`.
  """
  def grows(s):
    return s.kind == lay.SHARD or (s.kind == lay.REPLICATE and s.shape)

  def shards(grow: bool):
    out = []
    for i, s in enumerate(layout.leaves):
      shape = list(s.shard_shape)
      if grow and grows(s):
        shape[max(s.dim, 0)] += i + 1
      out.append(jax.ShapeDtypeStruct(tuple(shape), leaf_dtype(s, dtype)))
    return layout.inner_tree(out)

  try:
    a, b = (jax.eval_shape(inner.init, shards(g)) for g in (False, True))
  except Exception as e:  # noqa: BLE001 - an init that fails is refused
    raise Refused(f"its init fails on {_handed(layout)}: {brief(e)}") from e
  a_leaves, a_def = jax.tree.flatten_with_path(a)
  b_leaves, b_def = jax.tree.flatten(b)
  if a_def != b_def:
    raise Refused("its state structure depends on the parameter shapes")
  by_grow = {i + 1: i for i, s in enumerate(layout.leaves) if grows(s)}
  dims, owners = [], []
  for (path, x), y in zip(a_leaves, b_leaves):
    if x.shape == y.shape:
      dims.append(None)
      owners.append(None)
      continue
    delta = [j for j, (u, v) in enumerate(zip(x.shape, y.shape)) if u != v]
    i = (by_grow.get(y.shape[delta[0]] - x.shape[delta[0]])
         if len(x.shape) == len(y.shape) and len(delta) == 1 else None)
    hit = None if i is None else layout.leaves[i]
    if hit is None or x.shape != hit.shard_shape:
      raise Refused(f"state leaf {jax.tree_util.keystr(path)} of shape "
                    f"{x.shape} is not shaped like any parameter shard")
    dims.append(hit.dim if hit.kind == lay.SHARD else None)
    owners.append(i)
  return a_def, dims, [x.shape for _, x in a_leaves], owners
