"""train_step, init and update on bad input: each refusal names what is
wrong and the fix, before anything is compiled or allocated."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from helpers import (assert_close, batch, float_part, loss_fn, mesh,
                     odd_params, optax_run)
from tolerances import FP32_REORDER


def test_mesh_without_the_axis_names_the_fix():
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  bad = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
  with pytest.raises(ValueError, match=r"axes \('batch',\).*'data'.*axis_name"):
    z1.init(tx, odd_params(), bad)
  with pytest.raises(ValueError, match="'data'"):
    z1.train_step(loss_fn, tx, bad)


@pytest.mark.parametrize("tx,fix", [
    (optax.adam(1e-3), r"plain optax GradientTransformation\. Wrap the optimizer: z1\.zero1\(opt"),
    (optax.chain(z1.zero1(optax.adam(1e-3), axis_name="data"), optax.scale(0.5)),
     r"put them inside: z1\.zero1\(optax\.chain\(opt, \.\.\.\)"),
    (optax.MultiSteps(z1.zero1(optax.adam(1e-3), axis_name="data"), 2),
     r"optax\.MultiSteps\. Accumulate inside instead: z1\.zero1\(optax\.MultiSteps\(opt, k\).*grad_accum_steps=k"),
    (optax.lookahead(z1.zero1(optax.adam(1e-3), axis_name="data"), 2, 0.5),
     r"got optax\.lookahead\. z1\.train_step .* takes no wrapper around it: "
     r"run optax\.lookahead\(z1\.zero1\(opt, \.\.\.\), \.\.\.\) with "
     r"tx\.init / tx\.update"),
], ids=["plain", "chain_around", "multisteps_around", "lookahead_around"])
def test_a_transform_that_is_not_zero1_names_the_fix(tx, fix):
  """Forgetting z1.zero1, or wrapping it, is a TypeError with the fix (it was
  an AttributeError on `.config`); lookahead around zero1, the form zero1's
  refusal gives for a step of one's own, is told it belongs there."""
  for call, where in ((lambda: z1.init(tx, odd_params(), mesh(2)), "z1.init"),
                      (lambda: z1.train_step(loss_fn, tx, mesh(2)), "z1.train_step"),
                      (lambda: z1.state_shardings(tx, odd_params(), mesh(2)),
                       "z1.state_shardings")):
    with pytest.raises(TypeError, match=re.escape(where) + ": tx must be .*" + fix):
      call()


@pytest.mark.parametrize("stage", [1, 2])
def test_a_loss_that_is_not_a_scalar_names_the_fix(stage):
  """A per-example loss vector, or (loss, aux) without has_aux: TypeErrors
  saying what to change (were jax's "Gradient only defined for scalar-output
  functions" and an AttributeError on a tuple)."""
  make = z1.zero1 if stage == 1 else z1.zero2
  tx = make(optax.adam(1e-3), axis_name="data")
  per_example = lambda p, b: jnp.mean(jnp.square(
      b["x"] @ p["dense"]["kernel"]), axis=1)
  with_aux = lambda p, b: (loss_fn(p, b), {"n": b["x"].shape[0]})
  for loss, kw, want in (
      (per_example, {}, r"must return a floating scalar.*got float32\[2\].*jnp\.mean"),
      (with_aux, {}, r"returned a tuple of 2; .*pass has_aux=True"),
      (loss_fn, {"has_aux": True}, r"has_aux=True but loss_fn returned one array, float32\[\], not a \(loss, aux\) pair")):
    p, s = z1.init(tx, odd_params(), mesh(4))
    step = z1.train_step(loss, tx, mesh(4), **kw)
    with pytest.raises(TypeError, match=want):
      step(p, s, batch(8))


def test_batch_not_divisible_by_devices_times_accumulation():
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  p, s = z1.init(tx, odd_params(), mesh(4))
  step = z1.train_step(loss_fn, tx, mesh(4), grad_accum_steps=2)
  with pytest.raises(ValueError, match=r"batch size 12 .*grad_accum_steps \(2\) x data-parallel devices \(4\) = 8.*multiple of 8"):
    step(p, s, batch(12))


def test_batch_leaves_without_a_shared_leading_axis_are_named():
  """A scalar batch leaf (a temperature, a step) and leaves of different
  lengths: ValueErrors naming the leaves and the fix (a scalar was an
  AttributeError on 'float'.ndim)."""
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  p, s = z1.init(tx, odd_params(), mesh(2))
  step = z1.train_step(loss_fn, tx, mesh(2))
  with pytest.raises(ValueError, match=r"batch leaf \['t'\] is a scalar; .*"
                     r"closure or functools\.partial"):
    step(p, s, {**batch(8), "t": 1.0})
  with pytest.raises(ValueError, match=r"same leading \(batch\) size; got "
                     r"\['w'\]: 6; \['x'\], \['y'\]: 8\."):
    step(p, s, {**batch(8), "w": np.ones(6, np.float32)})


def test_a_mesh_without_the_data_axis_names_the_fix():
  """A 1-D mesh with another axis name: rename it or pass that name. A 2-D
  mesh: name the data-parallel axis (the fix for 1-D, a 1-D mesh, would drop
  the model axis)."""
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  one = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
  with pytest.raises(ValueError, match=r"mesh has axes \('batch',\) but the "
                     r"optimizer shards over 'data'\..*axis_name='batch'"):
    z1.init(tx, odd_params(), one)
  two = jax.make_mesh((2, 2), ("dp", "model"), devices=jax.devices()[:4])
  with pytest.raises(ValueError, match=r"axis_name=<the data-parallel one of "
                     r"\('dp', 'model'\)>\), or name that axis 'data'"):
    z1.init(tx, odd_params(), two)


