"""Stage 1 of an update: the gradients as handed -> this device's summed shards.

What ``tx.apply`` is handed decides the reduce (``grads_are``):

* :data:`LOCAL`: this device's own gradients inside shard_map (``z1.train_step``,
  a user's shard_map): reduce-scattered over the data axis, bucketed
  (:func:`.collectives.reduce_scatter`); the update divides the sums by N.
* :data:`PARTIAL`: plain jit's gradients typed unreduced over the axis
  (params from ``z1.reduced_params``): the same collectives sum them; they
  sum to the mean already, so no division by N.
* :data:`REDUCED`: plain jit's reduced gradients, whole on every device or
  already this device's block (:func:`local_shards`), no collective here.
* :data:`SHARDS`: ``z1.value_and_grad``'s gradients, reduce-scattered leaf
  by leaf in the backward, as stage 2's are (``pre_reduced``).

The sums stay sums (in the master dtype): averaging, unscaling and clipping
are one divisor applied in stage 2 (:mod:`.grad_norm`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from zero1_jax.core import collectives as col
from zero1_jax.core import layout as lay
from zero1_jax.core.tx_config import Zero1Config

LOCAL = "local"        # this device's own gradient inside shard_map: sum, then / N
PARTIAL = "partial"    # jit's unreduced pieces: they sum to the gradient
REDUCED = "reduced"    # jit's reduced gradient: already whole on every device
SHARDS = "shards"      # z1.value_and_grad's ShardedGrads: summed shards, then / N


def local_shards(grads: Sequence, layout: lay.Layout, axis_name: str
                 ) -> dict[int, Any]:
  """Mode :data:`REDUCED`: this device's shard of each whole gradient, or
  the block handed (no collective); scalar leaves as they are. Indexed
  like ``layout.leaves``."""
  out = {}
  for i, (g, s) in enumerate(zip(grads, layout.leaves)):
    if s.kind == lay.SHARD:
      out[i] = col.local_shard(g, s, axis_name)
    elif s.kind == lay.REPLICATE:
      out[i] = g
  return out


def reduce(grads: Sequence, layout: lay.Layout,
           buckets: Sequence[lay.Bucket], cfg: Zero1Config, grads_are: str,
           pre_reduced: bool, in_order: bool = False
           ) -> tuple[dict[int, jax.Array], list]:
  """``({leaf: this device's summed shard, in its master dtype}, packed)``:
  ``packed`` lists each packed bucket's summed piece and the leaves it
  covers (:class:`.collectives.Reduced`), for the norm to read in one pass.
  ``pre_reduced``: ``grads`` are summed shards already (stage 2, or
  :data:`SHARDS`); ``in_order``: the buckets' groups reduced one after
  another in the planned order (:func:`.collectives.reduce_scatter`)."""
  axis, n = cfg.axis_name, layout.num_shards
  packed = []
  all_reduce = cfg.reduce == "all_reduce"
  if pre_reduced:   # stage 2: summed shards (zero2.py), still / N
    reduced = {i: grads[i] for i in layout.indices(lay.SHARD)
               + layout.indices(lay.REPLICATE)}
    # fp16 travelled divided by N (collectives.predivides): back to sums.
    reduced = {i: col.restore_sum(v, n) if col.predivides(v.dtype, all_reduce)
               else v for i, v in reduced.items()}
  elif grads_are == REDUCED:   # jit already summed them: no collective
    reduced = local_shards(grads, layout, axis)
  else:
    # fp16 device gradients travel divided by N (collectives.predivides);
    # jit's unreduced pieces (PARTIAL) sum to the mean already.
    pre = grads_are == LOCAL
    reduced, packed = col.reduce_scatter(grads, layout, buckets, axis,
                                         all_reduce=all_reduce,
                                         predivide_fp16=pre,
                                         in_order=in_order)
    reduced.update(col.psum_replicated(grads, layout, axis,
                                       all_reduce=all_reduce,
                                       predivide_fp16=pre))
  return ({i: v.astype(lay.master_dtype(layout.leaves[i].dtype,
                                        cfg.master_dtype))
           for i, v in reduced.items()}, packed)


def add_reduced(sums: dict[int, jax.Array], packed: list,
                extra: dict[int, jax.Array]) -> tuple[dict, list]:
  """``sums`` with ``extra`` ({leaf: a part of its gradient summed over every
  device already, this device's shard}) added; packed buckets that hold
  such a leaf no longer stand for its sum (the norm then reads their leaves
  one by one)."""
  out = dict(sums)
  for i, v in extra.items():
    out[i] = out[i] + v.reshape(out[i].shape).astype(out[i].dtype)
  return out, [p for p in packed if not set(p[1]) & set(extra)]
