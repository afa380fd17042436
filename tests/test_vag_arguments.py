"""What ``z1.value_and_grad``'s loss is handed besides the batch: PRNG keys
(each device's index folded in), arrays it closes over on a mesh with
Explicit axes, scalars in the batch, and optimizers built inside the jit.

The dropout masks are compared bit for bit: each device's key is
``fold_in(key, its index)`` exactly, and bernoulli of one key is one
deterministic draw. The losses through a moved closure are compared with
jax.value_and_grad's at FP32_REORDER (tests/tolerances.py): the same terms,
summed per device then across devices.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zero1_jax as z1

from helpers import mesh
from tolerances import FP32_REORDER

N, ROWS, WIDTH = 8, 16, 6


def _auto():
  return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:N])


def dropout_loss(p, x, key):
  """A loss with a per-example dropout mask drawn from ``key``, returned
  as per-example aux (one row per example)."""
  h = x @ p["w"]
  keep = jax.random.bernoulli(key, 0.5, h.shape)
  return jnp.mean(jnp.where(keep, 2 * h, 0.0) ** 2), keep.astype(jnp.int32)


def _masks(key, device_keys=True, m=None):
  m = m or mesh(N)
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  with jax.set_mesh(m):
    p = jax.device_put({"w": jnp.ones((4, WIDTH))}, NamedSharding(m, P()))
    x = jax.device_put(np.ones((ROWS, 4), np.float32), NamedSharding(m, P("data")))
    f = z1.value_and_grad(dropout_loss, tx, has_aux=True, device_keys=device_keys)
    (_, keep), _ = jax.jit(f)(p, x, key)
  return np.asarray(keep).reshape(N, ROWS // N, WIDTH)


def _expected(key):
  """Device d's rows: bernoulli of fold_in(key, d) at one device's shape."""
  return np.stack([np.asarray(jax.random.bernoulli(
      jax.random.fold_in(key, d), 0.5, (ROWS // N, WIDTH))).astype(np.int32)
      for d in range(N)])


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey],
                         ids=["typed", "raw"])
def test_each_device_folds_its_index_into_a_key_argument(make_key):
  """A raw key is told from data by its dtype and shape alone (uint32[2]),
  so zero1 says it reads it as one; a typed key needs no word."""
  key = make_key(3)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    got = _masks(key)
  np.testing.assert_array_equal(got, _expected(key))
  assert any((got[d] != got[0]).any() for d in range(1, N))
  said = [w for w in seen if "read as a raw PRNG key" in str(w.message)]
  assert len(said) == (make_key is jax.random.PRNGKey)


def test_device_keys_false_hands_every_device_the_key_as_given():
  key = jax.random.key(3)
  got = _masks(key, device_keys=False)
  mask = np.asarray(jax.random.bernoulli(key, 0.5, (ROWS // N, WIDTH)))
  np.testing.assert_array_equal(got, np.broadcast_to(mask.astype(np.int32), got.shape))


def test_a_closed_over_key_warns_that_every_device_draws_alike():
  m = _auto()
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  with jax.set_mesh(m):
    p = jax.device_put({"w": jnp.ones((4, WIDTH))}, NamedSharding(m, P()))
    x = jax.device_put(np.ones((ROWS, 4), np.float32), NamedSharding(m, P("data")))

    def step(p, x, key):
      rng = jax.random.fold_in(key, 1)   # traced: the loss closes over it
      return z1.value_and_grad(lambda q, b: dropout_loss(q, b, rng), tx,
                               has_aux=True)(p, x)

    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      jax.jit(step)(p, x, jax.random.key(0))
  assert any("closes over a PRNG key" in str(w.message) for w in seen)


def test_a_scalar_in_the_batch_is_refused_with_the_fix():
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  with jax.set_mesh(mesh(N)):
    p = {"w": jnp.ones((4,))}
    batch = {"x": jnp.ones((ROWS, 4)), "scale": jnp.asarray(2.0)}
    f = z1.value_and_grad(lambda q, b: jnp.mean(b["x"] @ q["w"]) * b["scale"], tx)
    with pytest.raises(ValueError, match=r"argument 1\['scale'\] is a scalar.*"
                       r"outside batch_argnums"):
      jax.jit(f)(p, batch)


def _closure_case():
  m = mesh(N)   # Explicit axes
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  with jax.set_mesh(m):
    p = jax.device_put({"w": jnp.ones((4,))}, NamedSharding(m, P()))
    weights = jax.device_put(jnp.arange(1.0, 5.0), NamedSharding(m, P()))
    x = jax.device_put(np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4) / 10,
                       NamedSharding(m, P("data")))
  return m, tx, p, weights, x


def test_a_concrete_array_closed_over_on_an_explicit_mesh_is_moved_off_it():
  """A closure cell holding an array placed on the Explicit mesh (class
  weights, a frozen table): shard_map refuses it, zero1 moves it off the
  mesh; the loss is jax.value_and_grad's."""
  m, tx, p, weights, x = _closure_case()

  def make(w):
    return lambda q, xb: jnp.mean(((xb * w) @ q["w"]) ** 2)

  loss = make(weights)
  with jax.set_mesh(m):
    want, g_want = jax.jit(jax.value_and_grad(loss))(p, x)
    got, g = jax.jit(z1.value_and_grad(loss, tx))(p, x)
  np.testing.assert_allclose(got, want, rtol=FP32_REORDER)
  np.testing.assert_allclose(np.asarray(g["w"]), g_want["w"], rtol=FP32_REORDER)


