"""fp16 dynamic loss scaling with DeepSpeed's semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero1_jax as z1
from helpers import batch, float_part, loss_fn, mesh, odd_params


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
    for a, b_ in zip(jax.tree.leaves(p), jax.tree.leaves(before_p)):
      np.testing.assert_array_equal(np.asarray(a), b_)
    for a, b_ in zip(jax.tree.leaves((s.master, s.inner)),
                     jax.tree.leaves((before_s.master, before_s.inner))):
      np.testing.assert_array_equal(np.asarray(a), b_)
  assert scales == [2.0 ** 8, 2.0 ** 7, 2.0 ** 6]
  p, s, m = step(p, s, ok)
  assert not bool(m["skipped"])
  assert int(s.inner[0].count) == 2


def test_fp16_training_matches_fp32_master_reference():
  """With no overflow, loss scaling is invisible: powers of two divide out."""
  from helpers import master_run
  params = odd_params(jnp.float16)
  bs = [batch(16, seed=i, dtype=np.float16) for i in range(5)]
  tx = z1.zero1(optax.adam(1e-2), axis_name="data",
                loss_scale=z1.StaticLossScale(1024.0))
  p, s = z1.init(tx, params, mesh(1))
  step = z1.train_step(loss_fn, tx, mesh(1))
  for b in bs:
    p, s, m = step(p, s, b)
  ref = master_run(optax.adam(1e-2), params, bs)
  for a, b_ in zip(jax.tree.leaves(float_part(p)), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b_, np.float32),
                               rtol=2e-3, atol=2e-3)


def test_bad_scaler_settings():
  with pytest.raises(ValueError, match="loss_scale_window"):
    z1.DynamicLossScale(loss_scale_window=0)
  with pytest.raises(ValueError, match="hysteresis"):
    z1.DynamicLossScale(hysteresis=0)
  with pytest.raises(ValueError, match="loss scale must be > 0"):
    z1.StaticLossScale(0.0)
