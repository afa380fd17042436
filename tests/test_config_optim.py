"""Specification of the DeepSpeed optimizer and scheduler sections
(zero1_jax.deepspeed.optim, .schedules): each optimizer against torch's /
DeepSpeed's update rule and each schedule against DeepSpeed's formula,
written out by hand (docs/deepspeed_config.md cites the source files).
"""
import logging
import math
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from zero1_jax.deepspeed.optim import build_optimizer
from zero1_jax.deepspeed.schedules import build_schedule
from helpers import config_error as err, fresh_ds_notes, load

fresh_ds_notes = fresh_ds_notes   # autouse fixture (helpers.py)


# ----------------------------------------------------------------- optimizers
def opt_cfg(type_, stage=0, sched=None, **params):
  d = {"train_batch_size": 8, "zero_optimization": {"stage": stage},
       "optimizer": {"type": type_, "params": params}}
  if sched:
    d["scheduler"] = sched
  return load(d)


def run(cfg, grads, p0):
  """Apply build_optimizer(cfg) for each gradient; returns params per step."""
  tx = build_optimizer(cfg.optimizer, cfg.scheduler)
  p = {"w": jnp.asarray(p0, jnp.float32)}
  state, out = tx.init(p), []
  for g in grads:
    u, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, p)
    p = {"w": p["w"] + u["w"]}
    out.append(np.asarray(p["w"]))
  return out, state


P0 = np.array([1.0, -2.0, 0.5])
GRADS = [np.array([0.5, 0.25, -1.0]), np.array([-0.3, 0.8, 0.1]),
         np.array([0.2, -0.6, 0.4])]


def ref_adam(lr, b1, b2, eps, wd, decoupled, bias_correction=True):
  """torch.optim.Adam / AdamW and DeepSpeed FusedAdam, one param group."""
  p, m, v, out = P0.copy(), 0 * P0, 0 * P0, []
  for t, g in enumerate(GRADS, 1):
    if not decoupled:
      g = g + wd * p
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1, 1)
    step = (m / bc1) / (np.sqrt(v / bc2) + eps)
    p = p - lr * (step + (wd * p if decoupled else 0))
    out.append(p)
  return out


@pytest.mark.parametrize("type_,params,decoupled,wd", [
    ("Adam", {"weight_decay": 0.1}, True, 0.1),  # adam_w_mode defaults True
    ("Adam", {"weight_decay": 0.1, "adam_w_mode": False}, False, 0.1),
    ("Adam", {"weight_decay": 0.1, "torch_adam": True, "adam_w_mode": False},
     False, 0.1),
    ("AdamW", {"weight_decay": 0.1, "adam_w_mode": False}, True, 0.1),
    ("AdamW", {"torch_adam": True}, True, 0.01),  # torch.optim.AdamW default
    ("adamw", {}, True, 0.0),                      # FusedAdam default wd = 0
])
def test_adam_weight_decay_modes(type_, params, decoupled, wd):
  got, state = run(opt_cfg(type_, lr=0.1, **params), GRADS, P0)
  np.testing.assert_allclose(got, ref_adam(0.1, 0.9, 0.999, 1e-8, wd,
                                           decoupled), rtol=1e-5, atol=1e-6)
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.1)


def test_adam_without_bias_correction():
  got, _ = run(opt_cfg("Adam", lr=0.01, bias_correction=False,
                       betas=[0.8, 0.9]), GRADS, P0)
  np.testing.assert_allclose(got, ref_adam(0.01, 0.8, 0.9, 1e-8, 0.0, True,
                                           bias_correction=False), rtol=1e-5)


