"""ZeRO-2 (``z1.zero2``): ZeRO-1's results, without the full gradient tree.

* Bitwise equal to ZeRO-1 wherever the reduced gradients are equal:
  ``exact_loss`` has dyadic gradients, exact in fp32/bf16/fp16 in any
  summation order, so stage 2's order (reduce each micro-batch, then sum the
  shards) and stage 1's (sum the micro-batches, then reduce) give the same
  bits. Params, loss scale and metrics are compared bitwise (the optimizer
  state within 1e-6: see assert_same_run) at N=1,2,4,8, accumulation 1 and
  4, fp32/bf16/fp16 params (fp16 with dynamic loss scaling and an
  overflowing step), with clipping, on odd shapes with a scalar, a zero-size
  and an integer leaf.
* Within 1e-6 of ZeRO-1 on a tanh model with random fp32 data, where the two
  summation orders round differently (measured 6e-8 at N=2, N=8).
* Compiled per-device memory at N=8: with 4-step accumulation stage 2's peak
  is below stage 1's by at least 0.8 (1 - 1/N) x the gradient bytes (stage 1
  keeps a full accumulator, stage 2 its shard); without accumulation stage 2
  stays within the no-communication floor (fwd + bwd + local SGD) + the
  sharded state + 0.3 x the gradient bytes.
* Overlap (z1.inspect.overlap): each per-leaf reduce-scatter has other
  layers' backward dots independent of it; stage 1's bucket has almost none.
"""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from zero1_jax.core import zero2
from helpers import (assert_close, assert_equal, batch, exact_batches,
                     exact_loss, float_part, loss_fn, mesh, odd_params)
from tolerances import FP32_REORDER, FP32_SCALAR_REORDER

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def boom_loss(params, b):
  """exact_loss, made inf on the batch whose 'boom' is set (fp16 overflow)."""
  return exact_loss(params, b) * jnp.where(jnp.any(b["boom"] > 0), jnp.inf, 1.0)


def run(make, params, batches, n, accum, loss, **kw):
  tx = make(optax.adam(1e-2), axis_name="data", **kw)
  p, s = z1.init(tx, params, mesh(n))
  step = z1.train_step(loss, tx, mesh(n), grad_accum_steps=accum)
  ms = []
  for b in batches:
    p, s, m = step(p, s, b)
    ms.append(m)
  return p, s, ms


def assert_same_run(got, want, what):
  """Params and metrics bitwise; optimizer state bitwise on integer leaves
  and within 1e-6 (of each leaf's largest value) on floating ones.

  Why not bitwise state: the reduced gradients are bitwise equal (params
  after 3 Adam steps are), but stage 1 slices small leaves out of packed
  buckets while stage 2 reduces them one by one, so XLA fuses the inner
  update of those leaves differently and rounds some elements of the bias
  moments and masters 1 ulp apart (measured: at most 9.3e-8 relative).
  """
  (p2, s2, m2), (p1, s1, m1) = got, want
  assert_equal(p2, p1, f"{what} params ")
  assert_equal(m2, m1, f"{what} metrics ")
  s2, s1 = jax.tree.map(np.asarray, s2), jax.tree.map(np.asarray, s1)
  is_float = lambda x: np.issubdtype(x.dtype, np.floating)
  assert_equal(*[jax.tree.map(lambda x: None if is_float(x) else x, t)
                 for t in (s2, s1)], f"{what} opt_state ")
  assert_close(*[jax.tree.map(lambda x: x if is_float(x) else None, t)
                 for t in (s2, s1)], FP32_REORDER, f"{what} opt_state ")


@pytest.mark.parametrize("n,accum,dtype", [
    (1, 4, "fp32"), (2, 1, "bf16"), (4, 4, "fp16"), (8, 4, "bf16"),
    (8, 1, "fp32")])
def test_bitwise_zero1_when_reduced_gradients_are_equal(n, accum, dtype):
  params = odd_params(DTYPES[dtype])
  bs = exact_batches(3, size=32)
  kw = dict(max_grad_norm=0.5)   # below the gradient norm: clipping is active
  loss = exact_loss
  if dtype == "fp16":
    loss = boom_loss
    bs = [dict(b, boom=np.full((32,), float(i == 1), np.float32))
          for i, b in enumerate(bs)]
    kw["loss_scale"] = z1.DynamicLossScale(initial_scale_power=8,
                                           loss_scale_window=2, hysteresis=1)
  one = run(z1.zero1, params, bs, n, accum, loss, **kw)
  two = run(z1.zero2, params, bs, n, accum, loss, **kw)
  assert_same_run(two, one, f"N={n} accum={accum} {dtype} ")
  ms = one[2]
  assert all(float(m["grad_norm"]) > 0.5 for m in ms if not m["skipped"])
  if dtype == "fp16":
    assert [bool(m["skipped"]) for m in ms] == [False, True, False]
  np.testing.assert_array_equal(two[0]["step_id"], params["step_id"])


