"""Flax programs as users write them, with zero1 changing only the optimizer
line (experiments/examples/): optax's weights, 1/N of the optimizer state
per device, and a warning when the program places the state otherwise.

Weights bound: in plain-jit mode zero1 takes the gradient jit has already
reduced (the same all-reduce as the optax program), slices this device's
shard and runs the same elementwise Adam ops on it, so each step's update
differs from optax's only where XLA fuses those ops differently: at most
one rounding (2^-24 relative) per op of the chain (m, v, two bias
corrections, sqrt, +eps, divide, weight decay, apply) -> 9 u per step
relative to the weights' scale; over K steps 9 K u, and x4 headroom for
other CPUs' fusion choices: 36 K u (K = 6: 1.3e-5).
"""

import warnings

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from experiments.examples import linen_lm, nnx_lm
from helpers import assert_close, assert_equal

K = 6
RTOL = 36 * K * 2.0 ** -24
PLACED = "places zero1's optimizer state other than zero1 planned"


def opt_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def linen_mesh():
  return jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def linen_runs():
  mesh = linen_mesh()
  out = {}
  for use in (False, True):
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      state, step, shardings, data = linen_lm.setup(use, mesh)
      state, losses = linen_lm.train(state, step, data, mesh, K)
    out[use] = (state, step, shardings, data, [str(x.message) for x in w])
  return mesh, out


def _moments(opt_state):
  """The Adam mu/nu trees, wherever the optimizer keeps them."""
  return [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
      if isinstance(s, optax.ScaleByAdamState)]


@pytest.mark.slow   # builds and compiles the linen LM twice (~70 s)
def test_linen_lm_one_line_matches_optax_with_quarter_state(linen_runs):
  mesh, runs = linen_runs
  ref, got = runs[False][0], runs[True][0]
  assert_close(nn.meta.unbox(got.params), nn.meta.unbox(ref.params), RTOL,
               "linen LM vs optax ")
  assert not [m for m in runs[True][4] if "zero1" in m], runs[True][4]
  # Each moment leaf: device 0 holds 1/4 (data = 4) of the fraction of its
  # (padded) leaf that optax's holds (split over model, or not, alike).
  (mz,), (mo,) = _moments(got.opt_state), _moments(ref.opt_state)
  for z, o in zip(jax.tree.leaves(mz.mu), jax.tree.leaves(mo.mu)):
    zs, os_ = z.addressable_shards[0].data.size, o.addressable_shards[0].data.size
    assert zs * 4 * o.size == os_ * z.size, (z.shape, z.sharding, o.sharding)
  zb, ob = opt_bytes(got.opt_state), opt_bytes(ref.opt_state)
  # 1/4 of optax's (data = 4), plus padding to multiples of 4 and the
  # replicated scalars.
  assert zb * 4 <= ob * 1.05 + 4 * 64, (zb, ob)


@pytest.mark.slow   # builds and compiles the linen LM twice (~70 s)
def test_linen_lm_orbax_roundtrip_and_continue(linen_runs, tmp_path):
  mesh, runs = linen_runs
  state, step, shardings, data, _ = runs[True]
  restored = linen_lm.save_restore(state, shardings, str(tmp_path / "ck"))
  assert_equal(jax.tree.leaves(restored.opt_state),
               jax.tree.leaves(state.opt_state))
  for a, b in zip(jax.tree.leaves(restored.opt_state),
                  jax.tree.leaves(state.opt_state)):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
  # The restored state trains on as the saved one would.
  a, _ = linen_lm.train(restored, step, data, mesh, 1)
  b, _ = linen_lm.train(jax.tree.map(lambda x: x.copy(), state), step, data,
                        mesh, 1)
  assert_equal(nn.meta.unbox(a.params), nn.meta.unbox(b.params))


