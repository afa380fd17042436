"""Losses that mix the batch's rows warn under ``z1.value_and_grad``
(core/rows.py): it runs the loss on each device's rows and averages the
devices' losses, which is jax.value_and_grad's only for a mean of per-row
terms. In-batch negatives, batch statistics applied to rows and a weighted
mean divided by the device's own weight ran silently with other values and
gradients: a contrastive loss on 32 rows gave 0.230 for jax's 4.253.

Each warned loss is shown to differ from jax.value_and_grad's (the warning
is not a guess); each loss written per row is shown to pass silently.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zero1_jax as z1
from zero1_jax.core import rows
from zero1_jax.models import bert, gpt

from helpers import mesh

N, B = 8, 32
MIXES = "zero1: z1.value_and_grad runs the loss on each device's rows"
R = np.random.default_rng(0)
X = R.normal(size=(B, 16)).astype(np.float32)
Y = R.integers(0, 8, size=B).astype(np.int32)
W = {"w": jnp.asarray(R.normal(size=(16, 8)) * 0.3, jnp.float32)}


def contrastive(p, x, y):   # SimCLR / CLIP: every other row a negative
  z = x @ p["w"]
  logits = z @ z.T
  return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.diagonal(logits))


def batch_norm(p, x, y):
  h = x @ p["w"]
  return jnp.mean(((h - h.mean(0)) / (h.std(0) + 1e-5)) ** 3)


def pairwise(p, x, y):   # broadcast rows against rows
  h = x @ p["w"]
  return jnp.mean(jnp.abs(h[:, None, :] - h[None, :, :]))


def softmax_over_batch(p, x, y):
  return -jnp.mean(jax.nn.log_softmax((x @ p["w"]).sum(-1)))


def own_weighted_mean(p, x, y):
  l = optax.softmax_cross_entropy_with_integer_labels(x @ p["w"], y)
  w = (y > 2).astype(jnp.float32)
  return jnp.sum(w * l) / jnp.maximum(jnp.sum(w), 1.0)


def hardest_examples(p, x, y):   # online hard example mining
  l = optax.softmax_cross_entropy_with_integer_labels(x @ p["w"], y)
  return jnp.mean(jax.lax.top_k(l, 2)[0])


def two_views(p, x, y):   # two augmentations stacked in one batch, split
  a, b = jnp.split(x @ p["w"], 2)
  return jnp.mean(jnp.sum((a - b) ** 2, -1))


MIXING = {contrastive: "`dot_general` pairs each row with other rows",
          batch_norm: "`sub` combines rows with a statistic over the batch's rows",
          pairwise: "`sub` pairs each row with other rows",
          softmax_over_batch: "`reduce_max` along the batch's rows",
          own_weighted_mean: "`max` of a sum over the batch's rows",
          hardest_examples: "`top_k` along the batch's rows",
          two_views: "`sub` pairs rows at different positions in the batch"}


def cross_entropy(p, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(x @ p["w"], y).mean()


def tokens(p, x, y):   # (B, T) lookups, flattened to B*T for the loss
  t = (y[:, None] + jnp.arange(5)) % 16
  logits = jnp.take(p["w"], t, axis=0).reshape(-1, 8)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, t.reshape(-1) % 8).mean() + 1e-3 * jnp.sum(p["w"] ** 2)


def layers_scanned(p, x, y):   # nn.scan-style: the carry holds the rows
  h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ jnp.eye(8)), None),
                      x @ p["w"], None, length=3)
  return jax.checkpoint(lambda h: jnp.mean(h ** 2))(h)


def shared_weighted_mean(p, x, y, total):   # docs/flax_programs.md's form
  l = optax.softmax_cross_entropy_with_integer_labels(x @ p["w"], y)
  return N * jnp.sum((y > 2) * l) / total


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    h = nn.LayerNorm()(nn.Dense(8)(x))
    return nn.Dense(4)(nn.Dropout(0.1, deterministic=not train)(h))


def _auto():   # jax.jit(f) of a loss pairing rows needs Auto axes
  return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:N])


def _warned(f, *args, m=None):
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    with jax.set_mesh(m or _auto()):
      out = jax.jit(z1.value_and_grad(f, tx, batch_argnums=(1, 2)))(*args)
  said = [str(w.message) for w in seen if str(w.message).startswith(MIXES)]
  return said, out


@pytest.mark.parametrize("f", list(MIXING), ids=lambda f: f.__name__)
def test_a_loss_that_mixes_rows_warns_and_differs(f):
  m = _auto()
  p = jax.device_put(W, NamedSharding(m, P()))
  x, y = jax.device_put((X, Y), NamedSharding(m, P("data")))
  said, (loss, _) = _warned(f, p, x, y, m=m)
  assert len(said) == 1 and MIXING[f] in said[0], said
  assert "n * jnp.sum(w * l) / total" in said[0]
  assert "jax.lax.all_gather(z, 'data', tiled=True)" in said[0]
  with jax.set_mesh(m):
    want = jax.jit(f)(p, x, y)
  assert abs(float(loss) - float(want)) > 1e-3 * abs(float(want)), (loss, want)
  # On Explicit axes (jax.make_mesh's) the same warning.
  e = mesh(N)
  said, _ = _warned(f, *jax.device_put((W, X, Y), (
      NamedSharding(e, P()), NamedSharding(e, P("data")),
      NamedSharding(e, P("data")))), m=e)
  assert len(said) == 1 and MIXING[f] in said[0], said


def test_losses_of_rows_pass_silently():
  m = mesh(N)
  p = jax.device_put(W, NamedSharding(m, P()))
  x, y = jax.device_put((X, Y), NamedSharding(m, P("data")))
  for f in (cross_entropy, tokens, layers_scanned):
    assert _warned(f, p, x, y, m=m)[0] == [], f.__name__
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  with warnings.catch_warnings(record=True) as seen, jax.set_mesh(m):
    warnings.simplefilter("always")
    total = jnp.sum(y > 2).astype(jnp.float32)
    jax.jit(z1.value_and_grad(shared_weighted_mean, tx, batch_argnums=(1, 2)))(
        p, x, y, total)
    model = Mlp()
    q = jax.device_put(model.init(jax.random.key(0), X, False), NamedSharding(m, P()))
    flax_loss = lambda q, x, y, key: optax.softmax_cross_entropy_with_integer_labels(
        model.apply(q, x, True, rngs={"dropout": key}), y % 4).mean()
    jax.jit(z1.value_and_grad(flax_loss, tx, batch_argnums=(1, 2)))(
        q, x, y, jax.random.key(1))
  assert not [w for w in seen if str(w.message).startswith(MIXES)]


def global_negatives(p, x, y):   # contrastive, every device's rows gathered
  z = x @ p["w"]
  logits = z @ jax.lax.all_gather(z, "data", tiled=True).T
  mine = jax.lax.axis_index("data") * z.shape[0] + jnp.arange(z.shape[0])
  return jnp.mean(jax.nn.logsumexp(logits, -1)
                  - logits[jnp.arange(z.shape[0]), mine])


def psum_weighted_mean(p, x, y):   # the batch's total weight by a psum
  l = optax.softmax_cross_entropy_with_integer_labels(x @ p["w"], y)
  w = (y > 2).astype(jnp.float32)
  return N * jnp.sum(w * l) / jax.lax.psum(jnp.sum(w), "data")


class SyncBn(nn.Module):   # flax's BatchNorm with statistics over the devices
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x):
    h = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(
        nn.Dense(8)(x))
    return nn.Dense(4)(nn.relu(h))


def test_a_loss_over_the_whole_batch_by_collectives_on_the_data_axis():
  """What mixes rows, computed over every device with collectives on the
  data axis (inside z1.value_and_grad's shard_map, where the axis is
  bound): in-batch negatives by ``all_gather``, a weighted mean's total by
  ``psum``, flax's ``BatchNorm(axis_name="data")``. Each is
  jax.value_and_grad's loss on the whole batch, and silent; zero1's own
  traces of the loss failed on them with "unbound axis name"."""
  m = _auto()
  v = jax.device_put(SyncBn().init(jax.random.key(0), X), NamedSharding(m, P()))
  bn = lambda axis: lambda v, x, y: optax.softmax_cross_entropy_with_integer_labels(
      SyncBn(axis).apply(v, x, mutable=["batch_stats"])[0], y % 4).mean()
  for f, params, whole in ((global_negatives, W, contrastive),
                           (psum_weighted_mean, W, own_weighted_mean),
                           (bn("data"), v, bn(None))):
    p = jax.device_put(params, NamedSharding(m, P()))
    x, y = jax.device_put((X, Y), NamedSharding(m, P("data")))
    said, (loss, g) = _warned(f, p, x, y, m=m)
    with jax.set_mesh(m):
      want, want_g = jax.jit(jax.value_and_grad(whole))(p, x, y)
    assert said == [], said
    # One device's sums against the devices' sums of sums: f32 sums of 32
    # rows reordered, within 32 * 2**-24 (2e-6) of the sum of magnitudes,
    # here under 1e-5 of the loss and of the tree's max|g| (a bias before
    # BatchNorm has a gradient that cancels to 0: its own scale is noise).
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    top = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(want_g))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g)):
      assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * top, (f, a, b)


def _states(f, *args, batch):
  closed = jax.make_jaxpr(f)(*args)
  flags = [b for a, b in zip(args, batch) for _ in jax.tree.leaves(a)]
  return rows.mixing(closed, flags), closed


def test_the_models_own_losses():
  """The project's BERT MLM loss divides by the masked positions' count
  (each device its own: flagged); GPT-2's is a plain mean of tokens."""
  for mod, batch, want in (
      (bert, {"input_ids": (4, 8), "labels": (4, 8)}, "`max` of a sum"),
      (gpt, {"input_ids": (4, 9)}, None)):
    cfg = mod.make_config(list(mod.SIZES)[0], vocab_size=97, max_len=16)
    params = jax.eval_shape(lambda: mod.init_params(cfg, jax.random.key(0)))
    shapes = {k: jax.ShapeDtypeStruct(s, jnp.int32) for k, s in batch.items()}
    why, _ = _states(mod.make_loss_fn(cfg), params, shapes, batch=(False, True))
    assert (why is None) if want is None else (want in why), (mod.__name__, why)


