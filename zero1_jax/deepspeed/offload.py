"""``zero_optimization.offload_optimizer`` / ``offload_param``, checked as
DeepSpeed 0.19.8 checks them.

DeepSpeed reads each section into a pydantic model that forbids extra keys
(``runtime/zero/offload_config.py``: ``DeepSpeedZeroOffloadOptimizerConfig``,
``DeepSpeedZeroOffloadParamConfig``; ``runtime/config_utils.py``:
``extra="forbid"``), and the ZeRO section refuses ``ratio < 1`` below stage 3
(``runtime/zero/config.py`` ``offload_ratio_check``). The messages here end
with pydantic's words for the same error, so a config DeepSpeed rejects is
rejected here with the reason DeepSpeed gives. zero1_jax then refuses what
it cannot do at all: NVMe, and parameter offload (ZeRO-3).

>>> check("offload_optimizer", {"device": "cpu", "pin_memory": True}, stage=1)
'cpu'
>>> check("offload_optimizer", {"device": "gpu"}, stage=1)
Traceback (most recent call last):
...
zero1_jax.deepspeed.schema.ConfigError: zero_optimization.offload_optimizer.device='gpu': Input should be 'none', 'cpu' or 'nvme' (DeepSpeed 0.19.8 rejects it too)
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from zero1_jax.deepspeed.schema import ConfigError, extra_key

DEVICES = ("none", "cpu", "nvme")
PINNED_ANYWAY = (
    "zero_optimization.offload_optimizer.pin_memory=false: zero1_jax keeps the "
    "offloaded optimizer state in pinned host memory all the same (a jitted "
    "step reads and writes host memory through JAX's pinned host space)")
_BOOL, _INT, _UNIT, _PATH, _DEV = "bool", "int>=0", "0<=x<=1", "path", "device"
# field -> kind, as offload_config.py declares them (defaults do not matter:
# nothing here reads them).
FIELDS: dict[str, dict[str, str]] = {
    "offload_optimizer": {
        "device": _DEV, "nvme_path": _PATH, "buffer_count": _INT,
        "pin_memory": _BOOL, "pipeline_read": _BOOL, "pipeline_write": _BOOL,
        "fast_init": _BOOL, "ratio": _UNIT, "super_offload": _BOOL,
        "cpuadam_cores_perc": _UNIT},
    "offload_param": {
        "device": _DEV, "nvme_path": _PATH, "buffer_count": _INT,
        "buffer_size": _INT, "max_in_cpu": _INT, "pin_memory": _BOOL},
}


def _fail(path: str, value: Any, words: str) -> ConfigError:
  return ConfigError(f"{path}={value!r}: {words} (DeepSpeed 0.19.8 rejects "
                     "it too)")


def _field(path: str, kind: str, v: Any) -> None:
  """pydantic's lax-mode check of one field; its message on failure."""
  if kind == _DEV:
    if v not in DEVICES:
      raise _fail(path, v, "Input should be 'none', 'cpu' or 'nvme'")
  elif kind == _BOOL:
    if not (isinstance(v, bool) or (type(v) is int and v in (0, 1))):
      raise _fail(path, v, "Input should be a valid boolean")
  elif kind == _PATH:
    if v is not None and not isinstance(v, str):
      raise _fail(path, v, "Input is not a valid path")
  else:
    number = not isinstance(v, bool) and isinstance(v, (int, float))
    if kind == _INT:
      if not number or (isinstance(v, float) and not (
          math.isfinite(v) and v == int(v))):
        raise _fail(path, v, "Input should be a valid integer")
      if v < 0:
        raise _fail(path, v, "Input should be greater than or equal to 0")
    else:
      if not number or not math.isfinite(v):
        raise _fail(path, v, "Input should be a valid number")
      if v < 0:
        raise _fail(path, v, "Input should be greater than or equal to 0")
      if v > 1:
        raise _fail(path, v, "Input should be less than or equal to 1")


def check(key: str, section: Any, stage: int) -> str:
  """Validates ``zero_optimization.<key>``; returns its device ("none" when
  the section is null). Raises :class:`ConfigError` with DeepSpeed 0.19.8's
  reason for what it rejects, and zero1_jax's for NVMe and ``offload_param``.
  """
  base = f"zero_optimization.{key}"
  if section is None:
    return "none"
  if not isinstance(section, Mapping):
    raise _fail(base, section, "Input should be a valid dictionary")
  fields = FIELDS[key]
  for k, v in section.items():
    if k not in fields:
      raise extra_key(base, k, fields)
    _field(f"{base}.{k}", fields[k], v)
  device = section.get("device", "none")
  ratio = section.get("ratio", 1.0)
  if key == "offload_optimizer" and ratio < 1.0 and stage != 3:
    raise ConfigError(
        f"{base}.ratio={ratio!r}: Partial offloading only supported for ZeRO "
        "Stage 3. (DeepSpeed 0.19.8's words: the ratio of the optimizer "
        "offloaded is a stage-3 option; remove 'ratio' or set it to 1.0)")
  if device == "nvme":
    raise ConfigError(
        f"{base}.device='nvme' is not supported by zero1_jax: there is no NVMe "
        "(ZeRO-Infinity) offload under JAX. Use \"device\": \"none\" (keep it "
        "on the accelerator)" + (", or \"cpu\"" if key == "offload_optimizer"
                                  else ""))
  if key == "offload_param" and device != "none":
    raise ConfigError(
        f"{base}.device={device!r}: parameter offload is ZeRO stage 3's "
        "(DeepSpeed uses it only at stage 3), which zero1_jax does not "
        "implement: parameters stay on the devices. Remove offload_param or "
        "set \"device\": \"none\"")
  return device