def test_bitwise_zero1_all_reduced_and_with_two_scalars():
  """``reduce="all_reduce"`` (DeepSpeed's ``reduce_scatter: false``): each
  device keeps its own shard of the all-reduced sums, as stage 1 does; and
  a second scalar leaf, whose gradient differs from the first's, gets its
  own sum back (scalars are reduced together)."""
  params = dict(odd_params(), temp=jnp.asarray(0.5, jnp.float32))
  bs = exact_batches(3, size=32)
  for kw in (dict(reduce="all_reduce"), {}):
    one = run(z1.zero1, params, bs, 4, 1, exact_loss, **kw)
    two = run(z1.zero2, params, bs, 4, 1, exact_loss, **kw)
    assert_same_run(two, one, f"{kw} ")
  moved = lambda k, start: float(one[0][k]) - start
  assert moved("temp", 0.5) != moved("gain", 1.25)   # two different sums


def test_reduce_dtype_is_stage_1s():
  """A reduce dtype narrower than the params' (bf16 sums of fp32 gradients):
  stage 2 reduces in it as stage 1 does. Random data, so the bf16 sums
  round (a step moves a weight by ~lr, the bf16 rounding of its gradient
  moves it by ~lr x 2^-9 = 2e-5, twenty times FP32_REORDER); stage 1 and
  stage 2 sum the same terms in the same order per element."""
  params, n = odd_params(), 4
  bs = [batch(32, seed=i) for i in range(2)]
  narrow = dict(reduce_dtype=jnp.bfloat16)
  p1 = run(z1.zero1, params, bs, n, 1, loss_fn, **narrow)[0]
  p2 = run(z1.zero2, params, bs, n, 1, loss_fn, **narrow)[0]
  wide = run(z1.zero2, params, bs, n, 1, loss_fn)[0]
  assert_close(float_part(p2), float_part(p1), FP32_REORDER, "bf16 sums ")
  moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(float_part(p2)),
                              jax.tree.leaves(float_part(wide))))
  assert moved > 10 * FP32_REORDER, moved


def test_within_1e6_of_zero1_with_random_data_and_accumulation():
  params, n = odd_params(), 8
  bs = [batch(32, seed=i) for i in range(5)]
  p1, _, m1 = run(z1.zero1, params, bs, n, 4, loss_fn, max_grad_norm=1.0)
  p2, _, m2 = run(z1.zero2, params, bs, n, 4, loss_fn, max_grad_norm=1.0)
  # Summation order differs (micro-batches then devices vs the reverse):
  # fp32 rounding, measured 6e-8 relative after 5 Adam steps.
  assert_close(float_part(p2), float_part(p1), FP32_REORDER, f"N={n} ")
  assert_close([m["loss"] for m in m2], [m["loss"] for m in m1],
               FP32_SCALAR_REORDER, "loss ")


def test_update_inside_a_users_shard_map_is_zero1s():
  """tx.update gets whole local gradients: stage 2's is stage 1's, bitwise."""
  params, n = float_part(odd_params()), 4
  msh = mesh(n)
  b = jax.device_put(batch(8), NamedSharding(msh, P("data")))
  outs = []
  for make in (z1.zero1, z1.zero2):
    tx = make(optax.adam(1e-2), axis_name="data", max_grad_norm=0.5)
    p, s = z1.init(tx, params, msh)
    specs = z1.specs.state_specs(tx, params, n)

    def per_device(p, s, b, tx=tx):
      g = jax.grad(loss_fn)(jax.lax.pcast(p, "data", to="varying"), b)
      return tx.update(g, s, p)

    f = jax.jit(jax.shard_map(per_device, mesh=msh,
                              in_specs=(P(), specs, P("data")),
                              out_specs=(P(), specs), check_vma=False))
    outs.append(f(p, s, b)[0])
  assert_equal(outs[1], outs[0], "updates ")


