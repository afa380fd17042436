"""Row lookups served from the stored column blocks (core/lookup.py,
``train_step(shard_lookups=...)``).

The specification: a 2-D leaf kept split on its columns between steps (or,
in plain jit with ``z1.value_and_grad``, split so in the update) that the
loss reads by rows (an embedding, tied or not) is looked up from each
device's block; the rows are the same, so the forward is unchanged; the
lookup's gradient arrives summed over every device's tokens and is added to
the reduced sum of the table's other reads. Where every sum is exact
(integers), the step equals optax's bitwise; otherwise the table's gradient
is the same terms summed in another order, within the bound that order
allows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zero1_jax as z1
from zero1_jax.core import lookup

V, D, T = 41, 16, 5   # 41 rows: split over the columns at every N (no padding)


def _mesh(n):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _tied_linear(p, b):
  """Tied table, linear in it: every gradient a sum of integers (exact)."""
  h = jnp.take(p["emb"], b["ids"], axis=0)             # (b, T, D) lookup
  out = jnp.einsum("btd,btd->", h, b["c"])             # d/dh = c
  dec = jnp.einsum("bd,vd,bv->", b["x"], p["emb"], b["y"])   # tied read
  return (out + dec + jnp.sum(p["w"] * jnp.sum(b["x"], 0))) / b["ids"].shape[0]


def _int_batch(key, rows, v=V, d=D):
  k = jax.random.split(key, 4)
  r = lambda k, shape, lo, hi: jax.random.randint(k, shape, lo, hi).astype(jnp.float32)
  return {"ids": jax.random.randint(k[0], (rows, T), 0, v),
          "c": r(k[1], (rows, T, d), -3, 4), "x": r(k[2], (rows, d), -3, 4),
          "y": r(k[3], (rows, v), -2, 3)}


def _int_params(v=V, d=D):
  k = jax.random.split(jax.random.key(1))
  return {"emb": jax.random.randint(k[0], (v, d), -8, 8).astype(jnp.float32),
          "w": jax.random.randint(k[1], (d,), -8, 8).astype(jnp.float32)}


def _optax_steps(loss, params, batches, lr):
  tx = optax.sgd(lr)
  state = tx.init(params)
  for b in batches:
    u, state = tx.update(jax.grad(loss)(params, b), state, params)
    params = optax.apply_updates(params, u)
  return params


def _zero1_steps(loss, params, batches, lr, n, *, stage=1, lookups=True,
                 accum=1):
  mesh = _mesh(n)
  tx = (z1.zero2 if stage == 2 else z1.zero1)(optax.sgd(lr), axis_name="data")
  p, s = z1.init(tx, params, mesh)
  step = z1.train_step(loss, tx, mesh, shard_params=True,
                       shard_lookups=lookups, grad_accum_steps=accum)
  for b in batches:
    p, s, m = step(p, s, b)
  return jax.tree.map(np.asarray, p), m


def test_the_table_read_by_rows_is_found():
  f = lambda p, b: jnp.sum(jnp.take(p["emb"], b, axis=0) @ p["emb"].T)
  ids = jnp.zeros((2, T), jnp.int32)
  params = {"emb": jnp.ones((V, D)), "w": jnp.ones((V, D))}
  assert lookup.find(f, params, ids, candidates={0, 1}) == {0}
  # indexing, inside a jit, after a cast to the compute dtype
  g = jax.jit(lambda p, b: jnp.sum(p["w"].astype(jnp.bfloat16)[b]))
  assert lookup.find(g, params, ids, candidates={0, 1}) == {1}
  # not a row lookup: elements picked along the last axis
  h = lambda p, b: jnp.sum(jnp.take_along_axis(
      p["w"], jnp.zeros((V, 1), jnp.int32) + b[0, 0], axis=1))
  assert lookup.find(h, params, ids, candidates={0, 1}) == frozenset()
  # only candidates (leaves stored split on the columns) count
  assert lookup.find(f, params, ids, candidates={1}) == frozenset()


@pytest.mark.parametrize("n", [2, 8])
def test_rows_from_the_blocks_are_the_rows(n):
  """The rewritten forward reads exactly the rows: an exact lookup, any
  mode, the blocks side by side in device order."""
  mesh = _mesh(n)
  emb = jax.random.normal(jax.random.key(0), (V, D))
  ids = jax.random.randint(jax.random.key(1), (4 * n, T), -2, V + 2)  # out of range too
  f = lambda p, b: jnp.take(p["emb"], b, axis=0, mode="fill", fill_value=-1.0)
  g = lookup.rewrite(f, {"emb": emb}, ids[:4], leaves=[0], axis="data")
  run = jax.jit(jax.shard_map(lambda p, t, b: g(p, {0: t}, b), mesh=mesh,
                              in_specs=(P(), P(None, "data"), P("data")),
                              out_specs=P("data"), check_vma=False))
  got = run({"emb": emb}, emb, ids)
  np.testing.assert_array_equal(got, f({"emb": emb}, ids))


@pytest.mark.parametrize("n,stage,accum", [(2, 1, 1), (4, 2, 1), (8, 1, 2),
                                           (8, 2, 1)])
def test_exact_sums_give_optax_bitwise(n, stage, accum):
  """Integer gradients: any summation order is exact, so the step must equal
  optax's bit for bit (a lookup gradient lost, doubled, or its blocks
  swapped would not)."""
  params = _int_params()
  batches = [_int_batch(jax.random.key(i), 8 * accum) for i in range(2)]
  want = _optax_steps(_tied_linear, params, batches, 0.5)
  got, _ = _zero1_steps(_tied_linear, params, batches, 0.5, n, stage=stage,
                        accum=accum)
  for k in params:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _softmax_lm(p, b):
  h = jnp.take(p["emb"], b["ids"], axis=0)
  z = jnp.tanh(h @ p["w"])
  logits = z @ p["emb"].T
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits, b["labels"]))


def _term_magnitudes(params, batch, n):
  """float64: for each element of the table's and w's gradient, the sum of
  the magnitudes of the terms it sums (per device: its decoder part; per
  token: its lookup part), and the largest count of terms."""
  emb, w = (np.asarray(params[k], np.float64) for k in ("emb", "w"))
  s_emb, s_w = np.zeros_like(emb), np.zeros_like(w)
  for ids, labels in zip(np.split(np.asarray(batch["ids"]), n),
                         np.split(np.asarray(batch["labels"]), n)):
    h = emb[ids]
    z = np.tanh(h @ w)
    logits = z @ emb.T
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    dlog = prob
    np.put_along_axis(dlog, labels[..., None], np.take_along_axis(
        dlog, labels[..., None], -1) - 1, -1)
    dlog /= ids.size
    da = (dlog @ emb) * (1 - z ** 2)
    s_emb += np.abs(np.einsum("btv,btd->vd", dlog, z))     # decoder, one term
    np.add.at(s_emb, ids, np.abs(da @ w.T))                 # lookup, per token
    s_w += np.einsum("btd,bte->de", np.abs(h), np.abs(da))
  return s_emb, s_w, batch["ids"].size + n


@pytest.mark.parametrize("n", [2, 8])
def test_rounding_stays_within_the_reordered_sums_bound(n):
  """A float model: each gradient element sums m terms; two orders of the
  same terms differ by at most 2 (m - 1) u sum|terms| (u = 2^-24), divided
  by N and scaled by the learning rate, plus one ulp of the weight from the
  final rounding. Checked per element against optax and against the
  gathered path."""
  params, batch, lr = _float_case()
  got, m = _zero1_steps(_softmax_lm, params, [batch], lr, n)
  gathered, m2 = _zero1_steps(_softmax_lm, params, [batch], lr, n,
                              lookups=False)
  assert float(m["loss"]) == float(m2["loss"])   # the same rows: the same forward
  _assert_within_reordered_sums(got, gathered, params, batch, lr, n)


def _float_case():
  """The float model's params, one batch and the learning rate."""
  params = {"emb": jax.random.normal(jax.random.key(2), (V, D)),
            "w": jax.random.normal(jax.random.key(3), (D, D)) * 0.3}
  batch = {"ids": jax.random.randint(jax.random.key(4), (16, T), 0, V),
           "labels": jax.random.randint(jax.random.key(5), (16, T), 0, V)}
  return params, batch, 0.1


