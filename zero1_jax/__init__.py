"""zero1_jax: ZeRO Stage 1 (sharded optimizer state) and Stage 2 (+ sharded
gradients) for JAX.

The core (:mod:`zero1_jax.core`) is an optax transform and a shard_map step;
the integrations (``checkpoint``, ``flax``, ``distributed``, ``inspect``) and
the DeepSpeed front door (:mod:`zero1_jax.deepspeed`) build on it.
``docs/architecture.md`` maps the modules.

>>> import jax, optax, zero1_jax as z1
>>> tx = z1.zero1(optax.adamw(1e-3, weight_decay=0.01), axis_name="data")
>>> tx.config.axis_name, tx.config.reduce, tx.config.max_grad_norm
('data', 'reduce_scatter', None)
"""

import importlib
from typing import TYPE_CHECKING, Any

# Names resolve on first use (PEP 562): importing zero1_jax does not import
# jax, so zero1-train starts at once (--help, a Ctrl-C while it loads) and
# sets up its devices before jax does.
_SOURCES = {
    "specs": "zero1_jax.core.specs",
    "inner_state": "zero1_jax.core.inner_state",
    "from_optax_state": "zero1_jax.core.inner_state",
    "reduced_params": "zero1_jax.core.reduced",
    "Layout": "zero1_jax.core.layout", "plan": "zero1_jax.core.layout",
    **dict.fromkeys(("DynamicLossScale", "LossScaleState", "NoLossScale",
                     "StaticLossScale"), "zero1_jax.core.precision"),
    **dict.fromkeys(("init", "train_step"), "zero1_jax.core.step"),
    "state_shardings": "zero1_jax.core.shardings",
    **dict.fromkeys(("StepInfo", "Zero1Config", "Zero1State",
                     "Zero1Transformation", "loss_scale", "zero1"),
                    "zero1_jax.core.transform"),
    "zero2": "zero1_jax.core.zero2",
    **dict.fromkeys(("value_and_grad", "grad"), "zero1_jax.core.grad"),
    "ShardedGrads": "zero1_jax.core.sharded_grads",
    "bounded": "zero1_jax.core.inflight",
    **dict.fromkeys(("ConfigError", "DeepSpeedConfig", "Engine", "initialize",
                     "load_config"), "zero1_jax.deepspeed"),
}
_SUBPACKAGES = ("checkpoint", "cli", "core", "data", "deepspeed",
                "distributed", "flax", "inspect", "models")


def __getattr__(name: str) -> Any:
  if name in _SUBPACKAGES:
    return importlib.import_module(f"zero1_jax.{name}")
  if name not in _SOURCES:
    raise AttributeError(f"module 'zero1_jax' has no attribute {name!r}")
  module = importlib.import_module(_SOURCES[name])
  value = module if name == "specs" else getattr(module, name)   # a module
  globals()[name] = value     # once: later lookups skip __getattr__
  return value


def __dir__() -> list[str]:
  return sorted(set(__all__) | set(_SUBPACKAGES) | {"__version__"})


if TYPE_CHECKING:   # what the names are, for type checkers and IDEs
  from zero1_jax import checkpoint, deepspeed, distributed, flax, inspect
  from zero1_jax.core import specs
  from zero1_jax.core.inflight import bounded
  from zero1_jax.core.inner_state import from_optax_state, inner_state
  from zero1_jax.core.reduced import reduced_params
  from zero1_jax.core.layout import Layout, plan
  from zero1_jax.core.precision import (DynamicLossScale, LossScaleState,
                                        NoLossScale, StaticLossScale)
  from zero1_jax.core.shardings import state_shardings
  from zero1_jax.core.step import init, train_step
  from zero1_jax.core.transform import (StepInfo, Zero1Config, Zero1State,
                                        Zero1Transformation, loss_scale, zero1)
  from zero1_jax.core.zero2 import zero2
  from zero1_jax.core.grad import grad, value_and_grad
  from zero1_jax.core.sharded_grads import ShardedGrads
  from zero1_jax.deepspeed import (ConfigError, DeepSpeedConfig, Engine,
                                   initialize, load_config)

__all__ = [
    "ConfigError", "DeepSpeedConfig", "DynamicLossScale", "Engine", "Layout",
    "LossScaleState", "NoLossScale", "StaticLossScale", "StepInfo",
    "Zero1Config", "Zero1State", "Zero1Transformation", "bounded", "checkpoint",
    "deepspeed", "distributed", "flax", "from_optax_state", "init", "initialize", "inner_state", "inspect",
    "load_config", "loss_scale", "plan", "reduced_params", "specs",
    "state_shardings",
    "train_step", "zero1", "zero2", "value_and_grad", "grad", "ShardedGrads",
]
__version__ = "0.1.0"
