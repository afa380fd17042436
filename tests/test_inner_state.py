"""z1.inner_state: the inner optimizer's state as unsharded optax holds it,
from the sharded, padded state of z1.init / z1.train_step.

Order of the checks: the tree structure first (the one ``inner.init`` builds
on the whole parameters, integer and zero-size leaves included), then each
leaf of unsharded optax's state (float leaves only: optax's reference runs on
them) at the same path with the same shape and dtype, then the values.

Tolerance: per leaf ``max|got - ref| <= 1e-6 * max|ref|`` (floor 1e-3:
helpers.assert_close), the fp32 floor of tests/test_equivalence.py. zero1
sums N per-device gradients where optax takes one gradient of the global
batch, so after 3 steps moments, ``z`` and params differ by the rounding of
that order (measured: at most 3e-7 relative); schedule-free's eval params
``(y - (1 - b1) z) / b1`` amplify it by at most ~1.2x. A leaf left padded,
a shard not gathered or another parameter's leaf is off by O(1).
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax.linen as nn
from flax import nnx
from flax.nnx.training.optimizer import to_opt_state

import zero1_jax as z1
from helpers import (assert_close, batch, float_part, loss_fn, mesh, odd_params,
                     optax_run)

STEPS, RTOL = 3, 1e-6
BATCHES = [batch(16, seed=s) for s in range(STEPS)]
SF = lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2)
ADAM = lambda: optax.adam(1e-2)


@functools.lru_cache(maxsize=None)
def sf_ref():
  return optax_ref(SF, odd_params())


def optax_ref(inner, params, loss=loss_fn):
  """Unsharded jitted optax on the float leaves: (params, state)."""
  return optax_run(inner(), params, BATCHES, loss=loss, return_state=True)


def zero1_run(inner, params, msh, loss=loss_fn):
  tx = z1.zero1(inner(), axis_name="data")
  p, s = z1.init(tx, params, msh)
  step = z1.train_step(loss, tx, msh)
  for b in BATCHES:
    p, s, _ = step(p, s, b)
  return tx, p, s


def by_path(tree) -> dict:
  return {jax.tree_util.keystr(k): x
          for k, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_state(inner, state, params, ref_state):
  """Structure of inner.init on the whole params; optax's leaves at their
  paths (same shape and dtype), every extra leaf under a static parameter;
  then the values."""
  assert (jax.tree.structure(state)
          == jax.tree.structure(jax.eval_shape(inner().init, params)))
  ours, ref = by_path(state), by_path(ref_state)
  static = [k for k, x in by_path(params).items()
            if not jnp.issubdtype(x.dtype, jnp.floating) or not x.size]
  assert set(ref) <= set(ours), sorted(set(ref) - set(ours))
  for k in set(ours) - set(ref):
    assert any(k.endswith(s) for s in static), k
  for k, w in ref.items():
    assert (ours[k].shape, ours[k].dtype) == (w.shape, w.dtype), k
  assert_close({k: ours[k] for k in ref}, ref, RTOL, "inner_state ")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_schedule_free_eval_params_match_optax(n):
  """The trial's case: optax.contrib.schedule_free_eval_params on zero1's
  state (before: its leaves were the padded 1/N shards)."""
  params = odd_params()
  tx, p, s = zero1_run(SF, params, mesh(n))
  state = z1.inner_state(tx, s, p)
  ref_p, ref_s = sf_ref()
  check_state(SF, state, params, ref_s)
  got = optax.contrib.schedule_free_eval_params(state, p)
  want = optax.contrib.schedule_free_eval_params(ref_s, ref_p)
  assert_close(float_part(got), want, RTOL, "eval params ")
  # Integer leaves (never trained): z is what init gave them, the params.
  np.testing.assert_allclose(got["step_id"], params["step_id"], rtol=1e-6)
  # Gathered: each leaf is whole on every device, like the params.
  w = state.z["dense"]["kernel"]
  assert w.sharding.is_fully_replicated and w.shape == params["dense"]["kernel"].shape


def test_adam_moments_match_optax():
  params = odd_params()
  tx, _, s = zero1_run(ADAM, params, mesh(4))
  state = z1.inner_state(tx, s, params)
  _, ref_s = optax_ref(ADAM, params)
  check_state(ADAM, state, params, ref_s)
  assert int(state[0].count) == STEPS


def test_adam_moments_on_a_2d_mesh_keep_the_params_model_sharding():
  """("data", "model") = (4, 2), params tensor-parallel on "model": each
  moment comes back whole over "data" and sharded over "model" as its
  parameter is; values as unsharded optax's."""
  r = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(r.normal(size=s) * 0.3, jnp.float32)
  params = {"w1": f(5, 8), "b1": f(8), "w2": f(8, 3), "s": jnp.float32(0.5)}
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None),
           "s": P()}

  def loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"]) * p["s"] - b["y"]) ** 2)

  msh = jax.make_mesh((4, 2), ("data", "model"),
                      axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
  placed = {k: jax.device_put(v, NamedSharding(msh, specs[k]))
            for k, v in params.items()}
  tx, p, s = zero1_run(ADAM, placed, msh, loss)
  state = z1.inner_state(tx, s, p)
  _, ref_s = optax_ref(ADAM, params, loss)
  check_state(ADAM, state, params, ref_s)
  for k, spec in specs.items():
    for moment in (state[0].mu, state[0].nu):
      assert moment[k].sharding.is_equivalent_to(
          NamedSharding(msh, spec), moment[k].ndim), (k, moment[k].sharding)


@pytest.mark.parametrize("axes, set_mesh", [
    (AxisType.Explicit, True), (AxisType.Explicit, False), (AxisType.Auto, False)],
    ids=["explicit-set_mesh", "explicit-arrays_mesh", "auto"])
def test_inside_the_users_jit_equals_the_eager_result(axes, set_mesh):
  """An eval step jitted around inner_state (the trial's schedule-free
  eval). Odd shapes pad every leaf; on Explicit axes the traced leaf's type
  is sharded, and JAX cuts a sharded dim only to a multiple of the axis
  (before: ShardingTypeError). The jit only slices and gathers: bitwise the
  eager result."""
  msh = jax.make_mesh((4,), ("data",), axis_types=(axes,),
                      devices=jax.devices()[:4])
  tx, p, s = zero1_run(SF, odd_params(), msh)
  eval_params = lambda s, p: optax.contrib.schedule_free_eval_params(
      z1.inner_state(tx, s, p), p)
  want, want_state = eval_params(s, p), z1.inner_state(tx, s, p)
  with jax.set_mesh(msh) if set_mesh else contextlib.nullcontext():
    got = jax.jit(eval_params)(s, p)
    got_state = jax.jit(lambda s, p: z1.inner_state(tx, s, p))(s, p)
  for g, w in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # The eval params' arithmetic, fused under jit, may round differently.
  assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, p)
  assert_close(float_part(got), float_part(want), RTOL, "jitted eval params ")