@pytest.mark.parametrize("n,dtype", [(8, "fp32"), (8, "fp16"), (4, "bf16"),
                                     (2, "fp32")])
def test_per_leaf_hooks_hand_each_device_the_packed_hooks_shards(n, dtype):
  """On GPUs each leaf's gradient is reduce-scattered in its own
  shape along its shard dim (XLA combines a group's by its combiner_key);
  on CPU the group's rank-major views are packed into one collective. Both
  hand each device the same shard of every leaf, bitwise: exact_loss's
  gradients are dyadic, exact in any summation order and in fp16's
  predivision by N. The leaves: padded on dim 0 and on dim 1, unpadded on
  dim 0 and on dim 1, a scalar, a zero-size and an integer leaf."""
  params = dict(odd_params(DTYPES[dtype]), cols=jnp.ones((3, 16), DTYPES[dtype]),
                rows=jnp.ones((16, 3), DTYPES[dtype]))
  cfg = z1.zero1(optax.sgd(0.1), axis_name="data", bucket_bytes=256,
                 inplace_bytes=64).config
  b = exact_batches(1, size=4 * n)[0]
  loss = lambda p, bt: (exact_loss(p, bt), None)

  def shards(platform):
    def per_device(p, bt):
      g, _ = zero2.reduced_grad_fn(loss, p, cfg, n, None, platform)(bt)
      return jax.tree.map(lambda x: x[None], g)
    msh = mesh(n)
    f = jax.shard_map(per_device, mesh=msh, in_specs=(P(), P("data")),
                      out_specs=P("data"), check_vma=False)
    return jax.jit(f)(params, jax.device_put(b, NamedSharding(msh, P("data"))))

  per_leaf, packed = shards("gpu"), shards(None)
  assert jax.tree.structure(per_leaf) == jax.tree.structure(packed)
  assert_equal(per_leaf, packed, f"N={n} {dtype} ")
  assert np.any(np.asarray(packed["cols"], np.float32) != 0)


def test_same_keywords_as_zero1():
  assert inspect.signature(z1.zero2) == inspect.signature(z1.zero1)
  kw = dict(reduce="all_reduce", bucket_bytes=4096, gather_bucket_bytes=512,
            master_dtype=jnp.float32, max_grad_norm=2.0,
            loss_scale=z1.StaticLossScale(8.0), reduce_dtype=jnp.float32,
            check_elementwise=False, clip_rule="deepspeed")
  one = z1.zero1(optax.sgd(0.1), axis_name="d", **kw).config
  two = z1.zero2(optax.sgd(0.1), axis_name="d", **kw).config
  assert (two.stage, one.stage) == (2, 1)
  assert dataclasses.replace(two, stage=1) == one
  with pytest.raises(TypeError, match="bucket_size"):
    z1.zero2(optax.sgd(0.1), axis_name="d", bucket_size=1)


def test_bad_input_is_refused_clearly():
  with pytest.raises(ValueError, match="stage must be 1 or 2"):
    z1.Zero1Config("data", stage=3)
  with pytest.raises(ValueError, match="reduce must be"):
    z1.zero2(optax.adam(1e-2), axis_name="data", reduce="gather")
  tx = z1.zero2(optax.adam(1e-2), axis_name="data")
  params = float_part(odd_params())
  p, s = z1.init(tx, params, mesh(2))

  def apply_full(p, s):   # full-size grads handed to the pre-reduced entry
    return tx.apply(p, s, p, pre_reduced=True)

  specs = z1.specs.state_specs(tx, params, 2)
  f = jax.shard_map(apply_full, mesh=mesh(2), in_specs=(P(), specs),
                    out_specs=(P(), specs, P()), check_vma=False)
  with pytest.raises(ValueError, match=r"grads\['dense'\]\['bias'\] has shape \(7,\) but this "
                     r"device's shard is \(4,\)\. pre_reduced=True takes"):
    jax.jit(f)(p, s)


# ------------------------------------------------------------------ memory
D, LAYERS, ROWS, N = 128, 16, 2, 8
GRAD_BYTES = LAYERS * (D * D + D) * 4
STATE_BYTES = 2 * GRAD_BYTES // N   # Adam's mu and nu, fp32 params own master
# Both stages all-gather the new weights; small gather buckets keep the
# gather path's bucketing out of what is measured (the gradient path).
GATHER = 1 << 16


