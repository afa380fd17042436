"""ZeRO-1 is optax's math: the same trajectory as unsharded optax and as plain
data parallel, at N = 1, 2, 4, 8, on a tree with odd shapes, a scalar, a
zero-size leaf and an integer leaf.

Tolerances:
* Bitwise whenever the reduced gradients are bitwise equal. ``exact_loss``
  has gradients that are means of small dyadic numbers, exact in fp32 in any
  summation order, so every N must reproduce optax bit for bit.
* Otherwise (a tanh model), the gradient of any two XLA programs can differ in
  the last ulp (even jit vs. eager on one device), and N devices sum in another
  order. After 20 steps we require max|p - p_ref| <= FP32_REORDER (1e-6) x
  max|p_ref| per leaf, derived in tests/tolerances.py (6 sigma of the
  summation-order noise of sgd+nesterov over 20 steps: 7.1e-7). Measured
  (jax 0.10.2, CPU): at most 3.8e-7 (sgd_momentum, N=8 vs DDP), 1.9e-7 vs
  optax, on every code target in docs/tolerances.md; lion is bitwise (its
  update is a sign); both reduce paths give the same numbers.
* Both reduce paths (reduce-scatter, and all-reduce = DeepSpeed's
  ``reduce_scatter: false``) are checked at every N, with SGD among the
  optimizers: SGD's update is proportional to the gradient, so a wrong shard
  or a wrong scale (N, loss scale) shows in the weights; Adam would hide a
  constant factor.
* bf16 (and mixed) tolerances are given, with their measured values, where
  they are asserted.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero1_jax as z1
from helpers import (assert_close, assert_equal, assert_ulps, batch, ddp_run,
                     exact_batches, exact_loss, float_part, loss_fn,
                     master_run, mesh, odd_params, optax_run)
from tolerances import FP32_REORDER

NS = [1, 2, 4, 8]
STEPS = 20
ndim_mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)


def path_mask(p):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "bias" not in jax.tree_util.keystr(path), p)


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_callable_mask": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=ndim_mask),
    "adamw_path_mask": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=path_mask),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.01),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adagrad": lambda: optax.adagrad(1e-2),
    "inject_schedule": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, STEPS),
        weight_decay=0.01),
}


@pytest.fixture(scope="module")
def batches():
  return [batch(16, seed=s) for s in range(STEPS)]


def zero1_run(make_tx, params, batches, n, loss=loss_fn, **kw):
  tx = z1.zero1(make_tx(), axis_name="data", bucket_bytes=96, **kw)
  p, s = z1.init(tx, params, mesh(n))
  step = z1.train_step(loss, tx, mesh(n))
  for b in batches:
    p, s, _ = step(p, s, b)
  return p, s


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_matches_unsharded_optax_and_ddp_at_every_n(name, batches):
  params = odd_params()
  ref = optax_run(OPTIMIZERS[name](), params, batches)
  for n in NS:
    got, _ = zero1_run(OPTIMIZERS[name], params, batches, n)
    assert_close(float_part(got), ref, FP32_REORDER, f"{name} N={n} vs optax ")
    if n in (2, 8):
      ddp = ddp_run(OPTIMIZERS[name](), params, batches, n)
      assert_close(float_part(got), ddp, FP32_REORDER, f"{name} N={n} vs DDP ")
    # Static leaves pass through untouched.
    np.testing.assert_array_equal(got["step_id"], params["step_id"])
    assert got["empty"].shape == (0, 3)


# SGD for the bitwise test: with a dyadic learning rate and momentum every
# product in the update is exact as well, so the result cannot depend on
# where XLA contracts a multiply-add into an FMA. That choice differs between
# two programs: with momentum 0.9 and lr 1e-2, jax 0.12 gives 2 of 35 elements
# of one leaf 1 ulp apart (N=2, in place, both reduce paths); jax 0.10.2 and
# the dyadic values give none. A wrong shard or scale still moves the weights.
EXACT_SGD = lambda: optax.sgd(2 ** -7, momentum=0.5, nesterov=True)
# Adam likewise, with b1 = b2 = 1/2: the moments' products are exact (the
# gradients have at most 8 significant bits, their squares 16), so an FMA
# cannot change them; what is left (bias correction, sqrt, the divide, the
# add to the weights) is one correctly rounded operation each, the same in
# any program. With b1 = 0.9 jax 0.12.1 gives 4 of 35 elements of one leaf
# 1 or 2 ulps from optax already at N=1, packed (jax 0.10.2: none).
EXACT_OPTIMIZERS = {
    "sgd_momentum": EXACT_SGD,
    "adam": lambda: optax.adam(2 ** -7, b1=0.5, b2=0.5),
    "adamw_callable_mask": lambda: optax.adamw(
        2 ** -7, b1=0.5, b2=0.5, weight_decay=2 ** -3, mask=ndim_mask),
}

# The test leaves are tiny, so by default every one is packed into buckets;
# inplace_bytes=0 sends every leaf through its own in-place collective.
PACKED, IN_PLACE = {}, {"inplace_bytes": 0}


@pytest.mark.parametrize("name,kw", [("adam", PACKED), ("sgd_momentum", PACKED),
                                     ("sgd_momentum", IN_PLACE)],
                         ids=["adam", "sgd_momentum", "sgd_momentum-in_place"])
def test_all_reduce_path_matches_unsharded_optax_and_ddp_at_every_n(name, kw, batches):
  """reduce="all_reduce" (DeepSpeed's reduce_scatter: false, the seed
  config's path): psum of each bucket (or leaf), then this device's slice.
  SGD makes a wrong shard (or a wrong scale) visible one for one."""
  params = odd_params()
  ref = optax_run(OPTIMIZERS[name](), params, batches)
  for n in NS:
    got, _ = zero1_run(OPTIMIZERS[name], params, batches, n, reduce="all_reduce", **kw)
    assert_close(float_part(got), ref, FP32_REORDER, f"{name} all_reduce N={n} vs optax ")
    if n in (2, 8):
      ddp = ddp_run(OPTIMIZERS[name](), params, batches, n)
      assert_close(float_part(got), ddp, FP32_REORDER, f"{name} all_reduce N={n} vs DDP ")
    np.testing.assert_array_equal(got["step_id"], params["step_id"])


@pytest.mark.parametrize("name,reduce,kw", [
    ("adam", "reduce_scatter", PACKED), ("adamw_callable_mask", "reduce_scatter", PACKED),
    ("sgd_momentum", "reduce_scatter", PACKED), ("sgd_momentum", "all_reduce", PACKED),
    # In place, each leaf its own collective (a wrong shard or row shows one
    # for one with SGD).
    ("sgd_momentum", "reduce_scatter", IN_PLACE), ("sgd_momentum", "all_reduce", IN_PLACE),
    ("adam", "reduce_scatter", IN_PLACE)],
    ids=lambda v: "in_place" if v is IN_PLACE else "packed" if v is PACKED else v)
def test_bitwise_when_reduced_gradients_are_bitwise_equal(name, reduce, kw):
  """Dyadic gradients sum exactly in any order, so every N, path and leaf
  layout (packed buckets, or each leaf's own in-place collective along its
  shard dim, padded where N does not divide it) must give optax's weights
  bitwise. The optimizers run with dyadic hyperparameters
  (EXACT_OPTIMIZERS)."""
  params = odd_params()
  bs = exact_batches(10)
  make = EXACT_OPTIMIZERS[name]
  tx0 = make()
  p0 = float_part(params)
  s0 = tx0.init(p0)

  @jax.jit
  def ref_step(p, s, b):
    u, s = tx0.update(jax.grad(exact_loss)(p, b), s, p)
    return optax.apply_updates(p, u), s

  for b in bs:
    p0, s0 = ref_step(p0, s0, b)
  for n in NS:
    tx = z1.zero1(make(), axis_name="data", bucket_bytes=96,
                  reduce=reduce, **kw)
    p, s = z1.init(tx, params, mesh(n))
    step = z1.train_step(exact_loss, tx, mesh(n))
    for b in bs:
      p, s, _ = step(p, s, b)
    assert_equal(float_part(p), p0, f"{name} {reduce} N={n} ")


BF16_RTOL = {"adam": 1e-3, "sgd_momentum": 2 ** -7}


@pytest.mark.parametrize("n,reduce,name", [
    (1, "reduce_scatter", "adam"), (4, "reduce_scatter", "adam"),
    (4, "reduce_scatter", "sgd_momentum"), (4, "all_reduce", "sgd_momentum")])
def test_bf16_params_follow_an_fp32_master(n, reduce, name, batches):
  params = odd_params(jnp.bfloat16)
  ref = master_run(OPTIMIZERS[name](), params, batches[:8])
  got, state = zero1_run(OPTIMIZERS[name], params, batches[:8], n, reduce=reduce)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(float_part(got)))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.master))
  # The params are exactly the fp32 master cast to bf16.
  for path, m in jax.tree_util.tree_flatten_with_path(state.master)[0]:
    p = got
    for k in path:
      p = p[k.key]
    m = np.asarray(m)
    if m.ndim:
      m = m[tuple(slice(0, s) for s in p.shape)]
    np.testing.assert_array_equal(np.asarray(p), m.astype(jnp.bfloat16))
  if n == 1:
    assert_equal(float_part(got), ref, f"bf16 {name} N=1 ")
  else:
    # N devices sum bf16 gradients in another order than one device does, so
    # the fp32 masters drift apart by bf16 gradient roundings and a weight can
    # round to the neighbouring bf16 value. SGD: that is one bf16 ulp of a
    # leaf's largest weight, <= 2^-7 of it (measured 4.9e-3, N=2, 4, both
    # reduce paths). Adam moves every weight by ~lr, so only small weights
    # flip (measured 5.3e-4 at N=4, 8.0e-4 at N=8): 1e-3.
    assert_close(float_part(got), ref, BF16_RTOL[name],
                 f"bf16 {name} {reduce} N={n} ")


def test_mixed_dtype_tree(batches):
  params = odd_params()
  params["out"] = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params["out"])
  got, state = zero1_run(lambda: optax.adam(1e-2), params, batches[:5], 4)
  assert got["out"]["kernel"].dtype == jnp.bfloat16
  assert got["dense"]["kernel"].dtype == jnp.float32
  ref = master_run(optax.adam(1e-2), params, batches[:5])
  # bf16 leaves: within one rounding of the bf16 cast (measured: 0 ulps);
  # fp32 leaves: fp32 rounding as above (measured 8.1e-8).
  assert_ulps(got["out"], ref["out"], 1, "mixed bf16 ")
  rest = lambda t: {k: v for k, v in float_part(t).items() if k != "out"}
  assert_close(rest(got), rest(ref), FP32_REORDER, "mixed fp32 ")


def test_optax_update_api_inside_shard_map(batches):
  """tx.update returns updates that apply_updates turns into the new weights."""
  from jax.sharding import PartitionSpec as P
  n = 4
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  params = float_part(odd_params())
  p, s = z1.init(tx, params, mesh(n))
  specs = z1.specs.state_specs(tx, params, n)

  def per_device(p, s, b):
    local = jax.lax.pcast(p, "data", to="varying")
    g = jax.grad(loss_fn)(local, b)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(jax.shard_map(per_device, mesh=mesh(n),
                               in_specs=(P(), specs, P("data")),
                               out_specs=(P(), specs)))
  for b in batches[:5]:
    b = jax.device_put(b, jax.sharding.NamedSharding(mesh(n), P("data")))
    p, s = step(p, s, b)
  ref = optax_run(optax.adam(1e-2), params, batches[:5])
  assert_close(p, ref, FP32_REORDER, "update API ")
