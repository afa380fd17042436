"""Where each leaf of a :class:`Zero1State` lives.

``state_specs`` asks :func:`zero1_jax.core.state_dims.state_shard_dims`
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
from zero1_jax.core import param_axes as pax
from zero1_jax.core import precision
from zero1_jax.core.state import Zero1State, master_tree


def _spec(dim: int, ndim: int, axis: str) -> P:
  parts = [None] * ndim
  parts[dim] = axis
  return P(*parts)


def state_specs(tx: Any, params: Any, num_shards: int,
                param_axes: pax.ParamAxes | None = None) -> Zero1State:
  """PartitionSpecs of ``tx``'s state (``tx`` from :func:`zero1_jax.zero1`)
  for ``params`` over ``num_shards``. With ``param_axes`` (params sharded
  over other mesh axes too) each state leaf takes its parameter's spec with
  the data axis added on its shard dim."""
  axis = tx.config.axis_name
  mdt = tx.config.master_dtype
  if param_axes is None:
    layout = lay.plan(params, num_shards)
    spec = lambda i: leaf_spec(layout.leaves[i], axis)
  else:
    layout = lay.plan(param_axes.local_tree(params), num_shards,
                      param_axes.taken)
    spec = lambda i: param_axes.state_spec(i, layout.leaves[i])

  try:
    treedef, _, _, owners = ew.state_shard_dims(tx.inner, layout, mdt)
  except ew.Refused as e:   # say which transformation
    raise ew.located(e, tx.inner, layout, mdt) from None
  inner = treedef.unflatten([P() if i is None else spec(i) for i in owners])
  master = master_tree(layout, mdt, [spec(i) for i in range(len(layout.leaves))])
  ls = precision.LossScaleState(P(), P(), P(), P())
  return Zero1State(master, inner, ls)


def leaf_spec(s: lay.LeafSpec, axis: str) -> P:
  """A sharded leaf's state spec (the data axis on its shard dim); P() else."""
  return _spec(s.dim, len(s.shape), axis) if s.kind == lay.SHARD else P()