def mlp_params():
  r = np.random.default_rng(0)
  return {f"l{i}": {"w": jnp.asarray(r.normal(size=(D, D)) * 0.05, jnp.float32),
                    "b": jnp.zeros(D, jnp.float32)} for i in range(LAYERS)}


def mlp_loss(p, b):
  h = b["x"]
  for i in range(LAYERS):
    h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
  return jnp.mean(jnp.square(h))


def floor_peak() -> int:
  """fwd + bwd + local SGD, no communication (donating, as the steps do)."""
  msh = mesh(N)

  def per_device(p, b):
    g = jax.grad(mlp_loss)(p, b)
    return jax.tree.map(lambda x, y: x - 1e-3 * y, p, g)

  f = jax.jit(jax.shard_map(per_device, mesh=msh, in_specs=(P(), P("data")),
                            out_specs=P(), check_vma=False), donate_argnums=0)
  p = jax.device_put(mlp_params(), NamedSharding(msh, P()))
  b = jax.device_put({"x": np.ones((N * ROWS, D), np.float32)},
                     NamedSharding(msh, P("data")))
  return z1.inspect.memory(f, p, b)["peak"]


@pytest.fixture(scope="module")
def peaks():
  out = {"floor": floor_peak()}
  for name, make, accum in (("zero1", z1.zero1, 4), ("zero2", z1.zero2, 1),
                            ("zero2", z1.zero2, 4)):
    tx = make(optax.adam(1e-3), axis_name="data", gather_bucket_bytes=GATHER)
    p, s = z1.init(tx, mlp_params(), mesh(N))
    b = {"x": np.ones((N * ROWS * accum, D), np.float32)}
    step = z1.train_step(mlp_loss, tx, mesh(N), grad_accum_steps=accum)
    out[name, accum] = z1.inspect.memory(step, p, s, b)["peak"]
  return out


def test_accumulating_shards_saves_most_of_a_gradient_tree(peaks):
  # Measured: stage 1 - stage 2 = 0.81 x GRAD_BYTES (need 0.7; the ideal is
  # 1 - 1/N = 0.875: stage 1's full accumulator against stage 2's shard).
  saved = peaks["zero1", 4] - peaks["zero2", 4]
  assert saved >= 0.8 * (1 - 1 / N) * GRAD_BYTES, (saved, GRAD_BYTES)


def test_no_full_gradient_tree_alive_without_accumulation(peaks):
  # Measured: floor + state + 0.02 x GRAD_BYTES (stage 1 too, since its
  # large leaves are reduce-scattered in place; before that it was + 1.86 x).
  bound = peaks["floor"] + STATE_BYTES + 0.3 * GRAD_BYTES
  assert peaks["zero2", 1] <= bound, (peaks, GRAD_BYTES)


# -------------------------------------------------------------- deepspeed
def test_deepspeed_stage2_config_builds_zero2_and_matches_stage1():
  def cfg(stage):
    return {"train_batch_size": 32, "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.5,
            "fp16": {"enabled": True, "initial_scale_power": 8},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}

  params = float_part(odd_params())
  runs = []
  for stage in (1, 2):
    e = z1.initialize(cfg(stage), loss_fn=exact_loss, params=params,
                      mesh=mesh(4))
    assert e.tx.config.stage == stage
    ms = [e.train_batch(b) for b in exact_batches(3, size=32)]
    runs.append((e.params, e.opt_state, ms))
  assert_same_run(runs[1], runs[0], "deepspeed stage 2 vs 1 ")


# ---------------------------------------------------------------- overlap
def test_in_backward_reduce_scatters_have_backward_compute_beside_them():
  """Stage 1's one bucket waits for the whole backward; each of stage 2's
  per-leaf reduce-scatters leaves other layers' gradient dots independent of
  it (z1.inspect.overlap), which a latency-hiding scheduler can hide it behind."""
  d, layers, n = 64, 4, 4
  params = {f"l{i}": {"w": jnp.full((d, d), 0.01 * (i + 1)), "b": jnp.zeros(d)}
            for i in range(layers)}

  def loss(p, b):
    h = b["x"]
    for i in range(layers):
      h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
    return jnp.mean(jnp.square(h))

  flops = {}
  for make in (z1.zero1, z1.zero2):
    # Stage 1: one packed bucket; stage 2: every leaf on its own.
    tx = make(optax.adam(1e-3), axis_name="data",
              inplace_bytes=0 if make is z1.zero2 else None)
    p, s = z1.init(tx, params, mesh(n))
    b = {"x": np.ones((2 * n, d), np.float32)}
    rs = [r for r in z1.inspect.overlap(z1.train_step(loss, tx, mesh(n)), p, s, b)
          if r.kind == "reduce-scatter"]
    flops[make.__name__] = [r.independent_flops for r in rs]
  # Stage 1's bucket takes every gradient, so every dot feeds it: nothing
  # independent (it read one dot, 16384 flops, until the parser stopped
  # dropping XLA's every 5th operand). Stage 2, measured (jax 0.10, CPU):
  # 7 down to 4 row-block dots (2 rows x d x d each) beside each scatter.
  dot = 2 * 2 * d * d
  assert len(flops["zero1"]) == 1 and len(flops["zero2"]) == 2 * layers
  assert flops["zero1"] == [0] and min(flops["zero2"]) >= 3 * dot, flops


