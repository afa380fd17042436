"""Where each leaf of a :class:`Zero1State` lives.

``state_specs`` asks :func:`zero1_jax.core.elementwise.state_shard_dims`
which inner state leaves are sharded like a parameter shard (the rest are
replicated: counts, hyperparameters, scalar-parameter moments) and turns the
answer into ``PartitionSpec``s. Whether the inner optimizer may be sharded at
all is decided in :mod:`zero1_jax.core.elementwise`.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec as P

from zero1_jax.core import elementwise as ew
from zero1_jax.core import layout as lay
from zero1_jax.core import precision
from zero1_jax.core.state import Zero1State, master_tree


def _spec(dim: int, ndim: int, axis: str) -> P:
  parts = [None] * ndim
  parts[dim] = axis
  return P(*parts)


def state_specs(tx: Any, params: Any, num_shards: int) -> Zero1State:
  """PartitionSpecs of ``tx``'s state (``tx`` from :func:`zero1_jax.zero1`)
  for ``params`` over ``num_shards``."""
  axis = tx.config.axis_name
  layout = lay.plan(params, num_shards)
  mdt = tx.config.master_dtype

  treedef, dims, shapes = ew.state_shard_dims(tx.inner, layout, mdt)
  inner_specs = [P() if d is None else _spec(d, len(x), axis)
                 for d, x in zip(dims, shapes)]
  inner = treedef.unflatten(inner_specs)
  master = master_tree(layout, mdt, [
      _spec(s.dim, len(s.shape), axis) if s.kind == lay.SHARD else P()
      for s in layout.leaves])
  ls = precision.LossScaleState(P(), P(), P(), P())
  return Zero1State(master, inner, ls)