@pytest.mark.slow   # builds and compiles the linen LM twice (~70 s)
def test_linen_shardings_from_the_params_warn_with_bytes(linen_runs):
  """The program replicates zero1's state (its opt_state shardings all P()):
  the first step warns with the bytes per device and the fix."""
  mesh, runs = linen_runs
  state, _, shardings, data, _ = runs[True]
  rep = NamedSharding(mesh, P())
  bad = shardings.replace(opt_state=jax.tree.map(lambda _: rep,
                                                 shardings.opt_state))
  state = jax.device_put(state, bad)

  def train_step(state, tokens):
    grads = jax.grad(linen_lm.loss_fn)(state.params, state.apply_fn, tokens)
    return state.apply_gradients(grads=grads)

  step = jax.jit(train_step, in_shardings=(bad, data), out_shardings=bad)
  with pytest.warns(UserWarning, match=PLACED) as w:
    linen_lm.train(state, lambda s, t: (step(s, t), 0.0), data, mesh, 1)
  msg = next(str(x.message) for x in w if PLACED in str(x.message))
  held = opt_bytes(state.opt_state)
  planned = opt_bytes(runs[True][0].opt_state)
  # The measured totals exclude the scalar leaves (count: 4 B each).
  assert f"{held - 4 * _scalars(state.opt_state)} B of zero1's state" in msg, msg
  assert f"planned {planned - 4 * _scalars(state.opt_state)} B" in msg, msg


def _scalars(tree) -> int:
  return sum(1 for x in jax.tree.leaves(tree) if np.ndim(x) == 0)


NNX_CASES = [(1, "Explicit"), (2, "Explicit"), (2, "Auto")]


@pytest.fixture(scope="module")
def nnx_runs():
  out = {}
  for tp, kind in NNX_CASES:
    mesh = nnx_lm.make_mesh(tp, getattr(jax.sharding.AxisType, kind))
    for use in (False, True):
      with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model, opt, step = nnx_lm.setup(use, mesh)
        nnx_lm.train(model, opt, step, mesh, K)
      out[tp, kind, use] = (model, opt, [str(x.message) for x in w])
  return out


@pytest.mark.slow   # compiles the nnx LM six times (~70 s)
@pytest.mark.parametrize("tp,kind", NNX_CASES)
def test_nnx_lm_one_line_matches_optax_with_quarter_state(nnx_runs, tp, kind):
  """The step constrains the optimizer state to nnx.get_partition_spec of
  itself (flax's guides' pattern; on Explicit axes an assert): zero1's
  Variables say the data-sharded spec, so it stays 1/N."""
  ref, got = nnx_runs[tp, kind, False], nnx_runs[tp, kind, True]
  pure = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.Param))
  assert_close(pure(got[0]), pure(ref[0]), RTOL,
               f"nnx LM tp={tp} {kind} vs optax ")
  assert not [m for m in got[2] if "zero1" in m], got[2]
  zb, ob = nnx_lm.state_bytes(got[1]), nnx_lm.state_bytes(ref[1])
  n = 8 // tp
  # 1/n of optax's, plus padding to multiples of n and replicated scalars.
  assert zb * n <= ob * 1.05 + n * 64, (zb, ob, n)


def test_nnx_state_constrained_replicated_warns_with_bytes():
  """An nnx step resharding the optimizer state to P() (as the params'
  specs would on a 1-D mesh): the next step's tx.update sees it typed
  replicated on the Explicit data axis, warns with the bytes and reshards
  it to the plan (so the step still runs)."""
  mesh = nnx_lm.make_mesh(1)
  model, opt, _ = nnx_lm.setup(True, mesh, constrain=False)
  planned = nnx_lm.state_bytes(opt)

  @nnx.jit
  def step(model, optimizer, tokens):
    _, grads = nnx.value_and_grad(nnx_lm.loss_fn)(model, tokens)
    optimizer.update(model, grads)
    state = nnx.state(optimizer, nnx.optimizer.OptState)
    # On Explicit axes with_sharding_constraint only asserts: reshard moves.
    nnx.update(optimizer, jax.tree.map(
        lambda x: jax.sharding.reshard(x, P()), state))

  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    with jax.set_mesh(mesh):
      for tokens in nnx_lm.batches(2):
        step(model, opt, jax.device_put(tokens, NamedSharding(mesh, P("data"))))
  msgs = [str(x.message) for x in w if PLACED in str(x.message)]
  assert msgs, [str(x.message) for x in w]
  held = nnx_lm.state_bytes(opt)
  scalars = 4 * _scalars(nnx.state(opt, nnx.optimizer.OptState))
  assert f"{held - scalars} B of zero1's state per device" in msgs[0], msgs[0]
  assert f"planned {planned - scalars} B" in msgs[0], msgs[0]