def test_sgd_torch_semantics():
  lr, mom, damp, wd = 0.1, 0.9, 0.1, 0.01
  p, buf, want = P0.copy(), None, []
  for g in GRADS:  # torch.optim.SGD: L2 decay, buffer starts at g
    g = g + wd * p
    buf = g if buf is None else mom * buf + (1 - damp) * g
    p = p - lr * buf
    want.append(p)
  got, _ = run(opt_cfg("SGD", lr=lr, momentum=mom, dampening=damp,
                       weight_decay=wd), GRADS, P0)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  p, buf, want = P0.copy(), None, []
  for g in GRADS:
    buf = g if buf is None else mom * buf + g
    p = p - lr * (g + mom * buf)  # nesterov
    want.append(p)
  got, _ = run(opt_cfg("SGD", lr=lr, momentum=mom, nesterov=True), GRADS, P0)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  err({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {
      "nesterov": True}}}, "Nesterov momentum requires a momentum")


def test_adagrad_torch_semantics():
  lr, lr_decay, wd, acc0, eps = 0.1, 0.5, 0.01, 0.1, 1e-10
  p, acc, want = P0.copy(), np.full(3, acc0), []
  for step, g in enumerate(GRADS, 1):
    g = g + wd * p
    acc = acc + g * g
    p = p - lr / (1 + (step - 1) * lr_decay) * g / (np.sqrt(acc) + eps)
    want.append(p)
  got, _ = run(opt_cfg("Adagrad", lr=lr, lr_decay=lr_decay, weight_decay=wd,
                       initial_accumulator_value=acc0), GRADS, P0)
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("centered", [False, True])
def test_rmsprop_torch_semantics(centered):
  lr, alpha, eps, mom = 0.01, 0.9, 1e-8, 0.5
  p, sq, ga, buf, want = P0.copy(), 0 * P0, 0 * P0, 0 * P0, []
  for g in GRADS:
    sq = alpha * sq + (1 - alpha) * g * g
    ga = alpha * ga + (1 - alpha) * g
    avg = np.sqrt(sq - ga * ga if centered else sq) + eps
    buf = mom * buf + g / avg
    p = p - lr * buf
    want.append(p)
  got, _ = run(load({"train_batch_size": 8, "optimizer": {
      "type": "RMSprop", "params": {"lr": lr, "alpha": alpha, "momentum": mom,
                                    "centered": centered}}}), GRADS, P0)
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_lion_decoupled_weight_decay_and_deepspeed_betas():
  lr, wd, b1, b2 = 0.01, 0.1, 0.9, 0.999  # FusedLion default betas
  p, m, want = P0.copy(), 0 * P0, []
  for g in GRADS:
    c = b1 * m + (1 - b1) * g
    p = p * (1 - lr * wd) - lr * np.sign(c)
    m = b2 * m + (1 - b2) * g
    want.append(p)
  got, _ = run(opt_cfg("Lion", lr=lr, weight_decay=wd), GRADS, P0)
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("type_,needle", [
    ("Lamb", "needs an elementwise optimizer"),
    ("Muon", "needs an elementwise optimizer"),
    # 0.19.8 has no 1-bit optimizers: the name is a torch.optim lookup that fails
    ("OneBitAdam", "unknown or unsupported optimizer.type='OneBitAdam'"),
    ("MuAdam", "width multipliers"),
    ("Adafactor", "supported: Adam, AdamW, SGD, Adagrad, Lion, RMSprop"),
    ("sgd", "did you mean 'SGD'"),
])
def test_unsupported_optimizer_types(type_, needle):
  err({"train_batch_size": 8, "optimizer": {"type": type_}}, needle)


def test_optimizer_param_rules(caplog):
  d = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {}}}
  d["optimizer"]["params"] = {"max_grad_norm": 1.0}
  err(d, "'max_grad_norm' is not supported as an optimizer parameter")
  d["optimizer"]["params"] = {"amsgrad": True}
  err(d, "AMSGrad")
  d["optimizer"]["params"] = {"betta": [0.9, 0.99]}
  err(d, "unknown key 'betta' in section 'optimizer.params'")
  d["optimizer"]["params"] = {"bias_correction": False, "torch_adam": True}
  err(d, "unknown key 'bias_correction'")
  d["optimizer"]["params"] = {"lr": "auto"}
  err(d, "optimizer.params.lr is 'auto', which must be filled in")
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    opt_cfg("Adam", set_grad_none=True)
  assert caplog.text.count("optimizer.params.set_grad_none") == 1


