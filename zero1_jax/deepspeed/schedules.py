"""DeepSpeed `scheduler` sections -> optax schedules (DeepSpeed 0.19.x).

`build_schedule(sched_cfg, base_lr)` returns a step -> lr function: step is
the number of updates already applied (optax's count), and the value is the
lr DeepSpeed uses for that update (DeepSpeed builds the scheduler before the
first step and calls scheduler.step() after every applied optimizer step).

>>> from zero1_jax.deepspeed.schema import SchedulerConfig
>>> lr = build_schedule(SchedulerConfig("WarmupLR", {"warmup_max_lr": 0.1,
...     "warmup_num_steps": 10, "warmup_type": "linear"}), 0.1)
>>> [round(float(lr(c)), 3) for c in (1, 5, 10, 20)]
[0.0, 0.04, 0.09, 0.1]
"""
from __future__ import annotations

import logging
import math

import jax.numpy as jnp
import optax

from zero1_jax.deepspeed import log as ds_log
from zero1_jax.deepspeed.schema import (ConfigError, NotHonouredWarning,
                                        SchedulerConfig, as_flag,
                                        as_number)

logger = logging.getLogger("zero1_jax")

HF_LINEAR = "HFLinear"
SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                        "OneCycle", "LRRangeTest")
_REQ = object()
PARAMS = {
    "WarmupLR": dict(warmup_min_lr=0.0, warmup_max_lr=None,
                     warmup_num_steps=1000, warmup_type="log"),
    "WarmupDecayLR": dict(total_num_steps=_REQ, warmup_min_lr=0.0,
                          warmup_max_lr=0.001, warmup_num_steps=1000,
                          warmup_type="log"),
    "WarmupCosineLR": dict(total_num_steps=_REQ, warmup_min_ratio=0.0,
                           warmup_num_steps=1000, cos_min_ratio=0.0001,
                           warmup_type="log"),
    "OneCycle": dict(cycle_min_lr=_REQ, cycle_max_lr=_REQ, decay_lr_rate=0.0,
                     cycle_first_step_size=2000, cycle_second_step_size=None,
                     cycle_first_stair_count=0, cycle_second_stair_count=None,
                     decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8,
                     cycle_max_mom=0.9, decay_mom_rate=0.0),
    "LRRangeTest": dict(lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                        lr_range_test_step_rate=1.0,
                        lr_range_test_staircase=False),
    # Not DeepSpeed's: the HF Trainer's default schedule (transformers
    # optimization.py get_linear_schedule_with_warmup), which zero1-train
    # writes when the JSON has neither optimizer nor scheduler, as the
    # Trainer then builds its own (integrations/deepspeed.py).
    HF_LINEAR: dict(num_warmup_steps=0, num_training_steps=_REQ),
}
# DeepSpeed checks warmup_num_steps is an int; stairs are counted with floor().
_INT_PARAMS = {"warmup_num_steps", "cycle_first_stair_count",
               "num_warmup_steps", "num_training_steps",
               "cycle_second_stair_count", "lr_range_test_step_size"}


