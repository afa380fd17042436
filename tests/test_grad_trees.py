"""What ``z1.value_and_grad`` takes and gives besides the params' arrays:
non-array arguments (an Equinox model's static part), a closed-over batch
(warned), and gradients that tree-maps read and build on.

Tolerances: FP32_REORDER (tests/tolerances.py): the reduce-scatter sums the
devices' gradients in another order than jit's all-reduce; a global norm or
mean over them is a scalar in another order: FP32_SCALAR_REORDER. A wrong
1/N or a padded element counted moves them by >= 1/8 relative.
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zero1_jax as z1
from helpers import assert_close
from tolerances import FP32_REORDER, FP32_SCALAR_REORDER

N = 8
CLOSED = "fun closes over an array"


def _mesh(kind=AxisType.Auto):
  return jax.make_mesh((N,), ("data",), axis_types=(kind,))


def _data(kind=AxisType.Auto, seed=0):
  r = np.random.default_rng(seed)
  return jax.device_put((r.normal(size=(16, 6)).astype(np.float32),
                         r.normal(size=(16, 3)).astype(np.float32)),
                        NamedSharding(_mesh(kind), P("data")))


def _mse(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _eqx_train(form, steps=3):
  """An Equinox loop; the gradients from eqx.filter_value_and_grad or from
  z1.value_and_grad on eqx.partition's (arrays, static part)."""
  model = eqx.nn.MLP(6, 3, width_size=13, depth=1, key=jax.random.key(0))
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", mesh=_mesh())
  state = tx.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def step(model, state, x, y):
    diff, static = eqx.partition(model, eqx.is_inexact_array)
    if form == "zero1":
      value, grads = z1.value_and_grad(
          lambda d, s, x, y: _mse(eqx.combine(d, s), x, y), tx,
          batch_argnums=(2, 3))(diff, static, x, y)
    else:
      value, grads = eqx.filter_value_and_grad(_mse)(model, x, y)
    updates, state = tx.update(grads, state, diff)
    return eqx.apply_updates(model, updates), state, value

  for i in range(steps):
    model, state, value = step(model, state, *_data(seed=i))
  return eqx.filter(model, eqx.is_array), float(value)


def test_equinox_static_part_as_an_argument():
  """The static part (the MLP's activation functions) is not an array:
  jax.value_and_grad takes it, and so does z1.value_and_grad."""
  got, v = _eqx_train("zero1")
  want, w = _eqx_train("eqx")
  assert_close(jax.tree.leaves(got), jax.tree.leaves(want), FP32_REORDER,
               "eqx static part ")
  assert abs(v - w) <= FP32_SCALAR_REORDER * abs(w)


def _params():
  r = np.random.default_rng(1)
  return {"w": jnp.asarray(r.normal(size=(6, 3)), jnp.float32),
          "b": jnp.asarray(r.normal(size=3), jnp.float32)}   # 3: padded to 8


def _loss(p, x, y):
  return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_closed_over_batch_is_warned(kind):
  """nanodo writes its loss closing over the batch: every device would run
  the whole batch. Warned when the step compiles (Auto); on an Explicit
  axis, where shard_map refuses to close over it, refused with the same
  fix. A closed-over array on one device is not warned."""
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  x, y = _data(kind)
  scale = jnp.full(3, 0.5)    # on one device: nothing to say
  with jax.set_mesh(_mesh(kind)):
    params = _params()
    step = jax.jit(lambda p, x, y: z1.value_and_grad(
        lambda q: _loss(q, x, y), tx)(p)[0])
    if kind == AxisType.Explicit:   # shard_map refuses it: zero1 says why first
      with pytest.raises(ValueError, match=CLOSED) as e:
        step(params, x, y)
      msg = str(e.value)
    else:
      with pytest.warns(UserWarning, match=CLOSED) as w:
        step(params, x, y)
      msg = next(str(m.message) for m in w if CLOSED in str(m.message))
    assert "(16, 6)" in msg and "Pass it as an argument" in msg, msg
    ok = jax.jit(lambda p, x, y: z1.value_and_grad(
        lambda q, x, y: _loss(q, x, y) * jnp.sum(scale), tx,
        batch_argnums=(1, 2))(p, x, y)[0])
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      ok(params, x, y)


@pytest.fixture(scope="module")
def grads_both():
  """z1.value_and_grad's and jax.value_and_grad's gradients of one batch,
  and what tree-maps over them give."""
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  x, y = _data()
  with jax.set_mesh(_mesh()):
    params = _params()

    def stats(p, x, y, form):
      if form == "zero1":
        _, g = z1.value_and_grad(_loss, tx, batch_argnums=(1, 2))(p, x, y)
      else:
        _, g = jax.value_and_grad(_loss)(p, x, y)
      total = sum(jnp.sum(v) for v in jax.tree.leaves(g))
      size = sum(v.size for v in jax.tree.leaves(g))
      return {"norm": optax.tree.norm(g), "mean": total / size,
              "g_plus_p": jax.tree.map(lambda a, b: a + b, g, p), "g": g}
    return {f: jax.jit(stats, static_argnums=3)(params, x, y, f)
            for f in ("zero1", "jax")}


def test_tree_maps_over_the_gradients_see_jax_s(grads_both):
  """A tree like the params with jax's values: a global norm and a mean
  over all elements are jax's (the padding is not in them), and
  jax.tree.map(f, grads, params) works."""
  got, want = grads_both["zero1"], grads_both["jax"]
  for k in ("norm", "mean"):
    assert abs(float(got[k]) - float(want[k])) <= \
        FP32_SCALAR_REORDER * abs(float(want[k])), k
  assert_close(got["g_plus_p"], want["g_plus_p"], FP32_REORDER, "g + p ")
  assert got["g"]["b"].shape == (3,)


def test_gradients_built_from_them_update_as_jax_s():
  """Gradients made from z1.value_and_grad's by a tree-map (here halved, as
  an accumulation loop divides) are new arrays: tx.update takes them as
  jax.grad's. Same update as halving jax.value_and_grad's."""
  tx = z1.zero1(optax.sgd(1.0), axis_name="data")
  x, y = _data()
  with jax.set_mesh(_mesh()):
    params = _params()
    state = tx.init(params)

    def step(p, s, x, y, form):
      if form == "zero1":
        _, g = z1.value_and_grad(_loss, tx, batch_argnums=(1, 2))(p, x, y)
      else:
        _, g = jax.value_and_grad(_loss)(p, x, y)
      return tx.update(jax.tree.map(lambda v: v / 2, g), s, p)[0]

    got, want = (jax.jit(step, static_argnums=4)(params, state, x, y, f)
                 for f in ("zero1", "jax"))
  assert_close(got, want, FP32_REORDER, "halved grads ")