def test_untested_zero_optimizer_needs_explicit_opt_in():
  err({"train_batch_size": 8, "zero_optimization": {"stage": 1},
       "optimizer": {"type": "SGD"}}, "You are using an untested ZeRO "
      "Optimizer. Please add <\"zero_allow_untested_optimizer\": true>")
  assert load({"train_batch_size": 8, "zero_optimization": {"stage": 1},
               "zero_allow_untested_optimizer": True,
               "optimizer": {"type": "RMSprop"}}).optimizer.type == "RMSprop"
  assert opt_cfg("SGD", stage=0).optimizer.type == "SGD"
  assert opt_cfg("Adagrad", stage=1).optimizer.type == "Adagrad"


# ----------------------------------------------------------------- schedules
def sched(type_, **params):
  return load({"train_batch_size": 8, "scheduler": {"type": type_,
                                                    "params": params}}).scheduler


def values(s, steps, base_lr=0.0):
  f = build_schedule(s, base_lr)
  return [float(f(c)) for c in steps]


# Convention: value at count c = lr DeepSpeed uses for the c-th update (0-based)
# = get_lr() after c calls of scheduler.step(), i.e. last_batch_iteration c-1.
def test_warmup_lr_log_default():
  s = sched("WarmupLR", warmup_min_lr=0.0, warmup_max_lr=0.01,
            warmup_num_steps=10)
  # 0.01 * ln(c)/ln(10) for 1 <= c <= 10, then 0.01
  want = [0.0, 0.0, 0.0030102999566, 0.0069897000433, 0.01, 0.01]
  np.testing.assert_allclose(values(s, [0, 1, 2, 5, 10, 11]), want,
                             rtol=1e-6, atol=1e-9)


def test_warmup_lr_linear_and_max_from_optimizer_lr():
  s = sched("WarmupLR", warmup_min_lr=0.001, warmup_num_steps=4,
            warmup_type="linear")
  want = [0.001, 0.001, 0.0035, 0.006, 0.0085, 0.011, 0.011]
  np.testing.assert_allclose(values(s, range(7), base_lr=0.011), want,
                             rtol=1e-6)
  one = sched("WarmupLR", warmup_max_lr=1.0, warmup_num_steps=1)  # max(2, 1)
  np.testing.assert_allclose(values(one, [1, 2, 3]), [0.0, 1.0, 1.0], atol=1e-7)


