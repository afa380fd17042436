"""fp16 dynamic loss scaling with DeepSpeed's semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero1_jax as z1
from helpers import (assert_close, assert_equal, assert_ulps, batch,
                     exact_batches, exact_loss, float_part, loss_fn,
                     master_run, mesh, odd_params, stored_master)
from tolerances import FP16_UNSCALED_REF


class DeepSpeedScaler:
  """DeepSpeed's DynamicLossScaler.update_scale, transcribed as plain Python
  (deepspeed/runtime/fp16/loss_scaler.py) to check our jitted version."""

  def __init__(self, power, window, hysteresis, consecutive, min_scale):
    self.scale, self.window, self.delayed = 2.0 ** power, window, hysteresis
    self.hyst, self.consecutive, self.min = hysteresis, consecutive, min_scale
    self.it, self.last = 0, -1

  def update(self, overflow):
    if overflow:
      if self.delayed == 1 or self.hyst == 1:
        self.scale = max(self.scale / 2, self.min)
      else:
        self.hyst -= 1
      self.last = self.it
    else:
      if self.consecutive:
        self.hyst = self.delayed
      stable = self.it - self.last - 1
      if stable > 0 and stable % self.window == 0:
        if not self.consecutive:
          self.hyst = self.delayed
        self.scale *= 2
    self.it += 1


@pytest.mark.parametrize("hysteresis,consecutive", [(1, False), (2, False),
                                                    (3, True), (2, True)])
def test_loss_scale_follows_deepspeed_sequence(hysteresis, consecutive):
  cfg = z1.DynamicLossScale(initial_scale_power=5, loss_scale_window=3,
                            hysteresis=hysteresis,
                            consecutive_hysteresis=consecutive, min_loss_scale=2.0)
  ref = DeepSpeedScaler(5, 3, hysteresis, consecutive, 2.0)
  rng = np.random.default_rng(hysteresis)
  overflows = rng.random(200) < 0.3
  overflows[:3] = True          # reach the minimum scale early
  update = jax.jit(cfg.update)
  state = cfg.init()
  for o in overflows:
    state = update(state, o)
    ref.update(bool(o))
    assert float(state.scale) == ref.scale
    assert int(state.hysteresis) == ref.hyst


def overflow_loss(params, b):
  # b["boom"] is 1 on exactly one device's rows: that device's loss is inf.
  return loss_fn(params, b) * jnp.where(jnp.any(b["boom"] > 0), jnp.inf, 1.0)


def test_fp16_overflow_on_one_device_skips_the_step_everywhere():
  n = 4
  params = odd_params(jnp.float16)
  default = z1.zero1(optax.adam(1e-2), axis_name="data")
  assert default.loss_scaler(params) == z1.DynamicLossScale()  # fp16 -> dynamic
  assert float(z1.DynamicLossScale().init().scale) == 2.0 ** 16  # DeepSpeed's
  # 2^16 overflows this fp16 model's backward (as in DeepSpeed's first steps).
  tx = z1.zero1(optax.adam(1e-2), axis_name="data",
                loss_scale=z1.DynamicLossScale(initial_scale_power=8))
  p, s = z1.init(tx, params, mesh(n))
  step = z1.train_step(overflow_loss, tx, mesh(n))
  b = batch(16, dtype=np.float16)
  ok = {**b, "boom": np.zeros(16, np.float32)}
  boom = {**b, "boom": np.zeros(16, np.float32)}
  boom["boom"][8:12] = 1                               # device 2 only

  p, s, m = step(p, s, ok)
  assert not bool(m["skipped"])
  before_p = jax.tree.map(np.asarray, p)
  before_s = jax.tree.map(np.asarray, s)
  scales = []
  for _ in range(3):     # hysteresis 2: keep, then halve, then halve
    p, s, m = step(p, s, boom)
    assert bool(m["skipped"])
    scales.append(float(s.loss_scale.scale))
    assert_equal(p, before_p, "skipped step params ")
    assert_equal((s.master, s.inner), (before_s.master, before_s.inner),
                 "skipped step state ")
  assert scales == [2.0 ** 8, 2.0 ** 7, 2.0 ** 6]
  p, s, m = step(p, s, ok)
  assert not bool(m["skipped"])
  assert int(s.inner[0].count) == 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_nan_batch_is_applied_as_in_optax_or_skipped_when_asked(dtype):
  """One NaN row on device 1 of 4. Default: the step is applied, as optax
  applies it (the metrics show it: grad_norm nan, skipped 0). With
  ``NoLossScale(skip_nonfinite=True)`` (what the README points to, and what
  DeepSpeed's fp32 / bf16 ZeRO-1 does) nothing changes on any device, and the
  next finite step equals a run that never saw the NaN batch, bitwise."""
  n, params = 4, odd_params(dtype)
  good = [batch(16, seed=s, dtype=dtype) for s in (1, 2)]
  nan = batch(16, seed=3, dtype=dtype)
  nan["x"][5, 0] = np.nan
  runs = {}
  for skip in (False, True):
    tx = z1.zero1(optax.adam(1e-2), axis_name="data",
                  loss_scale=z1.NoLossScale(skip_nonfinite=skip))
    step = z1.train_step(loss_fn, tx, mesh(n))
    p, s = z1.init(tx, params, mesh(n))
    p, s, _ = step(p, s, good[0])
    p, s, m = step(p, s, nan)
    assert np.isnan(float(m["grad_norm"])) and bool(m["skipped"]) == skip
    runs[skip] = step(p, s, good[1])[:2]
    # where no metrics come back (plain jit), the state says which step was
    # skipped: DeepSpeed's cur_iter and last_overflow_iter
    ls = runs[skip][1].loss_scale
    assert (int(ls.step), int(ls.last_overflow)) == (3, 1 if skip else -1)
  assert np.isnan(np.asarray(runs[False][0]["dense"]["kernel"], np.float32)).all()
  # The same program without the NaN batch (another program may contract
  # Adam's moment update into an FMA differently: 1 ulp in mu).
  p, s = z1.init(tx, params, mesh(n))
  for b in good:
    p, s, _ = step(p, s, b)
  assert_equal(runs[True][0], p, "params ")
  assert_equal(runs[True][1].inner, s.inner, "inner state ")


def test_fp16_training_matches_fp32_master_reference():
  """With no overflow, loss scaling is invisible: powers of two divide out."""
  params = odd_params(jnp.float16)
  bs = [batch(16, seed=i, dtype=np.float16) for i in range(5)]
  tx = z1.zero1(optax.adam(1e-2), axis_name="data",
                loss_scale=z1.StaticLossScale(1024.0))
  p, s = z1.init(tx, params, mesh(1))
  step = z1.train_step(loss_fn, tx, mesh(1))
  for b in bs:
    p, s, m = step(p, s, b)
  ref = master_run(optax.adam(1e-2), params, bs)
  # One device, scale 2^10: the scaled fp16 gradients are the reference's
  # times 2^10 exactly, so the run is bitwise the reference (measured: equal).
  assert_equal(float_part(p), ref, "fp16 adam N=1 ")


def fp16_scale(kind):
  if kind == "static":
    return z1.StaticLossScale(1024.0)
  # Grows x2 every 2 clean steps, halves on the overflow (hysteresis 1).
  return z1.DynamicLossScale(initial_scale_power=8, loss_scale_window=2,
                             hysteresis=1)


def overflow_exact_loss(params, b):
  return exact_loss(params, b) * jnp.where(jnp.any(b["boom"] > 0), jnp.inf, 1.0)


@pytest.mark.parametrize("model,kind,n,reduce", [
    ("tanh", "static", 1, "reduce_scatter"), ("tanh", "dynamic", 1, "reduce_scatter"),
    ("tanh", "dynamic", 4, "all_reduce"),
    ("exact", "static", 4, "reduce_scatter"), ("exact", "dynamic", 4, "all_reduce"),
    ("exact", "dynamic", 8, "reduce_scatter")])
def test_fp16_sgd_matches_fp32_master_reference(model, kind, n, reduce):
  """SGD's update is proportional to the gradient, so a loss scale not divided
  out (x128..x1024), divided twice, or taken from the wrong step shows at
  once; Adam, nearly invariant to a constant gradient scale, would hide it.
  The dynamic runs also overflow once on one device: that step must be
  skipped (the reference never sees it) and the scale halved after it.

  Tolerances: ``exact`` (exact_loss: dyadic gradients, exact in fp16 at any
  N and scale) must be bitwise the reference, master and params. ``tanh``
  at N=1: the fp16 params come out bitwise (measured 0 ulps; bound 1 ulp)
  and the fp32 master within ``FP16_UNSCALED_REF`` (derived there: the
  unscaled reference gradients lose bits to fp16 subnormals that the scaled
  ones keep; measured 5.2e-7 on AVX-512 code, 1.03e-6 on AVX2). ``tanh``
  at N=4 computes fp16 gradients on 4 rows and sums them over devices in
  fp16, each rounding 2^-11 relative, where the reference does one fp16
  backward on 16 rows: after 5 SGD steps (momentum 0.9) the master differs
  by 4.1e-3 of a leaf's largest weight and the params by 4.2e-3 (measured;
  the worst leaf has small weights); bound 5e-3 for both. A scale left in
  the gradients is off by a factor >= 128."""
  params = odd_params(jnp.float16)
  if model == "tanh":
    loss, ref_loss = overflow_loss, loss_fn
    data = [batch(16, seed=i, dtype=np.float16) for i in range(6)]
  else:
    loss, ref_loss = overflow_exact_loss, exact_loss
    data = exact_batches(6)
  bs = [{**b, "boom": np.zeros(16, np.float32)} for b in data]
  if kind == "dynamic":
    bs[2]["boom"][8:12] = 1            # rows of one device (N=4: device 2)
  tx = z1.zero1(optax.sgd(0.1, momentum=0.9), axis_name="data",
                loss_scale=fp16_scale(kind), reduce=reduce)
  p, s = z1.init(tx, params, mesh(n))
  step = z1.train_step(loss, tx, mesh(n))
  used, skipped = [], []
  for b in bs:
    p, s, m = step(p, s, b)
    used.append(float(m["loss_scale"]))
    skipped.append(bool(m["skipped"]))
  if kind == "static":
    assert used == [1024.0] * 6 and not any(skipped)
  else:
    assert used == [256.0, 256.0, 256.0, 128.0, 128.0, 128.0]
    assert skipped == [False, False, True, False, False, False]
  clean = [b for b, k in zip(bs, skipped) if not k]
  run = lambda **kw: master_run(optax.sgd(0.1, momentum=0.9), params, clean,
                                loss=ref_loss, **kw)
  ref, ref_master = run(), run(return_master=True)
  what = f"fp16 {model} {kind} {reduce} N={n} "
  if model == "exact":
    assert_equal(stored_master(p, s), ref_master, what + "master ")
    assert_equal(float_part(p), ref, what)
  elif n == 1:
    assert_close(stored_master(p, s), ref_master, FP16_UNSCALED_REF,
                 what + "master ")
    assert_ulps(float_part(p), ref, 1, what)
  else:
    assert_close(stored_master(p, s), ref_master, 5e-3, what + "master ")
    assert_close(float_part(p), ref, 5e-3, what)


def mean_x_loss(params, b):
  """Every parameter element's gradient is this device's mean of b["x"]."""
  return sum(jnp.sum(v.astype(jnp.float32)) for v in jax.tree.leaves(params)
             ) * jnp.mean(b["x"])


@pytest.mark.parametrize("stage,reduce,inplace,accum", [
    (1, "reduce_scatter", None, 1), (1, "reduce_scatter", 0, 1),
    (2, "reduce_scatter", None, 1), (2, "reduce_scatter", 0, 2),
    (1, "all_reduce", None, 1), (2, "all_reduce", 0, 1)])
def test_fp16_sum_overflows_only_where_deepspeed_overflows(stage, reduce,
                                                           inplace, accum):
  """DeepSpeed's ZeRO-1/2 reduce-scatter path divides each fp16 bucket by N
  before summing it (stage_1_and_2.py:1687-1688, 0.19.8), so a step skips
  only if the *mean* overflows fp16; its ``reduce_scatter: false`` path sums
  first (:1498-1506). Every device's gradient is 20000 (fp16's max is
  65504): the sum over 4 devices, 80000, overflows; the mean does not.
  Packed and in-place buckets, the fp16 scalar's psum, stage 2's hooks and
  its 16-bit accumulation all take the rule. The numbers are dyadic, so the
  applied step is exact: master = 1 - 2^-16 * 20000."""
  n = 4
  params = {"a": jnp.ones((7, 5), jnp.float16), "s": jnp.ones((), jnp.float16),
            "big": jnp.ones((128, 256), jnp.float16)}   # 64 KiB: in place at 0
  make = z1.zero2 if stage == 2 else z1.zero1
  tx = make(optax.sgd(2.0 ** -16), axis_name="data", reduce=reduce,
            loss_scale=z1.StaticLossScale(1.0), inplace_bytes=inplace)
  p, s = z1.init(tx, params, mesh(n))
  step = z1.train_step(mean_x_loss, tx, mesh(n), grad_accum_steps=accum)
  x = np.full((8 * accum, 3), 20000, np.float16)
  p, s, m = step(p, s, {"x": x})
  if reduce == "all_reduce":
    assert bool(m["skipped"]) and np.isinf(float(m["grad_norm"]))
    assert_equal(p, params, "skipped ")
    return
  assert not bool(m["skipped"])
  want = np.float32(1) - np.float32(2.0 ** -16 * 20000)
  assert_equal(stored_master(p, s),
               {k: np.full(v.shape, want, np.float32) for k, v in params.items()},
               "master ")


def test_bad_scaler_settings():
  with pytest.raises(ValueError, match="loss_scale_window"):
    z1.DynamicLossScale(loss_scale_window=0)
  with pytest.raises(ValueError, match="hysteresis"):
    z1.DynamicLossScale(hysteresis=0)
  with pytest.raises(ValueError, match="loss scale must be > 0"):
    z1.StaticLossScale(0.0)
