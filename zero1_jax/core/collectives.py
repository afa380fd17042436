"""Bucketed collectives over a :mod:`zero1_jax.core.layout` plan.

Every function here runs inside ``shard_map`` over ``axis_name`` and works on
lists of leaves indexed like ``Layout.leaves``.

The rank-major view of a leaf: pad it on its shard dim to ``N * rows``, move
that split to the front and flatten, giving an ``(N, shard_size)`` matrix
whose row ``r`` is exactly device ``r``'s shard. A bucket concatenates column
ranges of these matrices, so a tiled ``psum_scatter`` of the flattened bucket
hands each device its own columns, and a tiled ``all_gather`` of the
per-device pieces rebuilds the matrix. Padding and transposes fuse into the
bucket copy; no padded copy of a whole gradient is made.

The CPU backend does not combine collectives by itself, which is why buckets
are built here rather than left to XLA.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from zero1_jax.core import order as ordering
from zero1_jax.core.layout import Bucket, Layout, LeafSpec, REPLICATE

REDUCE_KEY = "zero1-reduce-{}"   # XLA combiner_key of a reduce bucket group
GATHER_KEY = "zero1-gather-{}"


def axis_bound(axis_name: str) -> bool:
  """Whether ``axis_name`` is bound here: inside a shard_map over it, where
  zero1's update runs per device; elsewhere (plain ``jax.jit`` or eager
  code) :mod:`.jit_mode` builds that shard_map."""
  try:
    jax.lax.axis_size(axis_name)
    return True
  except NameError:
    return False


def axis_size(axis_name: str) -> int:
  """N, the size of the bound data axis; ValueError naming the fix when it
  is not bound."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"zero1: axis '{axis_name}' is not bound. tx.init / tx.update must "
        f"run inside shard_map over a mesh with axis '{axis_name}' (use "
        f"z1.init(tx, params, mesh) and z1.train_step, or pass "
        f"axis_name=<your data axis> to zero1).") from e


def rank_major(x: jax.Array, spec: LeafSpec, n: int) -> jax.Array:
  """Full leaf -> ``(n, shard_size)``; row ``r`` is device ``r``'s shard."""
  d = spec.dim
  extra = spec.padded_shape[d] - spec.shape[d]
  if extra:
    pads = [(0, 0)] * x.ndim
    pads[d] = (0, extra)
    x = jnp.pad(x, pads)
  rows = spec.shard_shape[d]
  x = x.reshape(spec.shape[:d] + (n, rows) + spec.shape[d + 1:])
  return jnp.moveaxis(x, d, 0).reshape(n, -1)


def from_rank_major(m: jax.Array, spec: LeafSpec, n: int) -> jax.Array:
  """Inverse of :func:`rank_major`: ``(n, shard_size)`` -> the full leaf."""
  d = spec.dim
  m = m.reshape((n,) + spec.shard_shape)
  m = jnp.moveaxis(m, 0, d).reshape(spec.padded_shape)
  return jax.lax.slice_in_dim(m, 0, spec.shape[d], axis=d)


def local_shard(x: jax.Array, spec: LeafSpec, axis_name: str) -> jax.Array:
  """This device's shard of a full (replicated) leaf, zero-padded; a leaf
  that already is this device's block (jit_mode's ``_as_blocks``) as it is.

  Reads only the shard's rows: padding the whole leaf first would make XLA
  materialise a padded copy of it (the step slices fp32 params this way)."""
  d = spec.dim
  rows = spec.shard_shape[d]
  if x.shape[d] == rows != spec.shape[d]:   # this device's block already
    return x
  start = jax.lax.axis_index(axis_name) * rows
  if spec.padded_shape[d] == spec.shape[d]:
    return jax.lax.dynamic_slice_in_dim(x, start, rows, axis=d)
  # Rows past the end of the leaf (the last devices' padding) read as zero.
  idx = start + jnp.arange(rows)
  return jnp.take(x, idx, axis=d, mode="fill", fill_value=0)


