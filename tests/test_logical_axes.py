"""Plain-jit mode with the params' metadata: logical axis rules, size-1
Explicit axes, abstract init before the mesh, and the wrong-axis message."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zero1_jax as z1
from helpers import assert_close

RULES = (("batch", "data"), ("vocab", "model"), ("embed", None))


def boxed():
  r = np.random.default_rng(0)
  return {"emb": nn.LogicallyPartitioned(
      jnp.asarray(r.normal(size=(8, 6)), jnp.float32), ("vocab", "embed"))}


def auto_mesh():
  return jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(AxisType.Auto,) * 2)


def _mu(state):
  return state.inner[0].mu["emb"]


@pytest.mark.parametrize("how", ["context", "keyword"])
def test_logical_names_mapped_by_the_rules(how):
  """'vocab' -> 'model' under the rules: the state is split over model and
  data (1/8 of the leaf per device), its box maps back to that spec."""
  mesh = auto_mesh()
  kw = {"logical_axis_rules": RULES} if how == "keyword" else {}
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", **kw)
  with jax.set_mesh(mesh):
    if how == "context":
      with nn.logical_axis_rules(RULES):
        state = tx.init(boxed())
    else:
      state = tx.init(boxed())
  mu = _mu(state)
  assert isinstance(mu, nn.LogicallyPartitioned)
  assert mu.value.sharding.spec == P("model", "data"), mu.value.sharding
  assert mu.value.addressable_shards[0].data.size * 8 == mu.value.size
  assert nn.logical_to_mesh_axes(mu.names, RULES) == P("model", "data")


def test_logical_names_without_rules_error_names_the_rules():
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  with jax.set_mesh(auto_mesh()):
    with pytest.raises(ValueError, match=r"'vocab' is not a mesh axis.*"
                       r"logical_axis_rules=rules.*nn\.logical_axis_rules"):
      tx.init(boxed())


def test_logical_params_train_as_optax_in_jit():
  """Boxed params, boxed grads, boxed state through one jitted update: the
  weights optax gives (one step, same elementwise ops on jit's reduced
  gradient: <= 9 roundings of the weights' scale, x4 headroom: 36 u)."""
  mesh = auto_mesh()
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", logical_axis_rules=RULES)
  loss = lambda p: jnp.sum(jnp.sin(nn.meta.unbox(p)["emb"]))
  with jax.set_mesh(mesh):
    params = boxed()
    state = tx.init(params)
    step = jax.jit(lambda p, s: tx.update(jax.grad(loss)(p), s, p))
    updates, state = step(params, state)
  ref = optax.adam(1e-2)
  p0 = nn.meta.unbox(boxed())
  ru, _ = ref.update(nn.meta.unbox(jax.grad(loss)(boxed())), ref.init(p0), p0)
  assert isinstance(updates["emb"], nn.LogicallyPartitioned)
  # Compared as weights: zero1's update is new - old weights, so it carries
  # the rounding of the new weight (an ulp of |w|, not of |u|).
  assert_close(optax.apply_updates(p0, nn.meta.unbox(updates)),
               optax.apply_updates(p0, ru), 36 * 2.0 ** -24, "boxed step ")
  assert isinstance(_mu(state), nn.LogicallyPartitioned)


def test_size1_explicit_axis_in_spec():
  """P('tensor', None) with tensor of size 1 on an Explicit mesh: init and a
  jitted update run, the update typed like the param."""
  mesh = jax.make_mesh((8, 1), ("data", "tensor"),
                       axis_types=(AxisType.Explicit,) * 2)
  tx = z1.zero1(optax.sgd(0.5), axis_name="data")
  with jax.set_mesh(mesh):
    w = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("tensor", None)))
    params = {"w": w, "b": jnp.zeros(4)}
    state = tx.init(params)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(p["w"]) + jnp.sum(p["b"])))(params)
    updates, _ = jax.jit(tx.update)(grads, state, params)
  assert jax.typeof(updates["w"]).sharding.spec == P("tensor", None)
  np.testing.assert_array_equal(np.asarray(updates["w"]), -0.5)


def test_eval_shape_before_the_mesh_with_mesh_keyword():
  mesh = jax.make_mesh((8,), ("data",))
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh)
  out = jax.eval_shape(tx.init, {"w": jnp.ones((13, 4))})
  assert out.inner[0].mu["w"].shape == (16, 4)   # padded to a multiple of 8
  with jax.set_mesh(mesh):
    state = tx.init({"w": jnp.ones((13, 4))})
  assert state.inner[0].mu["w"].shape == (16, 4)


def test_eval_shape_before_the_mesh_without_it_names_mesh_keyword():
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  with pytest.raises(ValueError, match=r"zero1\(\.\.\., mesh=mesh\)"):
    jax.eval_shape(tx.init, {"w": jnp.ones((13, 4))})


def test_wrong_axis_name_with_placed_params_says_not_in_mesh():
  mesh = jax.make_mesh((8,), ("data",))
  tx = z1.zero1(optax.adam(1e-2), axis_name="batch")
  w = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P()))
  with pytest.raises(ValueError, match=r"mesh has axes \('data',\), not "
                     r"'batch'") as e:
    jax.eval_shape(tx.init, {"w": w})
  assert "no mesh was found" not in str(e.value)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="not 'batch'"):
    tx.init({"w": jnp.ones((16, 4))})


def test_boxed_state_saved_with_checkpointer_restores(tmp_path):
  """tx.init boxes the state for linen params; z1's Checkpointer stores the
  values, so the checkpoint restores onto the plain template."""
  from zero1_jax.checkpoint import Checkpointer
  mesh = auto_mesh()
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", logical_axis_rules=RULES)
  with jax.set_mesh(mesh):
    state = tx.init(boxed())
  assert isinstance(_mu(state), nn.LogicallyPartitioned)
  # The params as the program holds them: 'vocab' -> 'model' placed.
  placed = {"emb": jax.device_put(boxed()["emb"].value,
                                  NamedSharding(mesh, P("model", None)))}
  ck = Checkpointer(str(tmp_path))
  ck.save(1, placed, state)
  ck.wait()
  _, got, _ = ck.restore(None, tx, placed, mesh)
  np.testing.assert_array_equal(np.asarray(got.inner[0].mu["emb"]),
                                np.asarray(_mu(state).value))