def _refill(template, values):
  """``template``'s boxes around ``values``' leaves (a trained state)."""
  box = lambda x: isinstance(x, nn.Partitioned)
  assert any(map(box, jax.tree.leaves(template, is_leaf=box)))
  return jax.tree.map(lambda b, v: b.replace_boxed(v) if box(b) else v,
                      template, values, is_leaf=box)


@pytest.mark.parametrize("wrapping", ["zero1-boxes", "linen-boxes",
                                      "nnx-optimizer"])
def test_a_state_in_flax_boxes_or_nnx_variables_reads_as_the_bare_one(wrapping):
  """The trial's case: with flax loaded, ``zero1(mesh=)`` outside
  ``jax.set_mesh`` boxes each sharded state leaf (flax derives shardings
  from an abstract state only through boxes); linen's boxed params give the
  state their boxes; ``nnx.Optimizer`` holds it in Variables. Each reads
  as the bare state does, bitwise, and schedule-free's eval params follow
  (before: ValueError, "opt_state.inner has the tree ...")."""
  msh = mesh(4)
  params = float_part(odd_params())
  tx, p, s = zero1_run(SF, params, msh)
  if wrapping == "zero1-boxes":
    wrapped_tx = z1.zero1(SF(), axis_name="data", mesh=msh)
    wrapped = s._replace(inner=_refill(wrapped_tx.init(p).inner, s.inner))
  elif wrapping == "linen-boxes":
    wrapped_tx = tx
    boxed = jax.tree.map(lambda x: nn.Partitioned(x, (None,) * x.ndim), p)
    with jax.set_mesh(msh):
      wrapped = s._replace(inner=_refill(tx.init(boxed).inner, s.inner))
  else:
    wrapped_tx, wrapped = tx, to_opt_state(s)
    assert isinstance(jax.tree.leaves(
        wrapped, is_leaf=lambda x: isinstance(x, nnx.Variable))[0],
        nnx.Variable)
  want = z1.inner_state(tx, s, p)
  got = z1.inner_state(wrapped_tx, wrapped, p)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  check_state(SF, got, params, sf_ref()[1])
  ev = optax.contrib.schedule_free_eval_params(got, p)
  assert jax.tree.map(jnp.shape, ev) == jax.tree.map(jnp.shape, p)


def test_refuses_what_is_not_a_zero1_state():
  params = float_part(odd_params())
  tx = z1.zero1(ADAM(), axis_name="data")
  with pytest.raises(TypeError, match="z1.inner_state: tx must be"):
    z1.inner_state(ADAM(), tx.init, params)
  _, s = z1.init(tx, params, mesh(2))
  with pytest.raises(ValueError, match="pass the tx and params opt_state"):
    z1.inner_state(z1.zero1(SF(), axis_name="data"), s, params)
  # The per-device shard (as inside shard_map) is not the padded parameter.
  local = s._replace(inner=jax.tree.map(
      lambda x: np.asarray(x)[:1] if x.ndim else x, s.inner))
  with pytest.raises(ValueError, match="outside shard_map"):
    z1.inner_state(tx, local, params)