def test_warmup_decay_lr():
  s = sched("WarmupDecayLR", total_num_steps=20, warmup_min_lr=0.0,
            warmup_max_lr=0.1, warmup_num_steps=5, warmup_type="linear")
  want = [0.0, 0.0, 0.04, 0.1, 0.0666666667, 0.0066666667, 0.0, 0.0]
  np.testing.assert_allclose(values(s, [0, 1, 3, 6, 11, 20, 21, 30]), want,
                             rtol=1e-6, atol=1e-9)
  # total_num_steps < warmup_num_steps: full warmup, then straight to 0
  short = sched("WarmupDecayLR", total_num_steps=100)  # 1000 warmup steps
  np.testing.assert_allclose(values(short, [1000, 1001], base_lr=5.0),
                             [0.001, 0.0], atol=1e-9)
  err({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR"}},
      "scheduler.params.total_num_steps is required")


def test_warmup_decay_lr_default_max_is_0_001_not_optimizer_lr():
  s = sched("WarmupDecayLR", total_num_steps=2000, warmup_num_steps=10)
  assert values(s, [11], base_lr=5.0)[0] == pytest.approx(0.001, rel=1e-6)


def test_warmup_cosine_lr():
  s = sched("WarmupCosineLR", total_num_steps=12, warmup_num_steps=4,
            warmup_min_ratio=0.2, cos_min_ratio=0.01, warmup_type="linear")
  # lr = 0.1 * ratio; step 0 runs at 0.0 (DeepSpeed's get_lr before step())
  want = [0.0, 0.02, 0.06, 0.096232036859, 0.0315571700962, 0.001, 0.001]
  np.testing.assert_allclose(values(s, [0, 1, 3, 5, 9, 12, 20], base_lr=0.1),
                             want, rtol=1e-5, atol=1e-9)
  log = sched("WarmupCosineLR", total_num_steps=12, warmup_num_steps=4,
              warmup_min_ratio=0.2)
  assert values(log, [2], base_lr=0.1)[0] == pytest.approx(0.06, rel=1e-6)


def test_one_cycle_lr_and_momentum():
  cfg = load({"train_batch_size": 8,
              "optimizer": {"type": "Adam", "params": {"lr": 1.0}},
              "scheduler": {"type": "OneCycle", "params": {
                  "cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                  "cycle_first_step_size": 4, "cycle_second_step_size": 6,
                  "decay_lr_rate": 0.5, "decay_step_size": 2,
                  "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}}})
  want = [0.01, 0.055, 0.1, 0.055, 0.01, 0.008, 0.005]
  steps = [0, 2, 4, 7, 10, 11, 14]
  np.testing.assert_allclose(values(cfg.scheduler, steps), want, rtol=1e-5)
  # beta1 is cycled inversely (step 0 keeps cycle_min_mom), beta2 := 0.99
  tx = build_optimizer(cfg.optimizer, cfg.scheduler)
  p = {"w": jnp.ones(2)}
  state, b1 = tx.init(p), []
  for _ in range(12):
    _, state = tx.update({"w": jnp.ones(2)}, state, p)
    b1.append(float(state.hyperparams["b1"]))
  np.testing.assert_allclose([b1[i] for i in (0, 2, 4, 7, 11)],
                             [0.85, 0.90, 0.85, 0.90, 0.95], rtol=1e-6)


def test_one_cycle_staircase():
  s = sched("OneCycle", cycle_min_lr=0.0, cycle_max_lr=1.0,
            cycle_first_step_size=4, cycle_first_stair_count=2)
  np.testing.assert_allclose(values(s, range(7)),
                             [0, 0, 0.5, 0.5, 1.0, 0.5, 0.5], atol=1e-6)


def test_lr_range_test():
  s = sched("LRRangeTest", lr_range_test_min_lr=0.001,
            lr_range_test_step_size=4, lr_range_test_step_rate=2.0)
  np.testing.assert_allclose(values(s, [0, 2, 4]), [0.001, 0.002, 0.003],
                             rtol=1e-6)
  st = sched("LRRangeTest", lr_range_test_min_lr=0.001,
             lr_range_test_step_size=4, lr_range_test_step_rate=2.0,
             lr_range_test_staircase=True)
  np.testing.assert_allclose(values(st, [0, 2, 4]), [0.001, 0.001, 0.003],
                             rtol=1e-6)


def test_scheduler_drives_injected_learning_rate():
  cfg = load({"train_batch_size": 8,
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              "scheduler": {"type": "WarmupLR", "params": {
                  "warmup_num_steps": 4, "warmup_type": "linear"}}})
  got, state = run(cfg, [np.ones(3)] * 3, np.zeros(3))
  # lrs for updates 0,1,2: 0, 0, 0.5*1/4 (warmup_max_lr = optimizer lr)
  np.testing.assert_allclose([g[0] for g in got], [0.0, 0.0, -0.125], atol=1e-7)
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.125)


def test_scheduler_validation():
  err({"train_batch_size": 8, "scheduler": {"type": "StepLR"}},
      "supported: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle")
  err({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {
      "warmup_num_steps": 0}}}, "warmup_num_steps must be a positive integer")
  err({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {
      "warmup_steps": 5}}}, "unknown key 'warmup_steps'")
  err({"train_batch_size": 8, "scheduler": {"type": "OneCycle"}},
      "cycle_min_lr is required")
  with pytest.warns(UserWarning, match="last_batch_iteration"):
    sched("WarmupLR", last_batch_iteration=5)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    s = sched("WarmupLR", warmup_type="cubic", warmup_num_steps=10)
  assert values(s, [2], 1.0)[0] == pytest.approx(math.log(2) / math.log(10))