def _assert_within_reordered_sums(got, gathered, params, batch, lr, n):
  """Per element, ``got`` against optax's step and against ``gathered``
  (the lookups gathered): within the reordered-sums bound above."""
  want = _optax_steps(_softmax_lm, params, [batch], lr)
  s_emb, s_w, terms = _term_magnitudes(params, batch, n)
  u = 2.0 ** -24
  for k, s in (("emb", s_emb), ("w", s_w)):
    ulp = np.spacing(np.abs(np.asarray(want[k], np.float32)))
    bound = lr * 2 * (terms - 1) * u * s / n * (1 + 4 * u) + ulp
    for other in (want[k], gathered[k]):
      err = np.abs(got[k].astype(np.float64) - np.asarray(other, np.float64))
      assert np.all(err <= bound), (k, float((err / bound).max()))


def _plain_jit_steps(loss, params, batches, lr, n, *, lookups=True):
  """A plain-jit loop: z1.value_and_grad, tx.update, optax.apply_updates."""
  tx = z1.zero1(optax.sgd(lr), axis_name="data")
  with jax.set_mesh(_mesh(n)):
    state = tx.init(params)

    @jax.jit
    def step(p, s, b):
      value, g = z1.value_and_grad(loss, tx, shard_lookups=lookups)(p, b)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, value

    for b in batches:
      params, state, value = step(params, state, b)
  return jax.tree.map(np.asarray, params), value