def test_a_traced_array_closed_over_on_an_explicit_mesh_is_refused_with_the_fix():
  m, tx, p, weights, x = _closure_case()

  def step(p, x, w):
    return z1.value_and_grad(lambda q, xb: jnp.mean((xb * w) @ q["w"]), tx)(p, x)

  with jax.set_mesh(m), pytest.raises(
      ValueError, match=r"closes over an array of shape \(4,\) \(float32\), a "
      r"value of the jit being traced.*Pass it to fun as an argument"):
    jax.jit(step)(p, x, weights)
  # the fix it names: the array as an argument outside the batch
  with jax.set_mesh(m):
    f = z1.value_and_grad(lambda q, xb, w: jnp.mean((xb * w) @ q["w"]), tx)
    got, _ = jax.jit(f)(p, x, weights)
    want = jnp.mean((x * weights) @ p["w"])
  np.testing.assert_allclose(got, want, rtol=FP32_REORDER)


def test_zero1_built_inside_the_jit_on_an_explicit_mesh_is_refused_with_the_fix():
  """``optax.inject_hyperparams(lambda lr: z1.zero1(...))``: the traced
  learning rate would be closed over by zero1's shard_map."""
  m = mesh(N)
  with jax.set_mesh(m):
    p = jax.device_put({"w": jnp.ones((16,))}, NamedSharding(m, P()))
    tx = optax.inject_hyperparams(lambda learning_rate: z1.zero1(
        optax.adam(learning_rate), axis_name="data"))(learning_rate=1e-2)
    with pytest.raises(ValueError, match=r"built inside the jitted step.*"
                       r"z1\.zero1\(optax\.inject_hyperparams"):
      state = jax.jit(tx.init)(p)
      jax.jit(tx.update)(p, state, p)


def test_a_weighted_mean_over_the_batch_as_the_docs_write_it():
  """docs/flax_programs.md: the devices' means average to the global
  weighted mean when each returns n x its weighted sum / the whole batch's
  weight (an argument); each device's own weighted mean does not, with
  uneven weights."""
  r = np.random.default_rng(0)
  x, y = r.normal(size=(ROWS, 4)).astype(np.float32), r.normal(size=ROWS).astype(np.float32)
  w = np.array([1, 1, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1], np.float32)
  per = lambda p, b: (b["x"] @ p["w"] - b["y"]) ** 2
  own_mean = lambda p, b: jnp.sum(b["w"] * per(p, b)) / jnp.sum(b["w"])
  share = lambda p, b, total: N * jnp.sum(b["w"] * per(p, b)) / total
  m = mesh(N)
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  with jax.set_mesh(m):
    p = jax.device_put({"w": jnp.linspace(-1.0, 1.0, 4)}, NamedSharding(m, P()))
    b = jax.device_put({"x": x, "y": y, "w": w}, NamedSharding(m, P("data")))
    want, g_want = jax.jit(jax.value_and_grad(own_mean))(p, b)
    got, g = jax.jit(z1.value_and_grad(share, tx))(p, b, jnp.sum(b["w"]))
    off, _ = jax.jit(z1.value_and_grad(own_mean, tx))(p, b)
  np.testing.assert_allclose(got, want, rtol=FP32_REORDER)
  np.testing.assert_allclose(np.asarray(g["w"]), g_want["w"], rtol=FP32_REORDER,
                             atol=FP32_REORDER * float(np.abs(g_want["w"]).max()))
  assert abs(float(off) - float(want)) > 1e-3 * abs(float(want))


