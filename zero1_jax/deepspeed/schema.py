"""Typed DeepSpeed config sections and the value checks they share.

Defaults are DeepSpeed 0.19's (file named on each class). Every check raises
:class:`ConfigError` naming the key and the value it got.

>>> as_int("steps_per_print", 5e2, 1)
500
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Mapping


class ConfigError(ValueError):
  """Invalid or unsupported DeepSpeed configuration."""


class NotHonouredWarning(UserWarning):
  """A DeepSpeed key or value zero1_jax recognises but cannot honour."""


class UnknownKeyWarning(UserWarning):
  """A top-level key neither DeepSpeed 0.19 nor zero1_jax knows (ignored)."""


@dataclasses.dataclass(frozen=True)
class FP16Config:
  """`fp16`, defaults from deepspeed/runtime/precision_config.py."""
  enabled: bool = False
  auto_cast: bool = False
  loss_scale: float = 0.0  # 0 = dynamic loss scaling
  initial_scale_power: int = 16
  loss_scale_window: int = 1000
  hysteresis: int = 2
  consecutive_hysteresis: bool = False
  min_loss_scale: int = 1
  fp16_master_weights_and_grads: bool = False

  @property
  def dynamic_loss_scale(self) -> bool:
    return self.loss_scale == 0

  @property
  def initial_scale(self) -> float:
    return 2.0**self.initial_scale_power if self.loss_scale == 0 else float(
        self.loss_scale)


@dataclasses.dataclass(frozen=True)
class BF16Config:
  """`bf16` (runtime/precision_config.py). check_grad_overflow: skip a step
  whose gradients hold inf/nan (DeepSpeed 0.19's default)."""
  enabled: bool = False
  immediate_grad_update: bool = False
  check_grad_overflow: bool = True
  bf16_master_weights_and_grads: bool = False
  bf16_optimizer_states: bool = False


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
  """`zero_optimization` (runtime/zero/config.py); sizes count elements."""
  stage: int = 0
  reduce_scatter: bool = True
  reduce_bucket_size: int = 500_000_000
  allgather_bucket_size: int = 500_000_000
  overlap_comm: bool = False  # DeepSpeed default None -> (stage == 3)
  contiguous_gradients: bool = True
  allgather_partitions: bool = True
  round_robin_gradients: bool = False
  elastic_checkpoint: bool = False
  # fp32: the global gradient norm is computed and a non-finite one skips the
  # step (runtime/zero/stage_1_and_2.py); false needs gradient_clipping 0.
  compute_grad_norm: bool = True
  # offload_optimizer.device (or the deprecated cpu_offload: true): "cpu"
  # keeps the sharded optimizer state in pinned host memory (core/offload.py).
  offload_optimizer: str = "none"


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  type: str
  params: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  type: str
  params: dict = dataclasses.field(default_factory=dict)



def as_bool(path: str, v, minimum=None) -> bool:
  del minimum
  if isinstance(v, bool) or (type(v) is int and v in (0, 1)):
    return bool(v)
  raise ConfigError(f"{path} must be a boolean, got {v!r}")


def as_int(path: str, v, minimum=None) -> int:
  if isinstance(v, float) and math.isfinite(v) and v == int(v):
    v = int(v)  # JSON writes 5e8 as a float; DeepSpeed's pydantic accepts it
  if isinstance(v, bool) or not isinstance(v, int):
    raise ConfigError(f"{path} must be an integer, got {v!r}")
  if minimum is not None and v < minimum:
    raise ConfigError(f"{path} must be >= {minimum}, got {v}")
  return v


def as_float(path: str, v, minimum=None) -> float:
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
    raise ConfigError(f"{path} must be a finite number, got {v!r}")
  if minimum is not None and v < minimum:
    raise ConfigError(f"{path} must be >= {minimum}, got {v!r}")
  return float(v)


def inactive(v) -> bool:
  if v is None or v is False or v == 0 or v == "none":
    return True
  if isinstance(v, Mapping):
    if "enabled" in v:
      return not v["enabled"]
    if "device" in v:
      return v["device"] in (None, "none")
    return all(inactive(x) for x in v.values())
  return False


def as_flag(path: str, v) -> bool:
  """A JSON boolean (no 0/1), as torch optimizer flags are."""
  if not isinstance(v, bool):
    raise ConfigError(f"{path} must be a boolean, got {v!r}")
  return v


def as_number(path: str, v, lo: float = 0.0, below: float | None = None
              ) -> float:
  """A finite number in [lo, below)."""
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
    raise ConfigError(f"{path} must be a finite number, got {v!r}")
  if v < lo or (below is not None and v >= below):
    rng = f"[{lo}, {below})" if below is not None else f">= {lo}"
    raise ConfigError(f"{path} must be in {rng}, got {v!r}")
  return float(v)


def extra_key(path: str, key: str, fields) -> ConfigError:
  """DeepSpeed 0.19.8's (pydantic's) refusal of an unknown key ``key`` in
  the section at ``path`` whose keys are ``fields``, naming the closest."""
  close = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.6)
  hint = f"; did you mean '{close[0]}'?" if close else ""
  return ConfigError(f"{path}.{key}: Extra inputs are not permitted (DeepSpeed "
                     f"0.19.8 rejects it too; the keys are "
                     f"{', '.join(fields)}){hint}")