def test_wrong_tree_in_update_names_the_path():
  n = 2
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  params = float_part(odd_params())
  p, s = z1.init(tx, params, mesh(n))
  specs = z1.specs.state_specs(tx, params, n)
  bad_grads = {**params, "gain": jnp.ones(2)}

  def f(p, s):
    return tx.update(bad_grads, s, p)

  with pytest.raises(ValueError, match=r"grads\['gain'\] has shape \(2,\)"):
    jax.jit(jax.shard_map(f, mesh=mesh(n), in_specs=(P(), specs),
                          out_specs=(P(), specs)))(p, s)
  missing = {k: v for k, v in params.items() if k != "gain"}
  with pytest.raises(ValueError, match="grads tree does not match"):
    jax.jit(jax.shard_map(lambda p, s: tx.update(missing, s, p), mesh=mesh(n),
                          in_specs=(P(), specs), out_specs=(P(), specs)))(p, s)


def test_a_state_made_for_other_params_names_the_fix():
  """penzai's trainer inits on every parameter and updates only the
  trainable ones: in plain jit JAX's "Tuple arity mismatch" named neither
  the state nor the fix."""
  m = mesh(8)
  full = jax.device_put((jnp.ones((8, 32)), jnp.ones(32), jnp.ones((32, 8))),
                        NamedSharding(m, P()))
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", mesh=m)
  state = tx.init(full)
  with pytest.raises(ValueError, match=r"zero1: opt_state does not fit the "
                     r"params given to tx.update .*\(3 leaves there, 2 here\)"):
    jax.jit(tx.update)(full[1:], state, full[1:])


def test_update_refuses_gradients_jax_already_summed():
  """Inside a shard_map that tracks varying axes (check_vma, its default),
  jax.grad with respect to params that entered as P() psums the per-device
  gradients. zero1 reducing them again would apply N times the mean gradient
  (measured: every SGD update 4.0x optax's at N=4), so tx.update refuses
  them and names the fix. With the params pcast to varying (the fix) the step
  matches optax; with check_vma=False the gradients are local, untyped, and
  also match (the SGD step has no tolerance for a factor of N)."""
  n = 4
  tx = z1.zero1(optax.sgd(0.05), axis_name="data")
  params = float_part(odd_params())
  specs = z1.specs.state_specs(tx, params, n)
  b = batch(16)
  placed = jax.device_put(b, NamedSharding(mesh(n), P("data")))
  ref = optax_run(optax.sgd(0.05), params, [b])

  def step(pcast, check_vma=True):
    def per_device(p, s, b):
      local = jax.lax.pcast(p, "data", to="varying") if pcast else p
      u, s = tx.update(jax.grad(loss_fn)(local, b), s, p)
      return optax.apply_updates(p, u), s
    p, s = z1.init(tx, params, mesh(n))
    return jax.jit(jax.shard_map(
        per_device, mesh=mesh(n), in_specs=(P(), specs, P("data")),
        out_specs=(P(), specs), check_vma=check_vma))(p, s, placed)[0]

  with pytest.raises(ValueError, match=r"already reduced over 'data'.*"
                     r"N times the mean gradient.*jax\.lax\.pcast\(params, "
                     r"'data', to='varying'\)"):
    step(pcast=False)
  # 1 step of SGD: a few fp32 ulps from the 4-way vs 16-way gradient sum.
  assert_close(step(pcast=True), ref, FP32_REORDER, "pcast ")
  assert_close(step(pcast=False, check_vma=False), ref, FP32_REORDER, "check_vma=False ")


def test_init_outside_shard_map_says_how():
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  with pytest.raises(ValueError, match="inside shard_map.*z1.init"):
    tx.init(odd_params())


@pytest.mark.parametrize("inner,why", [
    (lambda: optax.adafactor(1e-3, min_dim_size_to_factor=2), "not shaped like"),
    (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "max_grad_norm"),
    (lambda: optax.lamb(1e-3), "reduces across elements"),
    (lambda: optax.chain(optax.scale_by_adam(), optax.normalize_by_update_norm()), "reduces across elements"),
])
def test_non_elementwise_inner_is_refused(inner, why):
  tx = z1.zero1(inner(), axis_name="data")
  with pytest.raises(ValueError, match=f"not elementwise.*{why}|{why}.*not elementwise|not elementwise"):
    z1.init(tx, float_part(odd_params()), mesh(2))
  with pytest.raises(ValueError, match=why):
    z1.init(tx, float_part(odd_params()), mesh(2))


def test_bad_options():
  with pytest.raises(ValueError, match="reduce must be"):
    z1.zero1(optax.adam(1e-3), axis_name="data", reduce="ring")
  with pytest.raises(ValueError, match="max_grad_norm"):
    z1.zero1(optax.adam(1e-3), axis_name="data", max_grad_norm=0)
  with pytest.raises(ValueError, match="bucket_bytes"):
    z1.zero1(optax.adam(1e-3), axis_name="data", bucket_bytes=0)
