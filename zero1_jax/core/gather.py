"""Stage 4 of an update: the new weights (or optax's updates) on every device.

Each leaf's new master shard is cast to the parameter dtype and all-gathered
(:func:`.collectives.all_gather`, in the gather buckets of :mod:`.plan`);
leaves in ``shard_out`` stay this device's shard (``z1.train_step`` keeps
them sharded and gathers them at the next step's start). For ``tx.update``
(``as_updates``) the result is what optax returns (:mod:`.updates`): the
inner optimizer's ``u`` where the param is its own master, else
``new - params`` in the param dtype.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp

from zero1_jax.core import collectives as col
from zero1_jax.core import layout as lay
from zero1_jax.core import updates as upd


def gather(pairs: Sequence[tuple], params: Sequence, layout: lay.Layout,
           buckets: Sequence[lay.Bucket], axis_name: str, master_dtype: Any,
           as_updates: bool = False) -> list:
  """Per leaf, the new param (or update, ``as_updates``) in its dtype, from
  ``pairs`` (``(new master shard, u)`` per leaf, stage 3's); static leaves
  as they came. One param-dtype array per leaf either way."""
  masters = [m for m, _ in pairs]
  own_u = {i for i, ((_, u), p, spec) in enumerate(zip(pairs, params,
                                                      layout.leaves))
           if as_updates and u is not None
           and upd.gathers_u(spec, p.dtype, jnp.result_type(u), master_dtype)}
  out = [(pairs[i][1] if i in own_u else m).astype(p.dtype)
         if spec.kind != lay.STATIC else p
         for i, (m, p, spec) in enumerate(zip(masters, params,
                                              layout.leaves))]
  full = col.all_gather({i: out[i] for i in layout.indices(lay.SHARD)},
                        layout, buckets, axis_name)
  out = [full.get(i, v) for i, v in enumerate(out)]
  if as_updates:
    out = [v if i in own_u else upd.difference(v, p)
           for i, (v, p) in enumerate(zip(out, params))]
  return out
