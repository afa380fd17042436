"""Where each leaf of a :class:`Zero1State` lives, and whether the inner
optimizer may be sharded at all.

Both questions are answered by probing the inner optimizer, not by a list of
known names:

* ``state_specs`` evaluates ``inner.init`` abstractly on the shard shapes and
  again with leaf ``i``'s shard dim grown by ``i + 1``. A state leaf whose
  shape does not move is replicated (counts, hyperparameters, scalar-param
  moments). One that moves must equal leaf ``i``'s shard shape in both
  probes, and is sharded like it. Anything else (adafactor's factored row and
  column statistics) means the optimizer is not elementwise: refused.
* ``check_elementwise`` runs one real update on a tiny tree of the same
  structure and ranks, whole and split in two along axis 0, with large
  gradients. An elementwise optimizer gives the same numbers; one that looks
  at whole leaves or the whole tree (``clip_by_global_norm``, LAMB's trust
  ratio, update normalisation) does not.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from zero1_jax.core import layout as lay
from zero1_jax.core import precision
from zero1_jax.core.transform import Zero1State, Zero1Transformation, master_tree

_REFUSAL = (
    "zero1: the inner optimizer is not elementwise ({why}); ZeRO-1 runs it on "
    "1/N slices of each parameter, which would silently change its result. "
    "Use an elementwise optimizer (adam, adamw, lion, sgd, rmsprop, adagrad); "
    "for gradient clipping pass zero1(..., max_grad_norm=...) instead of "
    "optax.clip_by_global_norm.")


def _spec(dim: int, ndim: int, axis: str) -> P:
  parts = [None] * ndim
  parts[dim] = axis
  return P(*parts)


def state_specs(tx: Zero1Transformation, params: Any, num_shards: int) -> Zero1State:
  """PartitionSpecs of ``tx``'s state for ``params`` over ``num_shards``."""
  axis = tx.config.axis_name
  layout = lay.plan(params, num_shards)
  mdt = tx.config.master_dtype

  def shards(grow: bool):
    out = []
    for i, s in enumerate(layout.leaves):
      shape = list(s.shard_shape)
      if grow and s.kind == lay.SHARD:
        shape[s.dim] += i + 1
      out.append(jax.ShapeDtypeStruct(tuple(shape), mdt))
    return layout.inner_tree(out)

  a = jax.eval_shape(tx.inner.init, shards(False))
  b = jax.eval_shape(tx.inner.init, shards(True))
  a_leaves, a_def = jax.tree.flatten_with_path(a)
  b_leaves, b_def = jax.tree.flatten(b)
  if a_def != b_def:
    raise ValueError(_REFUSAL.format(why="its state structure depends on the "
                                     "parameter shapes"))
  by_grow = {i + 1: (i, s) for i, s in enumerate(layout.leaves)
             if s.kind == lay.SHARD}
  inner_specs = []
  for (path, x), y in zip(a_leaves, b_leaves):
    if x.shape == y.shape:
      inner_specs.append(P())
      continue
    delta = [j for j, (u, v) in enumerate(zip(x.shape, y.shape)) if u != v]
    hit = (by_grow.get(y.shape[delta[0]] - x.shape[delta[0]])
           if len(x.shape) == len(y.shape) and len(delta) == 1 else None)
    if hit is None or x.shape != hit[1].shard_shape:
      raise ValueError(_REFUSAL.format(
          why=f"state leaf {jax.tree_util.keystr(path)} of shape {x.shape} "
              f"is not shaped like any parameter shard"))
    inner_specs.append(_spec(hit[1].dim, len(x.shape), axis))
  inner = a_def.unflatten(inner_specs)
  master = master_tree(layout, mdt, [
      _spec(s.dim, len(s.shape), axis) if s.kind == lay.SHARD else P()
      for s in layout.leaves])
  ls = precision.LossScaleState(P(), P(), P(), P())
  return Zero1State(master, inner, ls)


def check_elementwise(tx: Zero1Transformation, params: Any) -> None:
  """Raises ValueError if ``tx.inner`` depends on how leaves are split."""
  layout = lay.plan(params, 1)
  rng = np.random.default_rng(0)
  full_p, full_g = [], []
  for s in layout.leaves:
    shape = (2,) * len(s.shape)
    full_p.append(rng.normal(size=shape).astype(np.float32))
    full_g.append((rng.normal(size=shape) * 1e3).astype(np.float32))

  def run(ps, gs):
    p = layout.inner_tree([jnp.asarray(x) for x in ps])
    g = layout.inner_tree([jnp.asarray(x) for x in gs])
    state = tx.inner.init(p)
    u, state = tx.inner.update(g, state, p)
    u2, state = tx.inner.update(g, state, optax.apply_updates(p, u))
    return [np.asarray(x) for x in jax.tree.leaves((u, u2, state))]

  def half(xs, k):
    return [x if x.ndim == 0 else x[k:k + 1] for x in xs]

  whole = run(full_p, full_g)
  lo, hi = run(half(full_p, 0), half(full_g, 0)), run(half(full_p, 1), half(full_g, 1))
  for w, a, b in zip(whole, lo, hi):
    joined = w if w.ndim == 0 else np.concatenate([a, b])
    if w.ndim == 0:
      continue
    if not np.allclose(w, joined, rtol=1e-4, atol=1e-6, equal_nan=True):
      raise ValueError(_REFUSAL.format(
          why="its update on half a parameter differs from the same half of "
              "its update on the whole parameter"))
