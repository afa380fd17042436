"""Where every parameter's optimizer state lives: param-shaped shards and bucket plans.

This module is pure Python over shapes and dtypes: no arrays, no collectives.

Design (why param-shaped shards):
  DeepSpeed flattens all parameters into one padded buffer. That gives an exact
  1/N split for any shape, but the inner optimizer then sees flat vectors, so
  masks written against the parameter tree (``x.ndim > 1``, path-based masks)
  stop working. MaxText shards each leaf on its first divisible dimension, which
  keeps masks working but leaves odd-shaped leaves replicated.

  zero1_jax keeps one shard *per leaf, with the leaf's rank*: each floating
  leaf is padded on one dimension (its *shard dim*) to a multiple of N and
  split there, so every device holds exactly ``ceil(d/N)`` rows of it and the
  inner optimizer sees a tree with the same structure and ranks as the
  parameters. The global view of a sharded state leaf is simply the padded
  parameter, sharded over the data axis on the shard dim, which is what makes
  checkpoints restorable at another N (unpad, repad).

  Communication is bucketed separately: every device's shards, flattened and
  concatenated, form one vector of ``S`` elements per dtype; that vector is cut
  into buckets of at most ``bucket_bytes`` (counting the full N*len buffer a
  collective moves), and each bucket is one reduce-scatter / all-gather.

Leaf kinds:
  * ``SHARD``: floating or complex leaf with ndim >= 1 and size > 0. State is
    1/N. (A complex leaf's real and imaginary parts are elementwise data, as
    optax treats them: its master and moments are complex too.)
  * ``REPLICATE``: floating scalar (shape ``()``). Too small to split; its
    gradient is all-reduced and every device updates it identically. On a
    mesh with model axes (:mod:`.param_axes`) also a leaf whose every dim is
    already sharded over them and none of whose local dims N divides.
  * ``STATIC``: integer, bool or zero-size leaves. Passed through
    untouched; the inner optimizer sees ``None`` there.

Each trainable leaf's master dtype is :func:`master_dtype`: never narrower
than the parameter (float64 params keep a float64 master).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

SHARD = "shard"
REPLICATE = "replicate"
STATIC = "static"


class LeafSpec(NamedTuple):
  """How one parameter leaf is split across ``num_shards`` devices."""

  kind: str                    # SHARD | REPLICATE | STATIC
  shape: tuple[int, ...]       # the parameter's shape
  dtype: np.dtype              # the parameter's dtype
  dim: int                     # shard dim (-1 unless kind == SHARD)
  shard_shape: tuple[int, ...]  # one device's piece (== shape unless SHARD)
  padded_shape: tuple[int, ...]  # global shape of the sharded state leaf

  @property
  def shard_size(self) -> int:
    return math.prod(self.shard_shape)

  @property
  def pad(self) -> int:
    """Elements of padding this leaf adds over all devices."""
    return math.prod(self.padded_shape) - math.prod(self.shape)


class Segment(NamedTuple):
  """A run of one leaf's flattened shard that lies in a bucket."""

  leaf: int    # index into Layout.leaves
  start: int   # first element within the leaf's flattened shard
  length: int  # elements


class Bucket(NamedTuple):
  """One collective: ``length`` elements per device, ``N * length`` in all."""

  dtype: np.dtype
  segments: tuple[Segment, ...]
  # Consecutive buckets (in the plan's order) of at most bucket_bytes in all
  # share a group: XLA may combine their collectives, never across groups
  # (core/order.py).
  group: int = 0

  @property
  def length(self) -> int:
    return sum(s.length for s in self.segments)

  def whole_leaf(self, layout: "Layout") -> int | None:
    """The leaf this bucket is, when it holds exactly one whole leaf (its
    collective then runs on the leaf itself, with no bucket copy); else None."""
    if len(self.segments) != 1:
      return None
    s = self.segments[0]
    whole = s.start == 0 and s.length == layout.leaves[s.leaf].shard_size
    return s.leaf if whole else None


