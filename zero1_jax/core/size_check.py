"""Whether an inner optimizer does on a 1/N shard what it does on the whole leaf.

An optimizer, a mask or a ``multi_transform`` label may decide in Python, by
a leaf's size or shape, what to compute: ``optax.scale_by_factored_rms``
factors the second moment of leaves whose two largest dims reach
``min_dim_size_to_factor`` (128), ``mask=lambda p: p.size >= 256`` decays
only large leaves. Under ZeRO-1 the inner optimizer sees this device's rows,
so the decision flips with N: a (256, 256) kernel is factored whole but not as
a (32, 256) shard at N=8, and a 512-element kernel is decayed whole but not as
64-element slices. Each shard's computation is then elementwise, so neither
the jaxpr check (it reads the program on the shards) nor the numeric probe
(it runs small stand-in leaves) can see that it is another computation.

:func:`size_reason` traces ``inner.init`` and ``inner.update`` abstractly (no
compile, no memory) on the whole parameters and on the shards. The state must
have the same structure, each state leaf shaped like a parameter shard must
be shaped like the whole parameter there, and both updates must run the same
operations in the same order (sizes and constants aside).

Example:
  >>> import jax.numpy as jnp, optax
  >>> from zero1_jax.core import layout as lay
  >>> from zero1_jax.core.elementwise import state_shard_dims
  >>> L = lay.plan({"w": jnp.zeros((256, 256))}, 8)
  >>> why = lambda tx: size_reason(tx, L, jnp.float32, state_shard_dims(tx, L)[3])
  >>> why(optax.adam(1e-3)) is None
  True
  >>> print(why(optax.scale_by_factored_rms()))
  ... # doctest: +ELLIPSIS
  state leaf .v_row['w'] has shape (256,) for the whole parameter ['w'] (256, 256) but (1,) for its 1/N shard ...
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import optax

from zero1_jax.core import layout as lay

FIX = ("decide by ndim or by path instead of by size or shape (under zero1 "
       "the optimizer, its masks and labels see 1/N of each parameter)")


def _inputs(layout: lay.Layout, dtype: Any, whole: bool) -> Any:
  return layout.inner_tree([
      jax.ShapeDtypeStruct(s.shape if whole else s.shard_shape,
                           lay.master_dtype(s.dtype, dtype))
      for s in layout.leaves])


def _ops(jaxpr) -> list[str]:
  """The primitives ``jaxpr`` runs, in order, sub-programs (pjit, cond
  branches, loops, custom rules) bracketed in place; no shapes, no values."""
  out = []
  for eqn in jaxpr.eqns:
    out.append(str(eqn.primitive))
    for v in eqn.params.values():
      for j in v if isinstance(v, (tuple, list)) else (v,):
        j = getattr(j, "jaxpr", j)
        if hasattr(j, "eqns"):
          out += ["{", *_ops(j), "}"]
  return out


def _program(inner: optax.GradientTransformation, p: Any, state: Any):
  return jax.make_jaxpr(lambda g, s, q: inner.update(g, s, q))(p, state, p).jaxpr


def size_reason(inner: optax.GradientTransformation, layout: lay.Layout,
                dtype: Any, owners: Sequence[int | None]) -> str | None:
  """Why ``inner`` computes something else on ``layout``'s shards than on
  the whole parameters, or None. ``owners``: per state leaf on the shards,
  the parameter leaf it is shaped like, or None
  (:func:`.elementwise.state_shard_dims`)."""
  whole, shards = _inputs(layout, dtype, True), _inputs(layout, dtype, False)
  try:
    s_whole = jax.eval_shape(inner.init, whole)
  except Exception as e:  # noqa: BLE001 - the shards' init succeeded
    return (f"its init fails on the whole parameters but not on a shard "
            f"({type(e).__name__}); {FIX}")
  s_shard = jax.eval_shape(inner.init, shards)
  w_leaves, w_def = jax.tree.flatten_with_path(s_whole)
  s_leaves, s_def = jax.tree.flatten(s_shard)
  if w_def != s_def:
    return (f"its state has another structure for the whole parameters than "
            f"for a shard (a mask or label by size?); {FIX}")
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(
      layout.treedef.unflatten(range(len(layout.leaves))))[0]]
  for (path, w), s, i in zip(w_leaves, s_leaves, owners):
    want = s.shape if i is None else layout.leaves[i].shape
    if w.shape != want:
      name = jax.tree_util.keystr(path)
      if i is None:   # not shaped like a shard: the parameter its path ends in
        i = max((j for j, p in enumerate(paths) if name.endswith(p)),
                key=lambda j: len(paths[j]), default=None)
      where = ("parameters but {} for their 1/N shards" if i is None else
               f"parameter {paths[i]} {layout.leaves[i].shape} but {{}} for "
               f"its 1/N shard").format(s.shape)
      return (f"state leaf {name} has shape {w.shape} "
              f"for the whole {where} (factored moments, as optax.adafactor and "
              f"scale_by_factored_rms keep for large leaves, or a choice by "
              f"size); {FIX}")
  a, b = _ops(_program(inner, whole, s_whole)), _ops(_program(inner, shards, s_shard))
  if a != b:
    k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    at = lambda ops: f"`{ops[k]}`" if k < len(ops) else "nothing"
    return (f"its update runs other operations on the whole parameters than "
            f"on a shard ({at(a)} against {at(b)} at operation {k + 1}): a "
            f"mask, label or branch decided by size or shape; {FIX}")
  return None