@pytest.mark.parametrize("n", [2, 8])
def test_plain_jit_exact_sums_give_optax_bitwise(n):
  """z1.value_and_grad(shard_lookups=True) (the default on GPUs and TPUs of
  one host): the table's row lookups read each device's column block of the
  whole params, and their gradient arrives summed by the rows' all-to-all.
  Integer gradients: bitwise optax (a lookup gradient lost, doubled, or
  added to another block would not be)."""
  params = _int_params()
  batches = [_int_batch(jax.random.key(i), 8) for i in range(2)]
  want = _optax_steps(_tied_linear, params, batches, 0.5)
  got, _ = _plain_jit_steps(_tied_linear, params, batches, 0.5, n)
  for k in params:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_plain_jit_rounding_stays_within_the_reordered_sums_bound():
  """The float model of test_rounding_stays_within_the_reordered_sums_bound
  through z1.value_and_grad at N = 8, the same bound (the same terms summed
  in another order), against optax and against the lookups gathered."""
  n = 8
  params, batch, lr = _float_case()
  got, value = _plain_jit_steps(_softmax_lm, params, [batch], lr, n)
  gathered, value2 = _plain_jit_steps(_softmax_lm, params, [batch], lr, n,
                                      lookups=False)
  assert float(value) == float(value2)   # the same rows: the same forward
  _assert_within_reordered_sums(got, gathered, params, batch, lr, n)


def test_a_padded_table_keeps_its_lookups_gathered():
  """A table split with padding (3 x 5 over 2 devices: neither dim
  divides; split on its columns, 5 padded to 6) cannot hand each device an
  equal column block of the table's own: with
  shard_lookups=True its lookups stay on the gathered table (no all-to-all
  of its rows), in plain jit and in train_step, and train as optax
  (integer gradients: bitwise)."""
  params = _int_params(v=3, d=5)
  batches = [_int_batch(jax.random.key(i), 8, v=3, d=5) for i in range(2)]
  want = _optax_steps(_tied_linear, params, batches, 0.5)
  got, _ = _plain_jit_steps(_tied_linear, params, batches, 0.5, 2)
  kept, _ = _zero1_steps(_tied_linear, params, batches, 0.5, 2)
  for k in params:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    np.testing.assert_array_equal(kept[k], want[k], err_msg=k)


def test_lookups_need_the_stored_shards():
  mesh = _mesh(2)
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  with pytest.raises(ValueError, match="shard_params=True"):
    z1.train_step(_tied_linear, tx, mesh, shard_params=False,
                  shard_lookups=True)
  with pytest.raises(ValueError, match="shard_lookups"):
    z1.train_step(_tied_linear, tx, mesh, shard_lookups="yes")