def _split_shards(pieces: dict[int, list[jax.Array]], layout: Layout
                  ) -> dict[int, jax.Array]:
  out = {}
  for i, parts in pieces.items():
    flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    out[i] = flat.reshape(layout.leaves[i].shard_shape)
  return out


def predivides(dtype, all_reduce: bool = False) -> bool:
  """Whether a gradient travelling in ``dtype`` is divided by N *before* it
  is summed: float16 on the reduce-scatter path, as DeepSpeed's ZeRO-1/2
  divides each bucket first (``runtime/zero/stage_1_and_2.py:1687-1688``,
  0.19.8), so a sum overflows fp16 only where the mean would (summing first,
  the threshold would fall with N). Its ``reduce_scatter: false`` path sums
  first (``:1498-1506``), and so does ``all_reduce=True`` here. Other dtypes
  sum first: bf16 and fp32 have fp32's range, and for N a power of two the
  two orders give the same bits."""
  return not all_reduce and jnp.dtype(dtype) == jnp.float16


def predivide(x: jax.Array, n: int) -> jax.Array:
  return x / jnp.asarray(n, x.dtype)


def restore_sum(x: jax.Array, n: int) -> jax.Array:
  """A predivided sum (a mean, in fp16) back to the sum, in float32, where it
  cannot overflow: the update divides every leaf by N x loss scale alike."""
  return x.astype(jnp.float32) * jnp.float32(n)


class Reduced(NamedTuple):
  """What :func:`reduce_scatter` hands back."""

  shards: dict[int, jax.Array]   # leaf index -> this device's summed shard
  # Each packed bucket's summed piece as it arrived (this device's columns,
  # zero where the layout pads) and the leaves it covers: a whole-bucket
  # reduction reads it in place, where one per leaf would make XLA:CPU copy
  # each leaf's slice out first.
  packed: list[tuple[jax.Array, tuple[int, ...]]]


def reduce_scatter(grads: Sequence[jax.Array | None], layout: Layout,
                   buckets: Sequence[Bucket], axis_name: str, *,
                   all_reduce: bool = False, predivide_fp16: bool = True,
                   in_order: bool = False) -> Reduced:
  """Sums full local gradients over the axis; returns this device's shards.

  ``all_reduce=True`` takes the all-reduce path instead (``psum`` of the
  bucket, then this device's slice): the same result, 1.5x the traffic of
  reduce-scatter; kept for parity with DeepSpeed's ``reduce_scatter: false``.
  Each bucket is one collective. The shards are ``{leaf index: shard}`` for
  SHARD leaves, in each bucket's dtype; a float16 bucket on the reduce-scatter
  path travels divided by N (:func:`predivides`; ``predivide_fp16=False``:
  not, for pieces that sum to a mean already) and arrives as the sum in
  float32.

  ``in_order``: each group of buckets starts only once the one before it has
  arrived (a data dependency through ``optimization_barrier``). XLA's GPU
  scheduler runs one collective at a time and otherwise picks their order
  itself: it left BERT-base's tied embedding, ready at the start of the
  backward, for the very end (306 µs, half of it exposed).
  """
  n = layout.num_shards
  views: dict[int, jax.Array] = {}
  outs: list = []   # per bucket: its summed piece, or (leaf, whole shard)
  group, lo, prev = None, 0, slice(0, 0)   # prev: the last group's outs
  me = jax.lax.axis_index(axis_name) if all_reduce else None
  for b in buckets:
    if in_order and b.group != group:
      group, prev, lo = b.group, slice(lo, len(outs)), len(outs)
    before = in_order and prev.stop > prev.start
    pre = predivide_fp16 and predivides(b.dtype, all_reduce)
    i = b.whole_leaf(layout)
    if i is not None:
      g = grads[i].astype(b.dtype)
      if before:
        g, outs[prev] = _after(g, outs[prev])
      with ordering.tagged(REDUCE_KEY.format(b.group)):
        shard = reduce_leaf(predivide(g, n) if pre else g,
                             layout.leaves[i], axis_name, all_reduce)
      outs.append((i, restore_sum(shard, n) if pre else shard))
      continue
    cols = []
    for s in b.segments:
      if s.leaf not in views:
        views[s.leaf] = rank_major(grads[s.leaf].astype(b.dtype),
                                   layout.leaves[s.leaf], n)
      cols.append(views[s.leaf][:, s.start:s.start + s.length])
    buf = cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=1)
    if before:
      buf, outs[prev] = _after(buf, outs[prev])
    if all_reduce:
      with ordering.tagged(REDUCE_KEY.format(b.group)):
        total = jax.lax.psum(buf, axis_name)
      mine = jax.lax.dynamic_index_in_dim(total, me, axis=0, keepdims=False)
    else:
      if pre:
        buf = predivide(buf, n)
      with ordering.tagged(REDUCE_KEY.format(b.group)):
        mine = jax.lax.psum_scatter(buf.reshape(-1), axis_name,
                                    scatter_dimension=0, tiled=True)
      if pre:
        mine = restore_sum(mine, n)
    outs.append(mine)
  return _collect(outs, buckets, layout)