class Layout(NamedTuple):
  """The split of a parameter tree over ``num_shards`` devices."""

  treedef: Any
  leaves: tuple[LeafSpec, ...]
  num_shards: int

  def indices(self, kind: str) -> list[int]:
    return [i for i, l in enumerate(self.leaves) if l.kind == kind]

  def inner_tree(self, values: Sequence) -> Any:
    """Param-structured tree of ``values`` (one per leaf) for the inner
    optimizer; None at static leaves (the inner optimizer never sees them)."""
    return self.treedef.unflatten(
        [None if s.kind == STATIC else v for s, v in zip(self.leaves, values)])

  def state_bytes_per_device(self, moments: int = 2,
                             master_dtype: Any = np.float32) -> int:
    """Bytes of sharded state one device holds: ``moments`` trees (Adam: mu,
    nu) in each leaf's :func:`master_dtype`, plus a master copy of each leaf
    that is not already in it (a leaf in it is its own master)."""
    total = 0
    for l in self.leaves:
      if l.kind != STATIC:
        m = _master_of(l.dtype, master_dtype)
        total += l.shard_size * m.itemsize * (moments + (l.dtype != m))
    return total

  @property
  def num_padding(self) -> int:
    return sum(l.pad for l in self.leaves if l.kind == SHARD)


def trainable(dtype: Any) -> bool:
  """Whether leaves of ``dtype`` are trained: floating or complex."""
  return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))


def master_dtype(dtype: Any, master: Any = np.float32) -> np.dtype:
  """The dtype a trainable leaf of ``dtype`` keeps its master (and its
  gradient arithmetic) in, given the configured ``master`` (a real floating
  dtype): the wider of the two, complex for a complex leaf. float32 for
  bf16/fp16/fp32 params, float64 for float64 ones (a float32 master would
  round every float64 update: 2.9e-7 relative), complex64 for complex64 and
  complex128 for complex128 params. A parameter already in its master dtype
  is its own master (no copy).

  Example:
    >>> [master_dtype(d).name for d in ("bfloat16", "float32", "complex64")]
    ['float32', 'float32', 'complex64']
  """
  return np.dtype(jax.numpy.promote_types(np.dtype(dtype), np.dtype(master)))


_master_of = master_dtype   # for Layout, whose argument shadows the name


def leaf_dtype(x: Any) -> np.dtype:
  """A leaf's dtype; a Python scalar's as ``jnp.asarray`` makes it (float
  -> float32 or float64 under x64, int -> int32, ...), as optax treats it."""
  dt = getattr(x, "dtype", None)
  return np.dtype(dt if dt is not None else jax.numpy.result_type(x))


def choose_shard_dim(shape: Sequence[int], n: int,
                     taken: Sequence[int] = ()) -> int | None:
  """The dimension a leaf is split on: the first divisible by ``n``, else the
  one whose padding to a multiple of ``n`` costs the fewest elements.

  ``taken``: dims already sharded over other mesh axes (``shape`` is then the
  local block). They are avoided, so that the state's padding stays at the
  end of one whole dim; when every dim is taken, the first one ``n`` divides
  (no padding), else None (the leaf is not split).
  """
  free = [d for d in range(len(shape)) if d not in taken]
  if not free:
    return next((d for d in range(len(shape)) if shape[d] % n == 0), None)
  for d in free:
    if shape[d] % n == 0:
      return d
  size = math.prod(shape)

  def padded(d):
    return size // shape[d] * (-(-shape[d] // n) * n)

  return min(free, key=lambda d: (padded(d), d))


