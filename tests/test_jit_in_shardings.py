"""A jit whose ``in_shardings`` give zero1's state another placement (JAX's
distributed-arrays tutorial style: params and state given ``P()``): zero1's
error, naming the fix, comes instead of JAX's "Sharding passed to jit does
not match the sharding on the respective arg", on Auto and Explicit axes;
and at the first call where ``out_shardings`` alone give it ``P()`` (JAX
would refuse the second).
Shardings taken from the state itself run, and train as optax does.

Weights bound: two Adam steps on a 16 x 4 linear model in float32. zero1
and optax differ in the order of the gradient sum over the 8 devices (each
device's partial sum, then 8 terms: at most 7 more roundings of magnitude
<= u = 2^-24 relative), which Adam's m / sqrt(v) carries to the update at
about that relative size (these gradients are far from zero: no
amplification): <= lr · 8 · u · 4 a step (4: the sqrt's and division's
roundings, other CPUs' reassociation). Where the two updates differ at all,
w - lr · update may round to adjacent floats: one ulp of w, <= 2^-23 · |w|.
Adam's next update hardly depends on w, so the differences add up over the
steps: |Δw| <= STEPS · (2^-23 · max|w| + lr · 8 · u · 4).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zero1_jax as z1

LR, STEPS, N = 1e-2, 2, 8


def _atol(w):
  return STEPS * (2.0 ** -23 * float(np.max(np.abs(w))) + LR * N * 2.0 ** -24 * 4)


def _program(kind):
  mesh = jax.make_mesh((N,), ("data",), axis_types=(kind,))
  rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w": jax.device_put(jax.random.normal(k1, (16, 4)), rep),
            "b": jax.device_put(jnp.zeros(4), rep)}
  x = jax.device_put(jax.random.normal(k2, (N, 16)), rows)

  def make(tx):
    def step(p, s, x):
      g = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(p)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    return step
  return mesh, rep, rows, params, x, make


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_state_given_p_in_in_shardings_is_named_by_zero1(kind):
  mesh, rep, rows, params, x, make = _program(kind)
  tx = z1.zero1(optax.adam(LR), axis_name="data", mesh=mesh)
  state = tx.init(params)
  step = jax.jit(make(tx), in_shardings=(rep, rep, rows),
                 out_shardings=(rep, rep))
  with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
    step(params, state, x)
  msg = str(e.value)
  assert msg.startswith("zero1: this jit's in_shardings give zero1's "
                        "optimizer state"), msg
  assert "in_shardings P(), the array P('data'" in msg, msg
  assert "jax.tree.map(lambda x: x.sharding, opt_state)" in msg, msg
  assert "args[1]" in msg, msg   # which argument: the step's second


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_state_shardings_from_the_state_train_as_optax(kind):
  """The fix the error names: the state's own shardings, in and out."""
  mesh, rep, rows, params, x, make = _program(kind)
  tx = z1.zero1(optax.adam(LR), axis_name="data", mesh=mesh)
  state = tx.init(params)
  sh = jax.tree.map(lambda a: a.sharding, state)
  step = jax.jit(make(tx), in_shardings=(rep, sh, rows), out_shardings=(rep, sh))
  ref_tx = optax.adam(LR)
  ref = jax.jit(make(ref_tx))
  p, s, q, r = params, state, params, ref_tx.init(params)
  with jax.set_mesh(mesh):
    for _ in range(STEPS):
      p, s = step(p, s, x)
      q, r = ref(q, r, x)
  for k in p:
    np.testing.assert_allclose(p[k], q[k], rtol=0, atol=_atol(q[k]))
  mu = jax.tree.leaves(s.inner[0].mu["w"])[0]   # in a flax box once flax is imported
  assert mu.sharding.shard_shape(mu.shape)[0] * N == mu.shape[0]   # 1/N kept


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_state_given_p_in_out_shardings_only_is_named_at_the_first_call(kind):
  """in_shardings the state's own, out_shardings P(): the first call would
  run and return the state whole on every device, and JAX would refuse the
  second (on Auto axes reusing the first trace, so nothing of zero1 runs
  before its error). zero1 refuses the first call, naming the fix."""
  mesh, rep, rows, params, x, make = _program(kind)
  tx = z1.zero1(optax.adam(LR), axis_name="data", mesh=mesh)
  state = tx.init(params)
  sh = jax.tree.map(lambda a: a.sharding, state)
  step = jax.jit(make(tx), in_shardings=(rep, sh, rows), out_shardings=(rep, rep))
  with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
    step(params, state, x)
  msg = str(e.value)
  assert msg.startswith("zero1: this jit's out_shardings give zero1's "
                        "optimizer state"), msg
  assert "in_shardings P('data'" in msg and "only P()" in msg, msg
  assert "jax.tree.map(lambda x: x.sharding, opt_state)" in msg, msg
  assert "args[1]" in msg, msg


