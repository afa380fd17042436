"""zero1_jax: ZeRO Stage 1 (sharded optimizer state) for JAX.

>>> import jax, optax, zero1_jax as z1
>>> tx = z1.zero1(optax.adamw(1e-3, weight_decay=0.01), axis_name="data")
"""

from zero1_jax import checkpoint, config, distributed, flax, inspect, specs
from zero1_jax.config import ConfigError, DeepSpeedConfig, load_config
from zero1_jax.engine import Engine, initialize
from zero1_jax.layout import Layout, plan
from zero1_jax.precision import (DynamicLossScale, LossScaleState, NoLossScale,
                                 StaticLossScale)
from zero1_jax.step import init, state_shardings, train_step
from zero1_jax.transform import (StepInfo, Zero1Config, Zero1State,
                                 Zero1Transformation, loss_scale, zero1)

__all__ = [
    "ConfigError", "DeepSpeedConfig", "DynamicLossScale", "Engine", "Layout",
    "LossScaleState", "NoLossScale", "StaticLossScale", "StepInfo",
    "Zero1Config", "Zero1State", "Zero1Transformation", "checkpoint", "config",
    "distributed", "flax", "init", "initialize", "inspect", "load_config",
    "loss_scale", "plan", "specs", "state_shardings", "train_step", "zero1",
]
__version__ = "0.1.0"