def resolve_scheduler(sched: SchedulerConfig, quiet: bool = True) -> dict:
  """Validated scheduler params with DeepSpeed constructor defaults."""
  if sched.type not in PARAMS:
    raise ConfigError(
        f"unknown or unsupported scheduler.type={sched.type!r}; supported: "
        f"{', '.join(SUPPORTED_SCHEDULERS)}. (DeepSpeed 0.19 would fall back "
        f"to torch.optim.lr_scheduler.{sched.type}; zero1_jax does not: "
        "use one of the above or build the optax schedule yourself)")
  spec = dict(PARAMS[sched.type], last_batch_iteration=-1)
  for k in sched.params:
    if k not in spec:
      raise ConfigError(f"unknown key '{k}' in section 'scheduler.params' for "
                        f"type {sched.type!r}; accepted: {', '.join(spec)}")
  spec.update(sched.params)
  out = {}
  for k, v in spec.items():
    path = f"scheduler.params.{k}"
    if v is _REQ:
      raise ConfigError(f"{path} is required by DeepSpeed's {sched.type}")
    if v is None or k == "warmup_type":
      out[k] = v
    elif isinstance(PARAMS[sched.type].get(k), bool):
      out[k] = as_flag(path, v)
    elif k in _INT_PARAMS or k == "last_batch_iteration":
      if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{path} must be an integer, got {v!r}")
      out[k] = v
    else:
      out[k] = as_number(path, v, lo=-math.inf)
  if "warmup_num_steps" in out:
    if out["warmup_num_steps"] <= 0:
      raise ConfigError("warmup_num_steps must be a positive integer, got "
                        f"{out['warmup_num_steps']}")
    if out["warmup_type"] not in ("log", "linear"):
      if not quiet:
        logger.warning("Using unknown warmup_type: %s. The increasing function "
                       "is set to default (log)", out["warmup_type"])
      out["warmup_type"] = "log"
    if not quiet and out.get("total_num_steps", math.inf) < max(
        2, out["warmup_num_steps"]):
      logger.warning("total_num_steps %s is less than warmup_num_steps %s",
                     out["total_num_steps"], out["warmup_num_steps"])
  # runtime/lr_schedules.py OneCycle.__init__ and LRRangeTest.__init__.
  if sched.type == "OneCycle":
    if out["cycle_first_step_size"] <= 0:
      raise ConfigError("cycle_first_step_size must be positive, got "
                        f"{out['cycle_first_step_size']}")
    if (out["cycle_second_step_size"] is not None
        and out["cycle_second_step_size"] < 0):
      raise ConfigError("cycle_second_step_size must be non-negative, got "
                        f"{out['cycle_second_step_size']}")
  if sched.type == HF_LINEAR and (out["num_warmup_steps"] < 0
                                  or out["num_training_steps"] < 1):
    raise ConfigError("HFLinear needs num_warmup_steps >= 0 and "
                      f"num_training_steps >= 1, got {out}")
  if sched.type == "LRRangeTest":
    size = out["lr_range_test_step_size"]
    if size <= 0:
      raise ConfigError("lr_range_test_step_size must be a positive integer, "
                        f"got {size}")
  if out["last_batch_iteration"] != -1 and not quiet:
    ds_log.warn("scheduler.params.last_batch_iteration is recognised but "
                "not honoured by zero1_jax: the schedule follows the "
                "optimizer step count restored from the checkpoint",
                NotHonouredWarning)
  return out


def _warmup_gamma(i, num_steps, kind):
  """DeepSpeed warmup fraction at last_batch_iteration i (0 <= i < W)."""
  if kind == "log":
    return jnp.log(i + 1.0) / math.log(num_steps)
  return i / num_steps


def _onecycle_scale(c, p):
  """OneCycle._get_scale_factor with batch_iteration = c."""
  first = float(p["cycle_first_step_size"])
  second = first if p["cycle_second_step_size"] is None else float(
      p["cycle_second_step_size"])
  total, ratio = first + second, first / (first + second)
  x = 1.0 + c / total - jnp.floor(1.0 + c / total)
  up = x <= ratio
  scale = jnp.where(up, x / ratio, (x - 1.0) / (ratio - 1.0))
  n1 = p["cycle_first_stair_count"]
  n2 = n1 if p["cycle_second_stair_count"] is None else p[
      "cycle_second_stair_count"]
  if n1 > 0 or n2 > 0:  # staircase, quantised from the integer offset
    n = jnp.where(up, n1, n2)  # stair count of the half x falls in
    ci = jnp.mod(c, total)
    pos = jnp.where(ci <= first, ci * n / first, (total - ci) * n / second)
    scale = jnp.where(n > 0, jnp.floor(pos) / jnp.maximum(n, 1), scale)
  return scale, total