def _after(x: jax.Array, outs: list) -> tuple[jax.Array, list]:
  """``x`` made to wait for every collective in ``outs`` (their values
  returned through the barrier too, so that neither side is pruned)."""
  vals = [o if isinstance(o, jax.Array) else o[1] for o in outs]
  x, vals = jax.lax.optimization_barrier((x, vals))
  return x, [v if isinstance(o, jax.Array) else (o[0], v)
             for o, v in zip(outs, vals)]


def _collect(outs: list, buckets: Sequence[Bucket], layout: Layout
             ) -> Reduced:
  """:class:`Reduced` from each bucket's output, in bucket order."""
  pieces: dict[int, list[jax.Array]] = {}
  whole: dict[int, jax.Array] = {}
  packed: list[tuple[jax.Array, tuple[int, ...]]] = []
  for b, o in zip(buckets, outs):
    if not isinstance(o, jax.Array):
      whole[o[0]] = o[1]
      continue
    packed.append((o, tuple(sorted({s.leaf for s in b.segments}))))
    at = 0
    for s in b.segments:
      pieces.setdefault(s.leaf, []).append(o[at:at + s.length])
      at += s.length
  return Reduced({**_split_shards(pieces, layout), **whole}, packed)


def _pad_to_shards(x: jax.Array, spec: LeafSpec) -> jax.Array:
  extra = spec.padded_shape[spec.dim] - spec.shape[spec.dim]
  if not extra:
    return x
  pads = [(0, 0)] * x.ndim
  pads[spec.dim] = (0, extra)
  return jnp.pad(x, pads)


def reduce_leaf(g: jax.Array, spec: LeafSpec, axis_name: str,
                all_reduce: bool) -> jax.Array:
  """One leaf's collective on the leaf itself: reduce-scatter along its shard
  dim (a copy only if the dim needs padding), or psum and this device's rows."""
  if all_reduce:
    return local_shard(jax.lax.psum(g, axis_name), spec, axis_name)
  return jax.lax.psum_scatter(_pad_to_shards(g, spec), axis_name,
                              scatter_dimension=spec.dim, tiled=True)


def _gather_leaf(shard: jax.Array, spec: LeafSpec, axis_name: str) -> jax.Array:
  full = jax.lax.all_gather(shard, axis_name, axis=spec.dim, tiled=True,
                            to="invarying")
  return jax.lax.slice_in_dim(full, 0, spec.shape[spec.dim], axis=spec.dim)


