"""Stage 4 of an update: the new weights (or optax's updates) on every device.

Each leaf's new master shard is cast to the parameter dtype and all-gathered
(:func:`.collectives.all_gather`, in the gather buckets of :mod:`.plan`);
leaves in ``shard_out`` stay this device's shard (``z1.train_step`` keeps
them sharded and gathers them at the next step's start). For ``tx.update``
(``as_updates``) the result is what optax returns (:mod:`.updates`): the
inner optimizer's ``u`` where the param is its own master, else
``new - params`` in the param dtype.

Where the user's jit adds those updates to the params after the backward
(``optax.apply_updates``), each group of gathers waits for the reduced
gradients of the group gathered before it (:func:`waits`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from zero1_jax.core import collectives as col
from zero1_jax.core import layout as lay
from zero1_jax.core import updates as upd


def waits(buckets: Sequence[lay.Bucket], reduced: dict[int, jax.Array]
          ) -> dict[int, list[jax.Array]]:
  """{bucket index: the arrays its gather waits for}: each group of gather
  buckets waits for ``reduced`` (the summed gradient shards) of the leaves
  of the group gathered before it.

  Plain jit gathers in the order the forward reads the leaves; the backward
  reduces that group's gradients only once it has gone below the layers of
  this one, past the gemms that read their params. Without the wait,
  XLA's GPU compiler may fuse the user's ``params + updates`` with a bf16
  copy of the same params the backward reads (mixed precision: both read
  ``params``), and the backward then waits for this group's gradients to
  be reduced, updated and gathered: flax's lm1b on 8 H100s stalled 0.4 ms
  a step so (XLA's cost model, ``experiments/gpu/lm1b_step.py``).
  ``z1.value_and_grad``'s gathers, in the order its hooks reduced, do not
  wait so: the same rule there (each group after the next one's gradients)
  took lm1b's one such fusion, at the backward's last layer, off its path
  and cost 14 µs, and BERT-base fp32 52 (10,406 µs a step against 10,354).

  Example:
    >>> import numpy as np
    >>> b = (lay.Bucket(np.dtype("f4"), (lay.Segment(0, 0, 1),), 0),
    ...      lay.Bucket(np.dtype("f4"), (lay.Segment(1, 0, 1),), 1))
    >>> {k: len(v) for k, v in waits(b, {0: np.ones(1), 1: np.ones(1)}).items()}
    {1: 1}
  """
  out: dict[int, list[jax.Array]] = {}
  prev: list[jax.Array] = []
  here: list[jax.Array] = []
  group = None
  for k, b in enumerate(buckets):
    if b.group != group:
      group, prev, here = b.group, here, []
    if prev:
      out[k] = prev
    here += [reduced[i] for i in dict.fromkeys(s.leaf for s in b.segments)
             if i in reduced]
  return out


def gather(pairs: Sequence[tuple], params: Sequence, layout: lay.Layout,
           buckets: Sequence[lay.Bucket], axis_name: str, master_dtype: Any,
           as_updates: bool = False,
           after_reduced: dict[int, jax.Array] | None = None) -> list:
  """Per leaf, the new param (or update, ``as_updates``) in its dtype, from
  ``pairs`` (``(new master shard, u)`` per leaf, stage 3's); static leaves
  as they came. One param-dtype array per leaf either way.
  ``after_reduced``: the summed gradient shards the gathers wait for, group
  after group (:func:`waits`)."""
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
                        layout, buckets, axis_name,
                        after=after_reduced and waits(buckets, after_reduced))
  out = [full.get(i, v) for i, v in enumerate(out)]
  if as_updates:
    out = [v if i in own_u else upd.difference(v, p)
           for i, (v, p) in enumerate(zip(out, params))]
  return out