@pytest.mark.parametrize("out", ["state's own", "None"])
def test_out_shardings_that_may_keep_the_placement_run(out):
  """No refusal unless the state can only come out placed otherwise: its
  own shardings, or an unspecified entry (jit keeps what the step
  computes), run twice."""
  mesh, rep, rows, params, x, make = _program(AxisType.Auto)
  tx = z1.zero1(optax.adam(LR), axis_name="data", mesh=mesh)
  state = tx.init(params)
  sh = jax.tree.map(lambda a: a.sharding, state)
  entry = {"state's own": sh, "None": None}[out]
  step = jax.jit(make(tx), in_shardings=(rep, sh, rows),
                 out_shardings=(rep, entry))
  p, s = params, state
  with jax.set_mesh(mesh):
    for _ in range(2):
      p, s = step(p, s, x)
  mu = jax.tree.leaves(s.inner[0].mu["w"])[0]
  assert mu.sharding.shard_shape(mu.shape)[0] * N == mu.shape[0]


def test_other_arguments_mismatched_are_left_to_jax():
  """Only the state is zero1's to name: a batch given the wrong in_shardings
  gets JAX's own error."""
  mesh, rep, rows, params, x, make = _program(AxisType.Auto)
  tx = z1.zero1(optax.adam(LR), axis_name="data", mesh=mesh)
  state = tx.init(params)
  sh = jax.tree.map(lambda a: a.sharding, state)
  step = jax.jit(make(tx), in_shardings=(rep, sh, rows))
  with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
    step(params, state, jax.device_put(x, rep))
  assert "Sharding passed to jit does not match" in str(e.value)
  assert "zero1" not in str(e.value)


def test_a_batch_on_a_mesh_of_its_own_trains_as_optax():
  """big_vision places its batch on ``Mesh(devices, ("devices",))`` and its
  train state on a mesh of its config, over the same devices. optax runs
  there; zero1's read of the state's placement made jax require one mesh
  for the whole program ("mesh should be the same across the entire
  program"). It runs now, as optax does, and the read still warns of a
  state placed whole."""
  mesh, rep, rows, params, _, make = _program(AxisType.Auto)
  other = jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (N, 16)),
                     NamedSharding(other, P("devices")))
  tx = z1.zero1(optax.adam(LR), axis_name="data", mesh=mesh)
  step, ref = jax.jit(make(tx)), jax.jit(make(optax.adam(LR)))
  p, s, q, r = params, tx.init(params), params, optax.adam(LR).init(params)
  for _ in range(STEPS):
    p, s = step(p, s, x)
    q, r = ref(q, r, x)
  for k in p:
    np.testing.assert_allclose(p[k], q[k], rtol=0, atol=_atol(q[k]))
  whole = jax.device_put(tx.init(params), rep)
  with pytest.warns(UserWarning, match="places zero1's optimizer state other "
                    "than zero1 planned"):
    jax.jit(make(tx))(params, whole, x)