def test_rows_are_followed_through_calls_branches_and_reshapes():
  """A statistic over rows inside a scanned layer, in a scan over time of
  (T, B, ...) slices, a pmean over a vmapped batch, in a cond's branch and
  after a (B, T) -> (B*T) reshape is found; a reshape that splits the rows
  loses the trail (no guess), and a sum over rows that is only scaled and
  added stays a mean."""
  x = jax.ShapeDtypeStruct((B, 8), jnp.float32)
  bn = lambda h: h - h.mean(0)
  in_scan = lambda x: jax.lax.scan(lambda c, _: (jnp.tanh(bn(c)), None), x,
                                   None, length=2)[0].mean()
  over_time = lambda x: jax.lax.scan(   # time-major xs: (T, B, 8)
      lambda c, xt: (c, bn(xt)), 0.0, jnp.broadcast_to(x, (3, B, 8)))[1].mean()
  vmapped = lambda x: jax.vmap(   # Equinox's BatchNorm: pmean over a vmap
      lambda r: r - jax.lax.pmean(r, "batch"), axis_name="batch")(x).mean()
  in_cond = lambda x: jax.lax.cond(True, bn, lambda h: h, x).mean()
  merged = lambda x: bn(jnp.broadcast_to(x[:, None], (B, 3, 8)).reshape(-1, 8)).mean()
  split = lambda x: bn(x.reshape(2, B // 2, 8)).mean()
  linear = lambda x: 0.5 * x.sum() / B + 2.0 * jnp.mean(x ** 2) - x.mean()
  top_features = lambda x: jax.lax.top_k(x, 3)[0].mean()   # per row
  shifted = lambda x: jnp.mean((x[1:] - x[:-1]) ** 2)   # row i with row i+1
  halves = lambda x: x[:B // 2].mean() + jnp.mean(x[B // 2:][::-1] * 2.0)
  views = lambda x: jnp.mean(jnp.einsum("bd,bd->b", *jnp.split(x, 2)))
  for f, want in ((top_features, None), (shifted, "different positions"),
                  (views, "different positions"),
                  (halves, None), (in_scan, "statistic"), (over_time, "statistic"),
                  (vmapped, "statistic"), (in_cond, "statistic"),
                  (merged, "statistic"), (split, None), (linear, None)):
    why, _ = _states(f, x, batch=(True,))
    assert (why is None) if want is None else (want in why), (f, why)
  # Two views as batch arguments, concatenated for the model and split back:
  # each piece is its view again (each device holds the same rows of both).
  model = lambda a, b: jnp.split(jnp.tanh(jnp.concatenate([a, b]) @ jnp.eye(8)), 2)
  aligned = lambda a, b: jnp.mean(jnp.sum(jnp.prod(jnp.stack(model(a, b)), 0), -1))
  negatives = lambda a, b: jnp.mean(model(a, b)[0] @ model(a, b)[1].T)
  crossed = lambda a, b: jnp.mean(jnp.concatenate([a, b])[:B // 2] * a[B // 2:])
  normed = lambda a, b: jnp.mean(bn(jnp.concatenate([a, b])) ** 2)
  for f, want in ((aligned, None), (negatives, "pairs each row with other rows"),
                  (crossed, "different positions"), (normed, "statistic")):
    why, _ = _states(f, x, x, batch=(True, True))
    assert (why is None) if want is None else (want in why), (f, why)


class ConvBn(nn.Module):   # flax's imagenet / mnist examples, in training
  @nn.compact
  def __call__(self, x):
    h = nn.max_pool(nn.Conv(4, (3, 3))(x), (2, 2), (2, 2))
    h = nn.BatchNorm(use_running_average=False)(h)
    return nn.avg_pool(nn.relu(h), (2, 2), (2, 2)).mean((1, 2))


class ConvOnly(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.max_pool(nn.relu(nn.Conv(4, (3, 3))(x)), (2, 2), (2, 2))
    return nn.Dense(3)(h.reshape(h.shape[0], -1))


def test_the_forms_flax_examples_write_are_followed():
  """What the rows pass through in flax's examples (found by running
  lm1b, wmt, imagenet, mnist and sst2 with only the gradient line changed):
  a convolution and pooling keep the batch's rows, so BatchNorm after them
  is found; lm1b's shift right (a pad, a dynamic slice) and an LSTM's scan
  over time from a zero carry keep them, so a weighted mean after them is
  found, and the plain means pass."""
  img = jax.ShapeDtypeStruct((B, 8, 8, 3), jnp.float32)
  for model, want in ((ConvBn(), "statistic over the batch's rows"), (ConvOnly(), None)):
    v = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((2, 8, 8, 3))))
    f = lambda v, x: jnp.mean(model.apply(v, x, mutable=["batch_stats"])[0]
                              if isinstance(model, ConvBn) else model.apply(v, x))
    why, _ = _states(f, v, img, batch=(False, True))
    assert (why is None) if want is None else (want in why), (model, why)
  ids = jax.ShapeDtypeStruct((B, 6), jnp.int32)
  emb = jnp.ones((16, 4))

  def shifted(own_weight):
    def loss(ids):
      prev = jax.lax.dynamic_slice_in_dim(jnp.pad(ids, ((0, 0), (1, 0))), 0, 6, 1)
      x = jnp.take(emb, prev, axis=0)                       # (B, T, 4)
      def cell(c, xt):                                      # over time, from zeros
        c = jnp.tanh(c + xt)
        return c, c
      _, hs = jax.lax.scan(cell, jnp.zeros((B, 4)), x.transpose(1, 0, 2))
      l, w = (hs ** 2).sum(-1).T, (ids > 0).astype(jnp.float32)
      return jnp.sum(l * w) / jnp.sum(w) if own_weight else jnp.mean(l)
    return loss
  assert "`div` of a sum" in _states(shifted(True), ids, batch=(True,))[0]
  assert _states(shifted(False), ids, batch=(True,))[0] is None
