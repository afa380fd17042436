"""zero1 in the user's jit adds no effect to the step, so jax keeps its C++ dispatch.

An executable with any effect (a debug callback, or
``jax.debug.inspect_array_sharding``'s read of the placement XLA chose,
which only runs at compile time) is called through Python on every step,
checking each argument's sharding and layout. On one H200 (BERT-base, 574
arguments; experiments/gpu/measure.py) that made ``z1.zero1`` in plain jit
13.7 ms a step against 9.0 for ``z1.train_step``, with the same kernels.
zero1's compile-time placement check reads the placement through
core/seen_sharding.py's effect-free primitive instead; the warning it gives
is tested in tests/test_derived_shardings.py (it fails if the read never
happens). The check for a state restored new mid-run (core/fresh_state.py)
runs where a flax TrainState / nnx.Optimizer step is traced, not in it;
its warnings are tested in tests/test_migration.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zero1_jax as z1


def loss(p, b):
  return jnp.mean(jnp.square(jnp.tanh(b["x"] @ p["w"]) @ p["v"] - b["y"]))


def _program(form: str, kind):
  """(step, params, state, batch) on 8 devices; the state is sharded (each
  leaf's rows divide by 8), so the placement check reads every leaf."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
  r = np.random.default_rng(0)
  rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = {"w": jax.device_put(r.normal(size=(64, 32)).astype(np.float32), rep),
            "v": jax.device_put(r.normal(size=(32, 8)).astype(np.float32), rep)}
  batch = {k: jax.device_put(r.normal(size=(16, d)).astype(np.float32), rows)
           for k, d in (("x", 64), ("y", 8))}
  tx = (z1.zero2 if form == "zero2" else z1.zero1)(
      optax.adamw(1e-3), axis_name="data", mesh=mesh)
  with jax.set_mesh(mesh):
    state = tx.init(params)
  grad = jax.value_and_grad if form == "jax.value_and_grad" else (
      lambda f: z1.value_and_grad(f, tx))   # zero2's gradients: from its hooks

  def step(p, s, b):
    value, g = grad(loss)(p, b)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, value
  return mesh, step, params, state, batch


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("form", ["jax.value_and_grad", "z1.value_and_grad", "zero2"])
def test_the_users_jit_step_has_no_effect(form, kind):
  mesh, step, params, state, batch = _program(form, kind)
  with jax.set_mesh(mesh):
    jaxpr = jax.make_jaxpr(step)(params, state, batch)
    assert not jaxpr.effects, (form, kind, jaxpr.effects)
    compiled = jax.jit(step).lower(params, state, batch).compile()
  # What jax's C++ dispatch asks of the executable (pxla.py's create_cpp_call);
  # private, so read only where this jax has it.
  call = getattr(getattr(compiled, "_executable", None), "unsafe_call", None)
  if call is not None and hasattr(call, "has_unordered_effects"):
    assert not call.has_unordered_effects and not call.has_host_callbacks


def test_the_placement_is_still_read_when_the_step_compiles():
  """The effect-free read still calls back with the placement XLA chose:
  once per state leaf, on an Auto mesh, at compile time only."""
  from zero1_jax.core import seen_sharding
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  seen = []
  f = jax.jit(lambda x: seen_sharding.inspect(x, seen.append, (("data", 8),)) + 1,
              in_shardings=NamedSharding(mesh, P("data")))
  x = jnp.zeros((16, 4))
  assert f(x).shape == (16, 4) and len(seen) == 1
  assert seen[0].spec == P("data") and seen[0].shard_shape((16, 4)) == (2, 4)
  f(x)
  assert len(seen) == 1   # cached: no run-time call


@pytest.mark.parametrize("spec", [P("data"), P(None, "model"), P(("data", "model")),
                                  P()])
def test_the_placement_read_without_devices_gives_jaxs_shard_shape(spec):
  """Where the program has no device list (the read no longer asks for
  one), the partitioner's answer is read from its tiles: the shard shape
  and spec jax's own NamedSharding gives, partial replication included."""
  from zero1_jax.core import seen_sharding
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  want = NamedSharding(mesh, spec)
  seen = seen_sharding._read(want._to_xla_hlo_sharding(2),
                             (("data", 4), ("model", 2)))
  assert seen.shard_shape((16, 6)) == want.shard_shape((16, 6))
  assert seen.spec == spec


def _no_host_callback(compiled):
  call = getattr(getattr(compiled, "_executable", None), "unsafe_call", None)
  if call is not None and hasattr(call, "has_host_callbacks"):
    assert not call.has_unordered_effects and not call.has_host_callbacks


@pytest.mark.parametrize("owner", ["flax TrainState", "nnx.Optimizer"])
def test_a_train_state_step_has_no_effect(owner):
  """flax's TrainState and nnx.Optimizer with zero1: the check for a state
  restored new (core/fresh_state.py) runs where the step is traced, on the
  host; the compiled step has no callback. A callback under lax.cond there
  made BERT-base's step 21.9 ms on an H200 against 10.4 without
  (experiments/results/gpu/measured_fix.jsonl)."""
  from flax import nnx
  from flax.training import train_state
  mesh, _, params, _, batch = _program("z1.value_and_grad", AxisType.Auto)
  tx = z1.zero1(optax.adamw(1e-3), axis_name="data", mesh=mesh)
  with jax.set_mesh(mesh):
    if owner == "flax TrainState":
      state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
      step = lambda s, b: s.apply_gradients(grads=jax.grad(loss)(s.params, b))
    else:
      class Model(nnx.Module):
        def __init__(self):
          self.w = nnx.Param(params["w"])
          self.v = nnx.Param(params["v"])
      model = Model()
      graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

      def step(s, b):
        m, o = nnx.merge(graphdef, s)
        o.update(m, nnx.grad(lambda m: loss({"w": m.w[...], "v": m.v[...]}, b))(m))
        return nnx.state((m, o))
    jaxpr = jax.make_jaxpr(step)(state, batch)
    assert not jaxpr.effects, (owner, jaxpr.effects)
    _no_host_callback(jax.jit(step).lower(state, batch).compile())
