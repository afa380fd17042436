"""DeepSpeed `optimizer` sections -> optax (DeepSpeed 0.19.x).

`build_optimizer(optimizer_cfg, scheduler_cfg)` returns an elementwise optax
GradientTransformation (no clipping: the sharded wrapper clips with
gradient_clipping) wrapped in `optax.inject_hyperparams`, so
`state.hyperparams["learning_rate"]` is the lr of the update being applied;
the lr follows :mod:`zero1_jax.deepspeed.schedules`.

>>> from zero1_jax.deepspeed.schema import OptimizerConfig
>>> resolve_optimizer(OptimizerConfig("adamw", {"lr": 0.1}))["name"]
'adamw'
"""
from __future__ import annotations

import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zero1_jax.deepspeed import schedules
from zero1_jax.deepspeed.schema import (ConfigError, OptimizerConfig,
                                        SchedulerConfig, as_flag, as_number)

logger = logging.getLogger("zero1_jax")

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "Lion", "RMSprop")
# Names DeepSpeed matches case-insensitively (runtime/config.py); any other
# type is looked up as a torch.optim class, case-sensitively.
_DS_NAMES = {"adagrad", "adam", "adamw", "lamb", "muadam", "muadamw",
             "musgd", "lion", "muon"}
_ELEMENTWISE = {"adam": "Adam", "adamw": "AdamW", "lion": "Lion",
                "adagrad": "Adagrad", "SGD": "SGD", "RMSprop": "RMSprop"}
_NOT_ELEMENTWISE = "ZeRO-1 sharding here needs an elementwise optimizer; "
_REJECT = {
    "lamb": _NOT_ELEMENTWISE + "Lamb scales each tensor by a trust ratio "
            "||w||/||update|| computed over the whole tensor",
    "muon": _NOT_ELEMENTWISE + "Muon orthogonalises whole weight matrices",
    "muadam": "MuP optimizers need per-parameter width multipliers that a "
              "JSON config cannot carry",
}
_REJECT["muadamw"] = _REJECT["musgd"] = _REJECT["muadam"]
_NO_EFFECT = {"set_grad_none": "gradients are values, not buffers, in JAX",
              "fp32_optimizer_states": "used only with ZeRO-Offload; optimizer "
              "state is fp32 here",
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



def known_params() -> set[str]:
  """Every optimizer.params key some supported type accepts."""
  return {k for spec in (_FUSED_ADAM, _TORCH_ADAM, *_PARAMS.values())
          for k in spec}

def _canonical(type_name: str) -> str:
  low = type_name.lower()
  return low if low in _DS_NAMES else type_name


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
    torch_adam = as_flag("optimizer.params.torch_adam", p.pop("torch_adam", False))
    w_mode = as_flag("optimizer.params.adam_w_mode", p.pop("adam_w_mode", True))
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
    # DeepSpeed pops it for every Adam before choosing the class
    # (runtime/engine.py get_optimizer_configuration).
    spec["fp32_optimizer_states"] = None
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
        logger.info("%s=%r has no effect: %s", path, v,
                    _NO_EFFECT[k])
    elif k == "betas":
      if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"{path} must be a pair [beta1, beta2], got {v!r}")
      out[k] = tuple(as_number(f"{path}[{i}]", b, 0.0, 1.0) for i, b in enumerate(v))
    elif isinstance(spec[k], bool) or k in ("amsgrad",):
      out[k] = as_flag(path, v)
    else:
      out[k] = as_number(path, v)
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



def check(optimizer: OptimizerConfig | None,
          scheduler: SchedulerConfig | None, *, zero_stage: int,
          allow_untested: bool) -> None:
  """Called by load_config: optimizer/scheduler checks, logged once."""
  if optimizer is not None:
    h = resolve_optimizer(optimizer, quiet=False)
    if (zero_stage >= 1 and h["name"] in ("SGD", "RMSprop")
        and not allow_untested):
      raise ConfigError("You are using an untested ZeRO Optimizer. Please add "
                        "<\"zero_allow_untested_optimizer\": true> in the "
                        "configuration file to use it.")
  if scheduler is not None:
    schedules.resolve_scheduler(scheduler, quiet=False)
    if (scheduler.type == "OneCycle" and optimizer is not None
        and schedules.build_momentum_schedule(scheduler) is not None):
      if "betas" in resolve_optimizer(optimizer):
        logger.info("OneCycle cycles beta1 in [cycle_min_mom, "
                    "cycle_max_mom] and sets beta2=0.99, as DeepSpeed does")
      else:
        logger.warning("cycle_momentum is disabled because optimizer %s does "
                       "not support momentum, no betas attribute in defaults",
                       optimizer.type)


def build_optimizer(optimizer: OptimizerConfig | None,
                    scheduler: SchedulerConfig | None = None
                    ) -> optax.GradientTransformation:
  """Elementwise optax transform for the optimizer (+ scheduler), no clip."""
  if optimizer is None:
    raise ConfigError(
        "the config has no 'optimizer' section: add one, e.g. \"optimizer\": "
        "{\"type\": \"AdamW\", \"params\": {\"lr\": 1e-3}} (DeepSpeed's "
        "optimizer= argument has no counterpart: for an optax optimizer of "
        "your own, use z1.zero1(...) with z1.init and z1.train_step)")
  h = resolve_optimizer(optimizer)
  lr = schedules.build_schedule(scheduler, h["lr"]) if scheduler else h["lr"]
  hyper = {"learning_rate": lr}
  if "betas" in h:
    hyper["b1"], h["b2"] = h["betas"]
    mom = schedules.build_momentum_schedule(scheduler)
    if mom is not None:
      hyper["b1"], h["b2"] = mom
  return optax.inject_hyperparams(_factory(h))(**hyper)
