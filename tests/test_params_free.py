"""``tx.update(grads, state)`` without params, as optax's ``update`` takes it
for an optimizer that never reads them (Equinox's parallelism example and
optax's own examples call ``optimizer.update(grads, opt_state)``):

* float32 params: the same program as with params, to the bit, moving the
  same collectives; the state 1/N;
* an inner optimizer that reads params (adamw's weight decay): optax's own
  error, as optax raises it;
* bf16 params (a stored fp32 master; the update is new - params): zero1
  says params are needed, naming the leaf.

Same-program claim, bitwise: without params the gradients stand in for
them in the plan and the inner optimizer is handed None; the update zero1
returns for a float32 param is the inner ``u`` either way, so nothing
differs but data the compiled program drops.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zero1_jax as z1

N, STEPS = 8, 3


def _program(kind, vg):
  mesh = jax.make_mesh((N,), ("data",), axis_types=(kind,))
  rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  r = np.random.default_rng(0)
  params = jax.device_put({"w": r.normal(size=(12, 5)).astype(np.float32),
                           "b": np.zeros(5, np.float32)}, rep)
  x = jax.device_put(r.normal(size=(16, 12)).astype(np.float32), rows)
  loss = lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2)

  def make(tx, with_params):
    def step(p, s, x):
      g = (z1.value_and_grad(loss, tx)(p, x)[1] if vg
           else jax.grad(loss)(p, x))
      u, s = tx.update(g, s, p) if with_params else tx.update(g, s)
      return optax.apply_updates(p, u), s
    return jax.jit(step)
  return mesh, params, x, make


@pytest.mark.parametrize("vg", [False, True], ids=["jax.grad", "z1.value_and_grad"])
@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_update_without_params_is_the_update_with_them(kind, vg):
  mesh, params, x, make = _program(kind, vg)
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh)
  state = tx.init(params)
  runs = {}
  with jax.set_mesh(mesh):
    for given in (True, False):
      step, p, s = make(tx, given), params, state
      colls = z1.inspect.collectives(step, p, s, x)
      for _ in range(STEPS):
        p, s = step(p, s, x)
      runs[given] = p, s, colls
  (p1, s1, c1), (p0, s0, c0) = runs[True], runs[False]
  for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p0, s0))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert c0 == c1, (c0, c1)
  mu = jax.tree.leaves(s0.inner[0].mu["w"])[0]
  assert mu.sharding.shard_shape(mu.shape)[0] * N == mu.shape[0]   # 1/N kept
  assert float(jnp.max(jnp.abs(p0["w"] - params["w"]))) > 0   # it trained


def _optax_error() -> str:
  """optax's own error for adamw updated without params, read from optax."""
  tx, p = optax.adamw(1e-2), {"w": jnp.ones(2)}
  with pytest.raises(ValueError) as e:
    tx.update(p, tx.init(p))
  return str(e.value)


def test_an_inner_optimizer_that_reads_params_raises_optax_error():
  mesh, params, x, make = _program(AxisType.Auto, False)
  tx = z1.zero1(optax.adamw(1e-2), axis_name="data", mesh=mesh)
  state = tx.init(params)
  with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
    make(tx, False)(params, state, x)
  assert str(e.value) == _optax_error(), str(e.value)


def test_params_with_a_stored_master_are_asked_for():
  mesh, params, x, make = _program(AxisType.Auto, False)
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh)
  state = tx.init(params)
  with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
    make(tx, False)(params, state, x.astype(jnp.bfloat16))
  msg = str(e.value)
  assert msg.startswith("zero1: update needs params here: "
                        "tx.update(grads, state, params)."), msg
  assert "grads['b'] is bfloat16: its param keeps a float32 master" in msg, msg


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_a_2d_mesh_without_params_is_the_update_with_them(kind):
  """Params split over a "model" axis too: the gradients standing in carry
  that placement, so the plan and the program are those with params."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))
  r = np.random.default_rng(0)
  params = {"w": jax.device_put(r.normal(size=(12, 6)).astype(np.float32),
                                NamedSharding(mesh, P(None, "model"))),
            "b": jax.device_put(np.zeros(6, np.float32),
                                NamedSharding(mesh, P("model")))}
  x = jax.device_put(r.normal(size=(16, 12)).astype(np.float32),
                     NamedSharding(mesh, P("data")))
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh)

  def run(given):
    def step(p, s):
      g = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(p)
      u, s = tx.update(g, s, p) if given else tx.update(g, s)
      return optax.apply_updates(p, u), s
    step, p = jax.jit(step), params
    with jax.set_mesh(mesh):
      s = tx.init(params)
      for _ in range(STEPS):
        p, s = step(p, s)
    return p, s
  for a, b in zip(jax.tree.leaves(run(True)), jax.tree.leaves(run(False))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