def test_small_leaves_share_a_collective_large_ones_go_alone():
  params = {"big": jnp.zeros((64, 33)), "s1": jnp.zeros(7), "s2": jnp.zeros((3, 5)),
            "s3": jnp.zeros(9), "g": jnp.zeros(()), "h": jnp.zeros(()),
            "i": jnp.zeros(3, jnp.int32)}
  layout = z1.plan(params, 4)
  names = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(params)[0]]
  def groups(order=None, **kw):
    cfg = z1.zero2(optax.sgd(1.0), axis_name="data", **kw).config
    return [[names[i] for i in g] for g in zero2.hook_groups(layout, cfg, order)]
  # Leaves are reduced in the order the backward completes them: the reverse
  # of the loss's first reads (tree order by default: big, g, h, i, s1, s2,
  # s3). big: 4 x 16 x 33 x 4 bytes >= 1024 alone; the small ones (all N
  # padded pieces: s3 4x3, s2 4x5, s1 4x2 floats = 48 + 80 + 32 bytes) packed
  # up to bucket_bytes; scalars together.
  assert groups(inplace_bytes=1024, bucket_bytes=120) == [
      ["['s3']"], ["['s2']", "['s1']"], ["['big']"], ["['h']", "['g']"]]
  # A loss that reads s1, s2, s3 and then big completes big first.
  reads = tuple(names.index(f"['{k}']") for k in ("s1", "s2", "s3", "big", "g", "h", "i"))
  assert groups(reads, inplace_bytes=1024, bucket_bytes=120) == [
      ["['big']"], ["['s3']"], ["['s2']", "['s1']"], ["['h']", "['g']"]]
  # None packs every leaf (as stage 1's layout.plan_buckets); "auto" is
  # 64 KiB for stage 2 on any backend.
  assert groups(inplace_bytes=None) == [
      ["['s3']", "['s2']", "['s1']", "['big']"], ["['h']", "['g']"]]
  assert groups() == groups(inplace_bytes=1 << 16) == [
      ["['s3']", "['s2']", "['s1']", "['big']"], ["['h']", "['g']"]]
  assert groups(inplace_bytes=0) == [
      ["['s3']"], ["['s2']"], ["['s1']"], ["['big']"], ["['h']", "['g']"]]


def test_plain_jit_update_says_stage2_trains_as_stage1():
  """Stage 2 is a hook in the backward (z1.train_step, z1.value_and_grad);
  handed jax.grad's gradients in a TrainState / nnx.Optimizer loop, zero2
  reduces after the backward, as zero1: same weights, and its update says
  so (it said nothing). With z1.value_and_grad's gradients, or zero1,
  nothing is said."""
  import warnings
  params = {"w": jnp.full((8, 3), 0.5), "b": jnp.zeros(3)}
  f = lambda p, x: jnp.mean(x @ p["w"] + p["b"])
  x = jnp.ones((8, 8))
  with jax.set_mesh(mesh(4)):
    tx = z1.zero2(optax.adam(1e-2), axis_name="data")
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      state = tx.init(params)
      tx.update(z1.grad(f, tx)(params, x), state, params)
    with pytest.warns(UserWarning, match=r"z1.zero2 in plain jax.jit .* "
                      r"trains as z1.zero1.*For stage 2 here, take the "
                      r"gradients from z1.value_and_grad"):
      tx.update(jax.grad(f)(params, x), state, params)
    tx1 = z1.zero1(optax.adam(1e-2), axis_name="data")
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      tx1.update(jax.grad(f)(params, x), tx1.init(params), params)