def leaf_spec(shape: Sequence[int], dtype: Any, n: int,
              taken: Sequence[int] = ()) -> LeafSpec:
  """How one leaf of ``shape`` is split over ``n`` devices; ``taken`` as in
  :func:`choose_shard_dim`."""
  shape = tuple(int(s) for s in shape)
  dtype = np.dtype(dtype)
  if not trainable(dtype) or math.prod(shape) == 0:
    return LeafSpec(STATIC, shape, dtype, -1, shape, shape)
  d = choose_shard_dim(shape, n, taken) if shape else None
  if d is None:
    return LeafSpec(REPLICATE, shape, dtype, -1, shape, shape)
  rows = -(-shape[d] // n)
  shard = shape[:d] + (rows,) + shape[d + 1:]
  padded = shape[:d] + (rows * n,) + shape[d + 1:]
  return LeafSpec(SHARD, shape, dtype, d, shard, padded)


@functools.lru_cache(maxsize=256)
def _plan(treedef, shapes, dtypes, n, taken) -> Layout:
  taken = taken or ((),) * len(shapes)
  leaves = tuple(leaf_spec(s, t, n, k)
                 for s, t, k in zip(shapes, dtypes, taken))
  return Layout(treedef, leaves, n)


def plan(tree: Any, num_shards: int,
         taken: tuple[tuple[int, ...], ...] | None = None) -> Layout:
  """Plans the split of ``tree`` (arrays or ShapeDtypeStructs) over N devices.

  ``taken[i]``: the dims of leaf ``i`` sharded over mesh axes other than the
  data axis (``tree`` then holds local blocks; :mod:`.param_axes`).

  Example:
    >>> import jax.numpy as jnp
    >>> lay = plan({'w': jnp.zeros((5, 3)), 'b': jnp.zeros(())}, 4)
    >>> [(l.kind, l.shard_shape) for l in lay.leaves]   # 5x4 pads less than 8x3
    [('replicate', ()), ('shard', (5, 1))]
  """
  if num_shards < 1:
    raise ValueError(f"num_shards must be >= 1, got {num_shards}")
  leaves, treedef = jax.tree.flatten(tree)
  shapes = tuple(tuple(np.shape(x)) for x in leaves)
  dtypes = tuple(leaf_dtype(x) for x in leaves)
  return _plan(treedef, shapes, dtypes, int(num_shards),
               None if taken is None else tuple(map(tuple, taken)))


@functools.lru_cache(maxsize=256)
def plan_buckets(layout: Layout, dtypes: tuple, bucket_bytes: int,
                 inplace_bytes: int | None = None,
                 order: tuple[int, ...] | None = None,
                 exposed: str | None = None) -> tuple[Bucket, ...]:
  """Cuts the per-device shard vector of each dtype into buckets.

  ``dtypes[i]`` is the dtype leaf ``i`` travels in (the gradient dtype for the
  reduce, the parameter dtype for the gather). ``order``: the leaf indices in
  the order their collectives become possible (the backward's for a reduce,
  the forward's for a gather: :mod:`zero1_jax.core.order`); default: tree
  order. Buckets come out in that order.

  A leaf of at least ``inplace_bytes`` (over all N devices) travels alone, in
  place: its bucket is the whole leaf, never cut, and its collective runs on
  the gradient (or master shard) itself, so no bucket copy is written. The
  other leaves (``inplace_bytes=None``: all of them) are packed: a packed
  bucket holds at most ``bucket_bytes`` over all N devices, so a dtype group
  of ``B`` packed bytes (N times its per-device shard bytes) takes exactly
  ``ceil(B / bucket_bytes)`` collectives; leaves larger than a bucket are cut
  across buckets. Packing is a copy: worth it only for leaves so small that
  a collective each would cost more in latency.

  Consecutive buckets of at most ``bucket_bytes`` in all (and at most
  :data:`GROUP_BYTES`: a larger group only starts later) share a ``group``
  (a bucket over it is a group of its own). ``exposed``: which end of
  ``order`` no compute can hide. ``"first"`` (a gather before the forward:
  nothing runs until the first group has arrived): a packed bucket goes
  where its first leaf is needed, and the groups grow from 1/16 of
  ``bucket_bytes`` (1/16, 1/8, 1/4, 1/2, then whole); ``"last"`` (a reduce
  after the backward: the last group runs after all compute): a packed
  bucket goes where its last leaf is ready, and the groups shrink towards
  the end the same way. None: every group up to ``bucket_bytes``.

  Example:
    >>> lay = plan({"a": np.zeros((8, 64), np.float32), "b": np.zeros((8, 64), np.float32)}, 2)
    >>> [b.group for b in plan_buckets(lay, (np.float32,) * 2, 4096, 0)]
    [0, 0]
    >>> [b.group for b in plan_buckets(lay, (np.float32,) * 2, 4096, 0, exposed="first")]
    [0, 1]
  """
  n = layout.num_shards
  packed: dict[np.dtype, list[Segment]] = {}
  room: dict[np.dtype, int] = {}
  buckets: list[Bucket] = []
  order = tuple(range(len(layout.leaves))) if order is None else tuple(order)
  for i in order:
    l = layout.leaves[i]
    if l.kind != SHARD:
      continue
    dt = np.dtype(dtypes[i])
    if inplace_bytes is not None and n * l.shard_size * dt.itemsize >= inplace_bytes:
      buckets.append(Bucket(dt, (Segment(i, 0, l.shard_size),)))
      continue
    cap = max(1, int(bucket_bytes) // (n * dt.itemsize))
    start, size = 0, l.shard_size
    while start < size:
      if dt not in packed:
        packed[dt], room[dt] = [], cap
      take = min(room[dt], size - start)
      packed[dt].append(Segment(i, start, take))
      start += take
      room[dt] -= take
      if room[dt] == 0:   # full: it goes where its last piece was met
        buckets.append(Bucket(dt, tuple(packed.pop(dt))))
  buckets += [Bucket(dt, tuple(segs)) for dt, segs in packed.items()]
  if exposed == "first":   # a packed bucket is needed with its first leaf
    at = {leaf: k for k, leaf in enumerate(order)}
    buckets.sort(key=lambda b: at[b.segments[0].leaf])
  groups = group_ids([n * b.length * np.dtype(b.dtype).itemsize
                      for b in buckets], min(bucket_bytes, GROUP_BYTES), exposed)
  return tuple(b._replace(group=g) for b, g in zip(buckets, groups))


_TAPER = 4   # groups at the exposed end: 1/16, 1/8, 1/4, 1/2 of bucket_bytes
# The most bytes one group of collectives (one XLA combiner_key) covers,
# whatever bucket_bytes says: DeepSpeed's default reduce_bucket_size (5e8
# elements, 2 GB of fp32) would make the whole backward's reduce one group,
# which starts after the last gradient (BERT-base's step on 8 H100s: 706 µs
# of reduce-scatter exposed at the end, against 167 µs in groups of 64 MiB).
GROUP_BYTES = 1 << 26


def group_ids(sizes: Sequence[int], group_bytes: int,
              exposed: str | None = None) -> list[int]:
  """Consecutive items (of ``sizes`` bytes) cut into groups of at most
  ``group_bytes`` (an item over it is a group of its own), numbered from 0;
  towards the ``exposed`` end (``"first"`` / ``"last"``) the groups are
  1/2, 1/4, 1/8, 1/16 of ``group_bytes``, as :func:`plan_buckets` says.

  Example:
    >>> group_ids([4, 4, 4, 4], 64), group_ids([4, 4, 4, 4], 64, "last")
    ([0, 0, 0, 0], [0, 1, 1, 2])
  """
  walk = range(len(sizes))
  if exposed == "last":
    walk = reversed(walk)
  out, group, used = [0] * len(sizes), -1, 0
  for k in walk:
    limit = (group_bytes if exposed is None
             else group_bytes >> max(0, _TAPER - max(group, 0)))
    if group < 0 or used + sizes[k] > limit:
      group, used = group + 1, 0
    used += sizes[k]
    out[k] = group
  return [group - g for g in out] if exposed == "last" else out