def build_schedule(sched: SchedulerConfig | None, base_lr: float):
  """optax schedule: updates-applied count -> DeepSpeed lr for that update."""
  if sched is None:
    return optax.constant_schedule(base_lr)
  p = resolve_scheduler(sched)
  kind = sched.type

  def schedule(count):
    c = jnp.asarray(count, jnp.float32)
    i = c - 1.0  # DeepSpeed's last_batch_iteration for this update
    if kind in ("WarmupLR", "WarmupDecayLR"):
      w = max(2, p["warmup_num_steps"])
      lo = p["warmup_min_lr"]
      hi = base_lr if p["warmup_max_lr"] is None else p["warmup_max_lr"]
      gamma = _warmup_gamma(jnp.maximum(i, 0.0), w, p["warmup_type"])
      after = 1.0
      if kind == "WarmupDecayLR":
        t = p["total_num_steps"]
        after = jnp.maximum(0.0, (t - i) / max(1.0, t - w))
      gamma = jnp.where(i < 0, 0.0, jnp.where(i < w, gamma, after))
      return lo + (hi - lo) * gamma
    if kind == "WarmupCosineLR":
      w, t = max(2, p["warmup_num_steps"]), p["total_num_steps"]
      wmin, cmin = p["warmup_min_ratio"], p["cos_min_ratio"]
      warm = wmin + _warmup_gamma(jnp.maximum(i, 0.0), w,
                                  p["warmup_type"]) * (1.0 - wmin)
      prog = jnp.minimum(1.0, (i - w + 1.0) / max(1, t - w))
      cos = jnp.maximum(0.0, cmin + (1.0 - cmin) * 0.5 * (
          1.0 + jnp.cos(math.pi * prog)))
      return base_lr * jnp.where(i < 0, 0.0, jnp.where(i < w, warm, cos))
    if kind == HF_LINEAR:   # LambdaLR: update c uses lr_lambda(c)
      w, t = p["num_warmup_steps"], p["num_training_steps"]
      return base_lr * jnp.where(c < w, c / max(1, w), jnp.maximum(
          0.0, (t - c) / max(1, t - w)))
    if kind == "OneCycle":
      lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
      scale, total = _onecycle_scale(c, p)
      rate, size = p["decay_lr_rate"], p["decay_step_size"]
      decayed = lo
      if not (math.isclose(size, 0) or math.isclose(rate, 0)):
        decayed = lo / (1.0 + rate * (c - total) / size)
      return jnp.where(i < total, lo + (hi - lo) * scale, decayed)
    # LRRangeTest
    steps = c / p["lr_range_test_step_size"]
    if p["lr_range_test_staircase"]:
      steps = jnp.floor(steps)
    return p["lr_range_test_min_lr"] * (1.0 + p["lr_range_test_step_rate"]
                                        * steps)
  return schedule


def build_momentum_schedule(sched: SchedulerConfig | None):
  """OneCycle cycle_momentum: (beta1 schedule, beta2) or None.

  DeepSpeed cycles betas[0] and forces betas[1] to 0.99 for optimizers that
  have 'betas' (Adam, AdamW, Lion); step 0 uses cycle_min_mom.
  """
  if sched is None or sched.type != "OneCycle":
    return None
  p = resolve_scheduler(sched)
  if not p["cycle_momentum"]:
    return None
  lo, hi = p["cycle_min_mom"], p["cycle_max_mom"]
  rate, size = p["decay_mom_rate"], p["decay_step_size"]

  def beta1(count):
    c = jnp.asarray(count, jnp.float32)
    scale, total = _onecycle_scale(c, p)
    decayed = hi
    if not (math.isclose(size, 0) or math.isclose(rate, 0)):
      decayed = hi * (1.0 + rate * (c - total) / size)
    return jnp.where(c == 0, lo, jnp.where(c - 1.0 < total,
                                           hi - (hi - lo) * scale, decayed))
  return beta1, 0.99