def test_eager_update_on_replicated_state_warns():
  """Arrays passed to an eager tx.update placed replicated: warned at once."""
  import jax.numpy as jnp
  mesh = jax.make_mesh((8,), ("data",))
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  with jax.set_mesh(mesh):
    params = {"w": jnp.ones((16, 4))}
    state = tx.init(params)
    rep = jax.device_put(state, NamedSharding(mesh, P()))
    with pytest.warns(UserWarning, match=PLACED) as w:
      tx.update({"w": jnp.ones((16, 4))}, rep, params)
  msg = next(str(x.message) for x in w if PLACED in str(x.message))
  # mu and nu: f32[16, 4] whole (256 B each) where 1/8 (32 B) was planned.
  assert "512 B of zero1's state per device where zero1 planned 64 B" in msg, msg


def test_state_on_another_dim_warns_though_bytes_match():
  """State placed over "data" on another dim than planned: the same bytes,
  but each step re-shards it; warned too."""
  import jax.numpy as jnp
  mesh = jax.make_mesh((8,), ("data",))
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  with jax.set_mesh(mesh):
    params = {"w": jnp.ones((16, 8))}
    state = tx.init(params)
    assert state.inner[0].mu["w"].sharding.spec == P("data", None)
    other = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "data")))
        if x.ndim == 2 else x, state)
    with pytest.warns(UserWarning, match=PLACED) as w:
      tx.update({"w": jnp.ones((16, 8))}, other, params)
  msg = next(str(x.message) for x in w if PLACED in str(x.message))
  assert "2 of 2 state leaves" in msg, msg
  assert "placed P(None, 'data'), 64 B per device, planned P('data', None), 64 B" in msg, msg
  assert "The bytes are as planned (128 B per device), split on other dims" in msg, msg


def test_host_state_is_placed_not_warned():
  """A state handed back as host numpy arrays (e.g. read from disk) is not
  a misplacement: it is placed as planned (Explicit axis: resharded)."""
  import jax.numpy as jnp
  mesh = jax.make_mesh((8,), ("data",))
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  with jax.set_mesh(mesh):
    params = {"w": jnp.ones((16, 4))}
    state = jax.tree.map(np.asarray, tx.init(params))
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      _, new = tx.update({"w": jnp.ones((16, 4))}, state, params)
  assert not [x for x in w if PLACED in str(x.message)]
  assert new.inner[0].mu["w"].sharding.spec == P("data", None)


@pytest.mark.slow   # builds and compiles the linen LM twice (~70 s)
def test_linen_lm_unboxed_after_init_lm1b_style(linen_runs):
  """lm1b's variant: the state is unboxed after the jitted init and trained
  with the boxed abstract state's shardings. The step's params are then
  bare tracers on Auto axes: zero1 falls back on the model-axis sharding it
  read from the boxes at init (no 'cannot be read' warning), and the state
  stays 1/N."""
  mesh, runs = linen_runs
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  unbox = lambda t: jax.tree.map(lambda x: x.unbox() if is_box(x) else x, t,
                                 is_leaf=is_box)
  got = {}
  for use in (False, True):
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      state, _, shardings, data = linen_lm.setup(use, mesh)
      with jax.set_mesh(mesh):
        state = unbox(state)

      def train_step(state, tokens):
        loss, grads = jax.value_and_grad(linen_lm.loss_fn)(
            state.params, state.apply_fn, tokens)
        return state.apply_gradients(grads=grads), loss

      step = jax.jit(train_step, in_shardings=(shardings, data),
                     out_shardings=(shardings, None))
      state, _ = linen_lm.train(state, step, data, mesh, K)
    got[use] = (state, [str(x.message) for x in w if "zero1" in str(x.message)])
  assert not got[True][1], got[True][1]
  assert_close(got[True][0].params, got[False][0].params, RTOL, "lm1b-style ")
  zb, ob = opt_bytes(got[True][0].opt_state), opt_bytes(got[False][0].opt_state)
  assert zb * 4 <= ob * 1.05 + 4 * 64, (zb, ob)