def all_gather(shards: dict[int, jax.Array], layout: Layout,
               buckets: Sequence[Bucket], axis_name: str,
               copy_out: bool = False,
               after: dict[int, Sequence[jax.Array]] | None = None,
               chained: bool = False) -> dict[int, jax.Array]:
  """Rebuilds full leaves from every device's shard; one collective a bucket.

  ``shards[i]`` must already be in the dtype its bucket travels in. The result
  is invariant over the axis (``to='invarying'``) so it can leave shard_map
  with ``P()``. ``copy_out``: each leaf of a packed bucket is written out
  whole (through an ``optimization_barrier``) before anything reads it, so
  the bucket dies at once; otherwise XLA fuses the slices into the layers
  that read them and keeps buckets live into the backward (BERT-base fp32's
  step-start gathers on 16 H100s: two 64 MiB buckets live at the peak).
  ``after``: {bucket index: arrays} the bucket's gather waits for (through
  an ``optimization_barrier``; :func:`zero1_jax.core.gather.waits`).
  ``chained``: each bucket's gather waits for the one before it, so they
  run in the order of ``buckets`` (XLA otherwise issues them in any order).
  """
  n = layout.num_shards
  cols: dict[int, list[jax.Array]] = {}
  out = {}
  prev: list[jax.Array] = []
  for k, b in enumerate(buckets):
    waits = list((after or {}).get(k) or ()) + (prev if chained else [])
    i = b.whole_leaf(layout)
    if i is not None:
      x = _waiting(shards[i], waits)
      with ordering.tagged(GATHER_KEY.format(b.group)):
        out[i] = _gather_leaf(x, layout.leaves[i], axis_name)
      prev = [out[i]]
      continue
    parts = [shards[s.leaf].reshape(-1)[s.start:s.start + s.length]
             for s in b.segments]
    buf = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    buf = _waiting(buf, waits)
    with ordering.tagged(GATHER_KEY.format(b.group)):
      full = jax.lax.all_gather(buf, axis_name, tiled=True, to="invarying")
    prev = [full]
    full = full.reshape(n, -1)
    at = 0
    for s in b.segments:
      cols.setdefault(s.leaf, []).append(full[:, at:at + s.length])
      at += s.length
  for i, c in cols.items():
    m = c[0] if len(c) == 1 else jnp.concatenate(c, axis=1)
    out[i] = from_rank_major(m, layout.leaves[i], n)
    if copy_out:
      out[i] = jax.lax.optimization_barrier(out[i])
  return out


def _waiting(x: jax.Array, on: Sequence[jax.Array] | None) -> jax.Array:
  """``x``, available only once every array in ``on`` is."""
  return jax.lax.optimization_barrier((x, list(on)))[0] if on else x


def psum_replicated(grads: Sequence[jax.Array | None], layout: Layout,
                    axis_name: str, *, all_reduce: bool = False,
                    predivide_fp16: bool = True) -> dict[int, jax.Array]:
  """All-reduces the REPLICATE leaves (scalars; on a 2-D mesh also blocks
  not split over the axis), one psum per dtype; float16 ones divided by N
  first as in :func:`reduce_scatter`, arriving as float32 sums."""
  n = layout.num_shards
  groups: dict[jnp.dtype, list[int]] = {}
  for i, spec in enumerate(layout.leaves):
    if spec.kind == REPLICATE:
      groups.setdefault(jnp.dtype(grads[i].dtype), []).append(i)
  out = {}
  for _, idx in groups.items():
    flat = jnp.concatenate([jnp.reshape(grads[i], -1) for i in idx])
    pre = predivide_fp16 and predivides(flat.dtype, all_reduce)
    total = jax.lax.psum(predivide(flat, n) if pre else flat, axis_name)
    total = restore_sum(total, n) if pre else total
    at = 0
    for i in idx:
      size = layout.leaves[i].shard_size
      out[i] = total[at:at + size].reshape(layout.leaves[i].shape)
      at += size
  return out