def test_a_batch_left_out_of_batch_argnums_is_named():
  """``f(params, x, y)`` with the default ``batch_argnums=(1,)``: ``y``
  placed split over the data axis is refused before anything runs; ``y``
  unplaced fails in the loss (x split, y whole), and the error says which
  argument has the batch's rows and the batch_argnums that take it."""
  m = mesh(N)
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  loss = lambda q, x, y: jnp.mean((x @ q["w"] - y) ** 2)
  with jax.set_mesh(m):
    p = jax.device_put({"w": jnp.ones((4,))}, NamedSharding(m, P()))
    x, y = jax.device_put((np.ones((ROWS, 4), np.float32), np.zeros(ROWS, np.float32)),
                          NamedSharding(m, P("data")))
    f = jax.jit(z1.value_and_grad(loss, tx))
    with pytest.raises(ValueError, match=r"argument 2 is split over the data "
                       r"axis.*batch_argnums=\(1, 2\)"):
      f(p, x, y)
    with pytest.raises(TypeError) as e:
      f(p, x, np.zeros(ROWS, np.float32))
    assert any("batch_argnums=(1, 2)" in note for note in e.value.__notes__)
    got, _ = jax.jit(z1.value_and_grad(loss, tx, batch_argnums=(1, 2)))(p, x, y)
  np.testing.assert_allclose(got, jnp.mean((x @ p["w"] - y) ** 2), rtol=FP32_REORDER)


def test_params_computed_from_the_sharded_gradients_are_refused_with_the_fix():
  """A wrapper's step built from z1.value_and_grad's gradients (sharded over
  the data axis), as optax.contrib.sam's adversarial step is: the params
  come out so sharded, and the refusal says how to bring them back."""
  m = mesh(N)
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  loss = lambda q, x: jnp.mean((x @ q["w"]) ** 2)
  with jax.set_mesh(m):
    p = jax.device_put({"w": jnp.ones((16,))}, NamedSharding(m, P()))
    x = jax.device_put(np.ones((ROWS, 16), np.float32), NamedSharding(m, P("data")))
    state = tx.init(p)

    @jax.jit
    def step(p, s, x):
      _, g = z1.value_and_grad(loss, tx)(p, x)
      p = jax.tree.map(lambda w, d: w + 0.01 * d, p, g)   # moved by the grads
      return tx.update(g, s, p)

    with pytest.raises(ValueError, match=r"reshard\(p, P\(\)\)"):
      step(p, state, x)

    @jax.jit
    def fixed(p, s, x):
      _, g = z1.value_and_grad(loss, tx)(p, x)
      p = jax.tree.map(lambda w, d: w + 0.01 * d, p, g)
      p = jax.sharding.reshard(p, P())   # the fix the refusal names
      return optax.apply_updates(p, tx.update(g, s, p)[0])

    g = 2 * 16.0   # d/dw_j of mean((x @ w)^2) at w = 1, x = 1: 2 * (x @ w) * x_j
    want = p["w"] + 0.01 * g - 0.1 * g   # the wrapper's move, then sgd(0.1)
    np.testing.assert_allclose(fixed(p, state, x)["w"], want, rtol=FP32_REORDER)



def test_flax_dropout_runs_on_an_explicit_mesh():
  """flax's ``nn.Dropout`` types its mask whole while its input is split on
  an Explicit data axis, so jax.value_and_grad's trace refuses the select;
  z1.value_and_grad runs the loss per device (and traces it for its checks
  without the batch's placement): the same loss as on an Auto mesh."""
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x)))

  model = Net()
  loss = lambda p, x, rng: jnp.mean(
      model.apply({"params": p}, x, rngs={"dropout": rng}) ** 2)
  params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
  x = np.random.default_rng(0).normal(size=(ROWS, 4)).astype(np.float32)
  losses = []
  for m in (mesh(N), _auto()):
    tx = z1.zero1(optax.sgd(0.1), axis_name="data")
    with jax.set_mesh(m):
      xs = jax.device_put(x, NamedSharding(m, P("data")))
      if m.axis_types[0] == AxisType.Explicit:
        with pytest.raises(Exception, match="select"):
          jax.jit(jax.value_and_grad(loss))(params, xs, jax.random.key(1))
      value, _ = jax.jit(z1.value_and_grad(loss, tx))(params, xs, jax.random.key(1))
    losses.append(float(value))
  np.testing.assert_allclose(losses[0], losses[1], rtol=FP32_REORDER)
