"""The DeepSpeed front door: a DeepSpeed JSON config, read with DeepSpeed
0.19's rules, drives zero1_jax.

:mod:`.schema` (typed sections, value checks) and :mod:`.keys` (every key
and what it does here) feed :mod:`.config` (``load_config``);
:mod:`.optim` and :mod:`.schedules` turn its optimizer and scheduler into
optax; :mod:`.tx` builds the zero1 / zero2 transformation the config
describes; :mod:`.engine` is ``deepspeed.initialize`` and the training engine.
"""
from zero1_jax.deepspeed.config import DeepSpeedConfig, load_config
from zero1_jax.deepspeed.engine import Engine, initialize
from zero1_jax.deepspeed.schema import ConfigError

__all__ = ["ConfigError", "DeepSpeedConfig", "Engine", "initialize",
           "load_config"]
