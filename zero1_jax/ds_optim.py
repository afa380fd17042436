"""DeepSpeed `optimizer` / `scheduler` sections -> optax (DeepSpeed 0.19.x).

`build_optimizer(cfg)` returns an elementwise optax GradientTransformation
(no clipping: the sharded wrapper clips with cfg.gradient_clipping) wrapped in
`optax.inject_hyperparams`, so `state.hyperparams["learning_rate"]` is the lr
of the update being applied. `build_schedule(sched_cfg, base_lr)` returns a
step -> lr function: step is the number of updates already applied (optax's
count), and the value is the lr DeepSpeed uses for that update (DeepSpeed
builds the scheduler before the first step and calls scheduler.step() after
every applied optimizer step).
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zero1_jax.config import (ConfigError, DeepSpeedConfig, OptimizerConfig,
                              SchedulerConfig)

logger = logging.getLogger("zero1_jax")

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "Lion", "RMSprop")
SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                        "OneCycle", "LRRangeTest")
# Names DeepSpeed matches case-insensitively (runtime/config.py); any other
# type is looked up as a torch.optim class, case-sensitively.
_DS_NAMES = {"adagrad", "adam", "adamw", "lamb", "onebitadam", "zerooneadam",
             "onebitlamb", "muadam", "muadamw", "musgd", "lion", "muon"}
_ELEMENTWISE = {"adam": "Adam", "adamw": "AdamW", "lion": "Lion",
                "adagrad": "Adagrad", "SGD": "SGD", "RMSprop": "RMSprop"}
_NOT_ELEMENTWISE = "ZeRO-1 sharding here needs an elementwise optimizer; "
_REJECT = {
    "lamb": _NOT_ELEMENTWISE + "Lamb scales each tensor by a trust ratio "
            "||w||/||update|| computed over the whole tensor",
    "onebitlamb": _NOT_ELEMENTWISE + "1-bit Lamb uses per-tensor trust "
                  "ratios and compressed communication",
    "muon": _NOT_ELEMENTWISE + "Muon orthogonalises whole weight matrices",
    "onebitadam": "1bit-Adam is not compatible with ZeRO (DeepSpeed asserts "
                  "this; its compressed all-reduce is not implemented here)",
    "zerooneadam": "0/1 Adam is not compatible with ZeRO (DeepSpeed asserts "
                   "this; its compressed all-reduce is not implemented here)",
    "muadam": "MuP optimizers need per-parameter width multipliers that a "
              "JSON config cannot carry",
}
_REJECT["muadamw"] = _REJECT["musgd"] = _REJECT["muadam"]
_NO_EFFECT = {"set_grad_none": "gradients are values, not buffers, in JAX",
              "foreach": "kernel selection", "fused": "kernel selection",
              "capturable": "CUDA-graph capture", "differentiable": "autograd"}
_BETAS = (0.9, 0.999)
# Constructor defaults of the class DeepSpeed instantiates for each type
# (runtime/engine.py _configure_basic_optimizer).
_FUSED_ADAM = dict(lr=1e-3, bias_correction=True, betas=_BETAS, eps=1e-8,
                   weight_decay=0.0, amsgrad=False, set_grad_none=True)
_TORCH_ADAM = dict(lr=1e-3, betas=_BETAS, eps=1e-8, weight_decay=0.0,
                   amsgrad=False, maximize=False, foreach=None,
                   capturable=False, differentiable=False, fused=None)
_PARAMS = {
    "lion": dict(lr=1e-3, betas=_BETAS, weight_decay=0.0, set_grad_none=True),
    "adagrad": dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                    initial_accumulator_value=0.0, eps=1e-10, foreach=None,
                    maximize=False, differentiable=False, fused=None),
    "SGD": dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                nesterov=False, maximize=False, foreach=None,
                differentiable=False, fused=None),
    "RMSprop": dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0,
                    momentum=0.0, centered=False, capturable=False,
                    foreach=None, maximize=False, differentiable=False),
}


def _canonical(type_name: str) -> str:
  low = type_name.lower()
  return low if low in _DS_NAMES else type_name


def _num(path, v, lo=0.0, below=None) -> float:
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
    raise ConfigError(f"{path} must be a finite number, got {v!r}")
  if v < lo or (below is not None and v >= below):
    rng = f"[{lo}, {below})" if below is not None else f">= {lo}"
    raise ConfigError(f"{path} must be in {rng}, got {v!r}")
  return float(v)


def _flag(path, v) -> bool:
  if not isinstance(v, bool):
    raise ConfigError(f"{path} must be a boolean, got {v!r}")
  return v


def resolve_optimizer(opt: OptimizerConfig, quiet: bool = True) -> dict:
  """Validated optimizer params with the DeepSpeed class defaults filled in.

  Returns a dict with 'name' (canonical) plus every hyperparameter.
  """
  name = _canonical(opt.type)
  if name in _REJECT:
    raise ConfigError(f"optimizer.type={opt.type!r} is not supported: "
                      f"{_REJECT[name]}. Supported: "
                      f"{', '.join(SUPPORTED_OPTIMIZERS)}")
  if name not in _ELEMENTWISE:
    close = [s for s in SUPPORTED_OPTIMIZERS if s.lower() == opt.type.lower()]
    hint = f" (did you mean {close[0]!r}? torch.optim names are " \
           "case-sensitive in DeepSpeed)" if close else ""
    raise ConfigError(f"unknown or unsupported optimizer.type={opt.type!r}"
                      f"{hint}; supported: {', '.join(SUPPORTED_OPTIMIZERS)}")
  p = dict(opt.params)
  if "max_grad_norm" in p:
    raise ConfigError("'max_grad_norm' is not supported as an optimizer "
                      "parameter, please switch to using the deepspeed "
                      "parameter 'gradient_clipping'")
  out: dict[str, Any] = {"name": name}
  if name in ("adam", "adamw"):
    torch_adam = _flag("optimizer.params.torch_adam", p.pop("torch_adam", False))
    w_mode = _flag("optimizer.params.adam_w_mode", p.pop("adam_w_mode", True))
    # Type "Adam" means AdamW logic unless adam_w_mode is false; "AdamW" always.
    out["decoupled"] = name == "adamw" or w_mode
    if torch_adam:
      spec = dict(_TORCH_ADAM)
      if out["decoupled"]:
        spec["weight_decay"] = 1e-2  # torch.optim.AdamW default
      else:
        spec["decoupled_weight_decay"] = False  # torch.optim.Adam only
    else:
      spec = dict(_FUSED_ADAM)
  else:
    spec = dict(_PARAMS[name])
  for k in p:
    if k not in spec:
      raise ConfigError(
          f"unknown key '{k}' in section 'optimizer.params' for type "
          f"{opt.type!r}; accepted: {', '.join(sorted(spec))}")
  spec.update(p)
  for k, v in spec.items():
    path = f"optimizer.params.{k}"
    if k in _NO_EFFECT:
      if k in p and not quiet:
        logger.info("zero1_jax: %s=%r has no effect: %s", path, v,
                    _NO_EFFECT[k])
    elif k == "betas":
      if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"{path} must be a pair [beta1, beta2], got {v!r}")
      out[k] = tuple(_num(f"{path}[{i}]", b, 0.0, 1.0) for i, b in enumerate(v))
    elif isinstance(spec[k], bool) or k in ("amsgrad",):
      out[k] = _flag(path, v)
    else:
      out[k] = _num(path, v)
  if out.get("amsgrad"):
    raise ConfigError("optimizer.params.amsgrad=true is not supported (FusedAdam "
                      "does not support the AMSGrad variant)")
  if out.pop("decoupled_weight_decay", False):
    out["decoupled"] = True
  if name == "SGD" and out["nesterov"] and (out["momentum"] <= 0
                                             or out["dampening"] != 0):
    raise ConfigError("optimizer.params: Nesterov momentum requires a "
                      "momentum and zero dampening")
  return out


class _CountBuf(NamedTuple):
  count: jax.Array
  buf: Any


def _stateful(init_buf, step):
  """Elementwise transform with a step count: step(count, g, buf) -> (u, buf)."""
  def init(params):
    return _CountBuf(jnp.zeros([], jnp.int32), init_buf(params))

  def update(g, state, params=None):
    del params
    out, buf = step(state.count, g, state.buf)
    return out, _CountBuf(optax.safe_increment(state.count), buf)
  return optax.GradientTransformation(init, update)


def _torch_momentum(mom, damp, nesterov):
  """torch.optim.SGD: buf = g at step 1, then mom*buf + (1-damp)*g."""
  def step(count, g, buf):
    buf = jax.tree.map(lambda b, x: jnp.where(
        count == 0, x, mom * b + (1.0 - damp) * x), buf, g)
    return (jax.tree.map(lambda x, b: x + mom * b, g, buf)
            if nesterov else buf), buf
  return _stateful(optax.tree.zeros_like, step)


def _torch_adagrad(init_acc, eps, lr_decay):
  """torch.optim.Adagrad: g / (sqrt(sum g^2) + eps) / (1 + (step-1)*lr_decay)."""
  def step(count, g, acc):
    acc = jax.tree.map(lambda a, x: a + x * x, acc, g)
    k = 1.0 / (1.0 + count * lr_decay)
    return jax.tree.map(lambda x, a: k * x / (jnp.sqrt(a) + eps), g, acc), acc
  return _stateful(lambda p: optax.tree.full_like(p, init_acc), step)


def _adam_no_bias_correction(b1, b2, eps):
  """FusedAdam(bias_correction=False): m / (sqrt(v) + eps)."""
  def step(count, g, mv):
    del count
    m = jax.tree.map(lambda a, x: b1 * a + (1 - b1) * x, mv[0], g)
    v = jax.tree.map(lambda a, x: b2 * a + (1 - b2) * x * x, mv[1], g)
    return jax.tree.map(lambda a, b: a / (jnp.sqrt(b) + eps), m, v), (m, v)
  return _stateful(lambda p: (optax.tree.zeros_like(p),
                              optax.tree.zeros_like(p)), step)


def _factory(h: dict):
  """Inner optax factory; only lr (and beta1) are injected hyperparameters."""
  name, wd = h["name"], h.get("weight_decay", 0.0)
  pre = [optax.scale(-1.0)] if h.get("maximize") else []
  l2 = [optax.add_decayed_weights(wd)] if wd else []
  if name in ("adam", "adamw"):
    def make(learning_rate, b1):
      if h.get("bias_correction", True):
        core = optax.scale_by_adam(b1=b1, b2=h["b2"], eps=h["eps"])
      else:
        core = _adam_no_bias_correction(b1, h["b2"], h["eps"])
      parts = pre + ([core] + l2 if h["decoupled"] else l2 + [core])
      return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))
    return make
  if name == "lion":
    def make(learning_rate, b1):  # decoupled: p*(1 - lr*wd) - lr*sign(c)
      return optax.lion(learning_rate, b1=b1, b2=h["b2"], weight_decay=wd)
    return make
  if name == "SGD":
    mom = [_torch_momentum(h["momentum"], h["dampening"], h["nesterov"])
           ] if h["momentum"] else []
    core = mom
  elif name == "adagrad":
    core = [_torch_adagrad(h["initial_accumulator_value"], h["eps"],
                           h["lr_decay"])]
  else:  # RMSprop: torch applies lr to the momentum buffer, after it
    scale = optax.scale_by_stddev if h["centered"] else optax.scale_by_rms
    core = [scale(decay=h["alpha"], eps=h["eps"], eps_in_sqrt=False)]
    if h["momentum"]:
      core.append(optax.trace(decay=h["momentum"]))

  def make(learning_rate):
    return optax.chain(*pre, *l2, *core,
                       optax.scale_by_learning_rate(learning_rate))
  return make


# ---------------------------------------------------------------- schedules
_REQ = object()
_SCHED_PARAMS = {
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
}
# DeepSpeed checks warmup_num_steps is an int; stairs are counted with floor().
_INT_PARAMS = {"warmup_num_steps", "cycle_first_stair_count",
               "cycle_second_stair_count"}


def resolve_scheduler(sched: SchedulerConfig, quiet: bool = True) -> dict:
  """Validated scheduler params with DeepSpeed constructor defaults."""
  if sched.type not in _SCHED_PARAMS:
    raise ConfigError(f"unknown or unsupported scheduler.type={sched.type!r}; "
                      f"supported: {', '.join(SUPPORTED_SCHEDULERS)}")
  spec = dict(_SCHED_PARAMS[sched.type], last_batch_iteration=-1)
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
    elif isinstance(_SCHED_PARAMS[sched.type].get(k), bool):
      out[k] = _flag(path, v)
    elif k in _INT_PARAMS or k == "last_batch_iteration":
      if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{path} must be an integer, got {v!r}")
      out[k] = v
    else:
      out[k] = _num(path, v, lo=-math.inf)
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
  if out["last_batch_iteration"] != -1 and not quiet:
    warnings.warn("scheduler.params.last_batch_iteration is recognised but "
                  "not honoured by zero1_jax: the schedule follows the "
                  "optimizer step count restored from the checkpoint",
                  UserWarning, stacklevel=3)
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


def validate(cfg: DeepSpeedConfig) -> None:
  """Called by load_config: optimizer/scheduler checks, logged once."""
  if cfg.optimizer is not None:
    h = resolve_optimizer(cfg.optimizer, quiet=False)
    if (cfg.zero.stage >= 1 and h["name"] in ("SGD", "RMSprop")
        and not cfg.zero_allow_untested_optimizer):
      raise ConfigError("You are using an untested ZeRO Optimizer. Please add "
                        "<\"zero_allow_untested_optimizer\": true> in the "
                        "configuration file to use it.")
  if cfg.scheduler is not None:
    resolve_scheduler(cfg.scheduler, quiet=False)
    if (cfg.scheduler.type == "OneCycle" and cfg.optimizer is not None
        and build_momentum_schedule(cfg.scheduler) is not None):
      if "betas" in resolve_optimizer(cfg.optimizer):
        logger.info("zero1_jax: OneCycle cycles beta1 in [cycle_min_mom, "
                    "cycle_max_mom] and sets beta2=0.99, as DeepSpeed does")
      else:
        logger.warning("cycle_momentum is disabled because optimizer %s does "
                       "not support momentum, no betas attribute in defaults",
                       cfg.optimizer.type)


def build_optimizer(cfg: DeepSpeedConfig) -> optax.GradientTransformation:
  """Elementwise optax transform for cfg.optimizer (+ cfg.scheduler), no clip."""
  if cfg.optimizer is None:
    raise ConfigError("the config has no 'optimizer' section")
  h = resolve_optimizer(cfg.optimizer)
  lr = build_schedule(cfg.scheduler, h["lr"]) if cfg.scheduler else h["lr"]
  hyper = {"learning_rate": lr}
  if "betas" in h:
    hyper["b1"], h["b2"] = h["betas"]
    mom = build_momentum_schedule(cfg.scheduler)
    if mom is not None:
      hyper["b1"], h["b2"] = mom
  return optax.inject_hyperparams(_factory(h))(**hyper)
