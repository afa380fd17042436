"""The layout is the specification of who holds what: every leaf 1/N exactly."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zero1_jax.core import layout as lay

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(5, 7), (7,), (3, 8, 5), (1, 1), (13, 3)])
def test_every_sharded_leaf_is_exactly_one_nth_of_its_padded_self(n, shape):
  spec = lay.leaf_spec(shape, jnp.float32, n)
  assert spec.kind == lay.SHARD
  assert math.prod(spec.padded_shape) == n * spec.shard_size
  assert spec.padded_shape[spec.dim] % n == 0
  # Padding is on one dim only and less than n rows of it.
  diffs = [d for d, (a, b) in enumerate(zip(spec.shape, spec.padded_shape)) if a != b]
  assert diffs in ([], [spec.dim])
  assert spec.padded_shape[spec.dim] - spec.shape[spec.dim] < n


def test_shard_dim_prefers_a_divisible_dim_then_least_padding():
  assert lay.choose_shard_dim((3, 8), 4) == 1      # divisible: no padding
  assert lay.choose_shard_dim((8, 8), 4) == 0      # first divisible
  assert lay.choose_shard_dim((5, 3), 4) == 1      # 5x4=20 < 8x3=24
  assert lay.choose_shard_dim((9, 3), 4) == 0      # 12x3=36 < 9x4=36: tie -> first


def test_leaf_kinds():
  assert lay.leaf_spec((), jnp.float32, 4).kind == lay.REPLICATE
  assert lay.leaf_spec((0, 3), jnp.float32, 4).kind == lay.STATIC
  assert lay.leaf_spec((3,), jnp.int32, 4).kind == lay.STATIC
  assert lay.leaf_spec((3,), jnp.bfloat16, 4).kind == lay.SHARD


def _tree():
  return {"a": S((5, 7), jnp.float32), "b": S((7,), jnp.float32),
          "c": S((3, 8, 5), jnp.bfloat16), "d": S((), jnp.float32),
          "e": S((4,), jnp.int32)}


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("bucket_bytes", [16, 100, 1000, 1 << 30])
@pytest.mark.parametrize("inplace_bytes", [None, 0, 150])
def test_buckets_cover_every_shard_element_once_within_the_bucket_rule(
    n, bucket_bytes, inplace_bytes):
  layout = lay.plan(_tree(), n)
  dtypes = tuple(l.dtype for l in layout.leaves)
  buckets = lay.plan_buckets(layout, dtypes, bucket_bytes, inplace_bytes)
  seen = {i: np.zeros(l.shard_size, int) for i, l in enumerate(layout.leaves)
          if l.kind == lay.SHARD}

  def alone(l):   # travels in place: all N pieces >= inplace_bytes
    return inplace_bytes is not None and \
        n * l.shard_size * l.dtype.itemsize >= inplace_bytes

  for b in buckets:
    i = b.whole_leaf(layout)
    if i is not None and alone(layout.leaves[i]):
      assert b.segments == (lay.Segment(i, 0, layout.leaves[i].shard_size),)
    else:
      assert n * b.length * b.dtype.itemsize <= max(bucket_bytes, n * b.dtype.itemsize)
    for s in b.segments:
      assert layout.leaves[s.leaf].dtype == b.dtype
      assert not alone(layout.leaves[s.leaf]) or len(b.segments) == 1
      seen[s.leaf][s.start:s.start + s.length] += 1
  assert all((v == 1).all() for v in seen.values())
  # Collective count: one per in-place leaf, plus ceil(bytes / bucket_bytes)
  # per dtype group for the packed ones.
  want = 0
  for dt in {l.dtype for l in layout.leaves if l.kind == lay.SHARD}:
    group = [l for l in layout.leaves if l.kind == lay.SHARD and l.dtype == dt]
    per_dev = sum(l.shard_size for l in group if not alone(l))
    cap = max(1, bucket_bytes // (n * dt.itemsize))
    want += -(-per_dev // cap) + sum(alone(l) for l in group)
  assert len(buckets) == want
  if inplace_bytes == 0:
    assert all(b.whole_leaf(layout) is not None for b in buckets)


def test_plan_is_cached_and_rejects_bad_n():
  assert lay.plan(_tree(), 4) is lay.plan(_tree(), 4)
  with pytest.raises(ValueError, match="num_shards"):
    lay.plan(_tree(), 0)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bert_base_pads_by_less_than_a_thousandth(n):
  from zero1_jax.models import bert
  cfg = bert.make_config("bert-base-uncased", vocab_size=30522, max_len=512)
  shapes = jax.eval_shape(lambda: bert.init_params(cfg, jax.random.key(0)))
  layout = lay.plan(shapes, n)
  psi = sum(math.prod(l.shape) for l in layout.leaves)
  assert layout.num_padding <= 1e-3 * psi


def test_after_jits_reduce_gpu_gathers_are_packed_later_dims_first():
  """Plain jit with ``jax.grad`` on GPU (``reduced_by_jit``): no gather can
  start before XLA's combined reduce-scatter, so ``inplace_bytes="auto"``
  packs every leaf; the leaves split on a later dim go first, so the add
  after the last gather reads contiguous rows (core/plan.py); across hosts
  in tree order. Elsewhere the large leaves travel alone, in tree order."""
  from zero1_jax.core import plan
  from zero1_jax.core.tx_config import Zero1Config
  params = [np.zeros((512, 64), np.float32),    # 128 KiB, rows split
            np.zeros((3, 8192), np.float32),    # 96 KiB, columns split
            np.zeros((16, 8), np.float32)]      # small
  layout = lay.plan(params, 8)
  assert [l.dim for l in layout.leaves] == [0, 1, 0]
  leaves = lambda bs: [[s.leaf for s in b.segments] for b in bs]
  _, after_jit = plan.buckets(Zero1Config("data"), layout, params, params,
                              platform="gpu", reduced_by_jit=True)
  assert leaves(after_jit) == [[1, 0, 2]]
  _, over_hosts = plan.buckets(Zero1Config("data"), layout, params, params,
                               platform="gpu", reduced_by_jit=True,
                               across_hosts=True)
  assert leaves(over_hosts) == [[0, 1, 2]]
  _, in_step = plan.buckets(Zero1Config("data"), layout, params, params,
                            platform="gpu")
  assert leaves(in_step) == [[0], [1], [2]]


def test_with_the_loss_read_order_reduced_in_its_reverse_gathered_in_it():
  """``order`` (the leaves as the loss first reads them, core/order.py):
  the reduce buckets go in its reverse (the backward's order: the last
  layer's gradient is complete first), the gathers in it. Four leaves of
  32 KiB, 64 KiB buckets, nothing in place."""
  from zero1_jax.core import plan
  from zero1_jax.core.tx_config import Zero1Config
  params = [np.zeros((64, 128), np.float32)] * 4
  layout = lay.plan(params, 8)
  cfg = Zero1Config("data", bucket_bytes=1 << 16, inplace_bytes=None)
  leaves = lambda bs: [[s.leaf for s in b.segments] for b in bs]
  reduce, gather = plan.buckets(cfg, layout, params, params,
                                order=(2, 0, 3, 1), platform="gpu")
  assert leaves(reduce) == [[1, 3], [0, 2]]
  assert leaves(gather) == [[2, 0], [3, 1]]


def test_after_jits_reduce_across_hosts_the_gathers_are_256_mib():
  """After jit's reduce across GPU hosts every gather waits for XLA's
  combined reduce-scatters, so its buckets hold up to 256 MiB (or
  ``bucket_bytes`` if larger); ``gather_bucket_bytes`` still decides when
  set, and one host (or gradients the update reduces itself) keeps
  ``bucket_bytes``. Shapes only: 6 leaves of 48 MiB, 288 MiB in all."""
  import jax
  import jax.numpy as jnp
  from zero1_jax.core import plan
  from zero1_jax.core.tx_config import Zero1Config
  params = [jax.ShapeDtypeStruct((3 << 20, 4), jnp.float32)] * 6
  layout = lay.plan(params, 16)
  gathers = lambda cfg, **kw: len(plan.buckets(
      cfg, layout, params, params, platform="gpu", **kw)[1])
  jit_apart = dict(reduced_by_jit=True, across_hosts=True)
  assert gathers(Zero1Config("data"), **jit_apart) == 2          # 256 + 32 MiB
  assert gathers(Zero1Config("data"), reduced_by_jit=True) == 5  # 64 MiB each
  assert gathers(Zero1Config("data", inplace_bytes=None), across_hosts=True) == 5
  assert gathers(Zero1Config("data", gather_bucket_bytes=100 << 20),
                 **jit_apart) == 3
  assert gathers(Zero1Config("data", bucket_bytes=1 << 30), **jit_apart) == 1
