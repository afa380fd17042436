"""Where :func:`zero1_jax.train_step` keeps the params between steps.

``shard_params=True`` (GPU and TPU by default): each device keeps only its
updated 1/N shard of every leaf the data axis splits evenly
(:func:`stored_leaves`), and the next step gathers them at its start, in
the order the forward reads them, where the gathers run under the forward
pass (:meth:`Storage.gather`). Otherwise the params come back replicated
(every leaf as ``P(None, ...)``). :meth:`Storage.where` gives the
``NamedSharding``s of either, which the step's wrapper
(:mod:`.on_mesh`) places the first step's params on, so that one compiled
program serves the first step and the next.

Example:
  >>> import jax.numpy as jnp
  >>> from zero1_jax.core import layout as lay
  >>> sorted(stored_leaves(lay.plan({"w": jnp.zeros((4, 3)),
  ...                                "b": jnp.zeros(3)}, 2)))   # b pads to 4
  [1]
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from zero1_jax.core import collectives as col
from zero1_jax.core import layout as lay
from zero1_jax.core import param_axes as pax
from zero1_jax.core import specs as zspecs
from zero1_jax.core.tx_config import Zero1Transformation


def stored_leaves(layout: lay.Layout) -> frozenset[int]:
  """The leaves :func:`zero1_jax.train_step` keeps sharded between steps:
  those split over the data axis without padding (a ``jax.Array`` must
  divide evenly). The others (scalars, integers, leaves padded to split)
  stay replicated."""
  return frozenset(i for i, s in enumerate(layout.leaves)
                   if s.kind == lay.SHARD and s.padded_shape == s.shape)


def stored_specs(tx: Zero1Transformation, params: Any, n: int) -> Any:
  """PartitionSpecs :func:`zero1_jax.train_step` keeps ``params`` in
  between steps (1-D meshes): each leaf of :func:`stored_leaves` over the
  data axis on its shard dim, as its optimizer state; the others
  replicated."""
  layout = lay.plan(params, n)
  keep = stored_leaves(layout)
  return layout.treedef.unflatten([
      zspecs.leaf_spec(s, tx.config.axis_name) if i in keep
      else P(*[None] * len(s.shape)) for i, s in enumerate(layout.leaves)])


def placed(x: Any, where: NamedSharding) -> bool:
  """Whether ``x`` is placed as ``where`` says: the same devices and the same
  spec (trailing Nones aside). Equivalence is not enough: on an Explicit
  mesh the spec is part of the array's type, and P() and P('data') are
  equivalent on one device."""
  s = getattr(x, "sharding", None)
  if not isinstance(s, NamedSharding) or s.mesh != where.mesh:
    return False
  strip = lambda spec: tuple(spec)[:max([i + 1 for i, a in enumerate(spec)
                                         if a is not None], default=0)]
  return strip(s.spec) == strip(where.spec)


class Storage(NamedTuple):
  """The params' storage of one :func:`zero1_jax.train_step`."""

  tx: Zero1Transformation
  mesh: jax.sharding.Mesh
  n: int              # devices on the data axis
  sharded: bool       # shard_params, resolved

  def where(self, params: Any, pa: pax.ParamAxes | None) -> Any:
    """Where the step keeps ``params`` (NamedShardings), or None: as given
    (params sharded over other mesh axes, or boxed)."""
    if pa is not None or jax.tree.structure(
        pax.unbox(params)) != jax.tree.structure(params):   # boxed: as given
      return None
    # Replicated ones as the step returns them, P(None, ...): the same
    # program then serves the first step and the next (with P() a second
    # compile followed on an Explicit mesh).
    specs = (stored_specs(self.tx, params, self.n) if self.sharded
             else jax.tree.map(lambda x: P(*[None] * jnp.ndim(x)), params))
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))

  def holds(self, params: Any) -> bool:
    """Whether ``params`` are a previous step's output, stored sharded."""
    if not self.sharded:
      return False
    where = self.where(params, None)
    return where is not None and any(
        s.spec != P() for s in jax.tree.leaves(where)) and all(
        placed(x, s) for x, s in zip(jax.tree.leaves(params),
                                     jax.tree.leaves(where)))

  def gather(self, params: Any, full: Any, order: Sequence[int] | None,
             keep: frozenset[int], platform: str | None,
             across_hosts: bool = False, narrow: dict | None = None
             ) -> tuple[Any, dict[int, jax.Array]]:
    """Inside the step's shard_map: ``(whole params, {leaf: this device's
    stored shard})``, the ``keep`` leaves of ``params`` (this device's
    shards; ``full``: the whole leaves' shapes) all-gathered in the order
    the forward reads them. ``across_hosts`` (the data axis over several
    hosts): ``inplace_bytes="auto"`` packs them, in buckets of at most
    :data:`~zero1_jax.core.layout.GROUP_BYTES`
    (:meth:`~zero1_jax.core.tx_config.Zero1Config.inplace_threshold`),
    each bucket's gather waiting for the one before it.
    ``narrow``: {leaf: dtype} of leaves the loss reads only cast to that
    narrower dtype (:mod:`.narrow`): gathered cast, and widened back, so
    the loss reads the values it would have cast them to."""
    cfg = self.tx.config
    layout = lay.plan(full, self.n)
    leaves = jax.tree.leaves(params)
    blocks = {i: leaves[i] for i in keep}
    narrow = {i: d for i, d in (narrow or {}).items() if i in keep}
    sent = {i: x.astype(narrow[i]) if i in narrow else x
            for i, x in blocks.items()}
    small = cfg.inplace_threshold(self.n, platform,
                                  "gathers" if across_hosts else None)
    bucket = int(cfg.gather_bucket_bytes or cfg.bucket_bytes)
    if small is None and cfg.inplace_threshold(self.n, platform) is not None:
      # Packed for the hosts only: no larger than the groups in place.
      # (DeepSpeed's 5e8-element allgather_bucket_size made one gather of
      # every leaf: the engine's GPT-2 fp32 on 16 H100s 20,028 µs, 18,492
      # with this cap.)
      bucket = min(bucket, lay.GROUP_BYTES)
    buckets = lay.plan_buckets(
        layout, tuple(jnp.dtype(sent[i].dtype if i in sent else x.dtype)
                      for i, x in enumerate(leaves)), bucket, small,
        tuple(i for i in (order or range(len(leaves))) if i in keep),
        None if order is None else "first")
    # Across hosts the packed leaves are copied out, so that no bucket
    # outlives the forward (BERT-base fp32's peak on 16 H100s 1,806 MiB,
    # as in place; 1,932 without the copies), and gathered one after
    # another in the order the forward reads them: left to XLA, the last
    # (part-full) bucket went first and the forward's first layer waited
    # for three gathers (there, XLA's cost model: 12,158 µs a step, in
    # order 11,899; docs/gpu.md "Across hosts").
    whole = col.all_gather(sent, layout, buckets, cfg.axis_name,
                           copy_out=across_hosts, chained=across_hosts)
    whole = {i: w.astype(leaves[i].dtype) for i, w in whole.items()}
    return layout.treedef.unflatten(
        [whole[i] if i in keep else x for i, x in enumerate(leaves)]), blocks
