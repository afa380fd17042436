"""DeepSpeed JSON configuration for zero1_jax (DeepSpeed 0.19.x semantics).

`load_config(path_or_dict, world_size)` validates a DeepSpeed config and
resolves the batch triple as DeepSpeed does. Every key is honoured, accepted
with one INFO line on logging.getLogger("zero1_jax") (no meaning under XLA),
accepted with a UserWarning (recognised but not honoured), or rejected with
ConfigError. docs/deepspeed_config.md is the key-by-key reference.

The INFO record of a key that has no effect carries the key's dotted path as
``record.zero1_no_effect`` (e.g. ``"zero_optimization.overlap_comm"``): a
program can show those as one line (zero1-train does).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import math
import os
from typing import Mapping

from zero1_jax.deepspeed import batch_triple, keys, monitor, offload, optim
from zero1_jax.deepspeed import log as ds_log
from zero1_jax.deepspeed.config_text import parse_text
from zero1_jax.deepspeed.schema import (BF16Config, ConfigError, FP16Config,
                                        NotHonouredWarning, UnknownKeyWarning,
                                        OptimizerConfig, SchedulerConfig,
                                        ZeroConfig, as_bool, as_float, as_int,
                                        inactive)

logger = logging.getLogger("zero1_jax")
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class DeepSpeedConfig:
  """A validated DeepSpeed config: the batch triple resolved, sections typed."""
  train_batch_size: int
  train_micro_batch_size_per_gpu: int
  gradient_accumulation_steps: int
  world_size: int
  fp16: FP16Config = FP16Config()
  bf16: BF16Config = BF16Config()
  zero: ZeroConfig = ZeroConfig()
  gradient_clipping: float = 1.0   # DeepSpeed 0.19's default; <= 0: off
  optimizer: OptimizerConfig | None = None
  scheduler: SchedulerConfig | None = None
  steps_per_print: int | None = None
  zero_allow_untested_optimizer: bool = False
  communication_data_type: str | None = None  # "fp16" | "bf16" | "fp32"
  monitor: monitor.MonitorConfig = monitor.MonitorConfig()
  raw: dict = dataclasses.field(default_factory=dict, repr=False,
                                compare=False)  # the dict as given
  source: str | None = dataclasses.field(default=None, compare=False)

  def to_dict(self) -> dict:
    """Resolved config as DeepSpeed JSON; load_config() of it is equal."""
    out = copy.deepcopy(self.raw)
    for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps", "gradient_clipping",
              "zero_allow_untested_optimizer", "steps_per_print",
              "communication_data_type"):
      out[k] = getattr(self, k)
    for k, sec in (("fp16", self.fp16), ("bf16", self.bf16),
                   ("zero_optimization", self.zero)):
      old = out.get(k) if isinstance(out.get(k), dict) else {}
      new = dataclasses.asdict(sec)
      if k == "zero_optimization":   # a device name here, a section in JSON
        device = new.pop("offload_optimizer")
        if device != "none" and not isinstance(old.get("offload_optimizer"),
                                                dict):
          new["offload_optimizer"] = {"device": device}
      out[k] = {**old, **new}
    out.pop("bfloat16", None)
    for k in ("optimizer", "scheduler"):
      sec = getattr(self, k)
      out.pop(k, None)
      if sec is not None:
        out[k] = {"type": sec.type, "params": copy.deepcopy(sec.params)}
    return {k: v for k, v in out.items() if v is not None}

  def with_overrides(self, *, flag_names: dict[str, str] | None = None,
                     **flags) -> "DeepSpeedConfig":
    """Apply command-line flags on top of the JSON and re-validate.

    A flag is a top-level key, a dotted path (`**{"fp16.enabled": True}` or
    `fp16__enabled=True`), or an alias: lr, zero_stage, fp16=/bf16=<bool>.
    None values are skipped; a flag that disagrees with a value the JSON sets
    explicitly raises ConfigError naming both (each flag as ``flag_names``
    names it, e.g. ``{"lr": "--learning_rate"}``, else ``flag lr``).
    """
    raw = copy.deepcopy(self.raw)
    for name, value in flags.items():
      if value is None:
        continue
      path = _ALIASES.get(name, name.replace("__", "."))
      if name in ("fp16", "bf16") and isinstance(value, bool):
        path = name + ".enabled"
      *parents, leaf = path.split(".")
      node = raw
      for k in parents:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
          raise ConfigError(f"flag {name}: '{k}' in the config is not a section")
      old = node.get(leaf, _MISSING)
      if old is not _MISSING and not _same(old, value):
        shown = (f"{flag_names[name]} {value!r}" if name in (flag_names or {})
                 else f"flag {name}={value!r}")
        raise ConfigError(f"{shown} conflicts with {path}={old!r} in "
                          f"{self.source or 'the config dict'}: drop one of them")
      node[leaf] = value
    return _build(raw, self.world_size, self.source)


_ALIASES = {"lr": "optimizer.params.lr", "learning_rate": "optimizer.params.lr",
            "zero_stage": "zero_optimization.stage"}


def _same(a, b) -> bool:
  if isinstance(a, bool) or isinstance(b, bool):
    return a is b
  if isinstance(a, (int, float)) and isinstance(b, (int, float)):
    return math.isclose(a, b, rel_tol=1e-12)
  return a == b


def _unknown(key: str, section: str, known) -> ConfigError:
  close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
  hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
  return ConfigError(f"unknown key '{key}' in section '{section}'{hint}")


def _unknown_top(key: str, raw: Mapping) -> str:
  close = difflib.get_close_matches(key, sorted(keys.TOP_LEVEL), n=1,
                                    cutoff=0.6)
  hint = f" (did you mean '{close[0]}'?)" if close else ""
  unset = (f"; '{close[0]}' is not set, so its default applies"
           if close and close[0] not in raw else "")
  return (f"unknown top-level key '{key}'{hint} ignored: DeepSpeed 0.19 ignores "
          f"top-level keys it does not know, and so does zero1_jax{unset}")


def _refuse_auto(raw: Mapping) -> None:
  """Every ``"auto"`` value still in the config, named at once (the HF
  Trainer fills them in; DeepSpeed itself does not)."""
  found = [k for k, v in raw.items() if v == "auto" and k in keys.TOP_LEVEL
           and k not in monitor.SECTIONS]
  for sec in ("optimizer", "scheduler"):
    params = raw.get(sec, {}).get("params") if isinstance(raw.get(sec), Mapping) else None
    if isinstance(params, Mapping):
      found += [f"{sec}.params.{k}" for k, v in params.items() if v == "auto"]
  if found:
    raise ConfigError(
        f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} 'auto', "
        "which must be filled in before loading (the HF Trainer does that, "
        "DeepSpeed does not): give the values, or run the config through "
        "zero1-train, which fills them in")


_NOTED: set[str] = set()   # info lines already logged in this process
# What the config being built has to say: (key, message, warning category,
# None for an INFO line, or _NO_EFFECT for a key's "has no effect" INFO
# line), said only once the whole config is valid.
_PENDING: list[tuple[str, str, object]] = []
_NO_EFFECT = object()


def _shown(path: str, value) -> str:
  """``key=value``; a section by its name alone (not its nested dict)."""
  if isinstance(value, Mapping):
    on = " (enabled)" if value.get("enabled") is True else ""
    return f"section '{path}'{on}"
  return f"{path}={value!r}"


def _note(path: str, value) -> None:
  default, reason = keys.NOTES[path]
  if default is keys.ANY or (inactive(value) if default is keys.DICT
                         else _same(value, default)):
    if inactive(value):   # switched off: nothing asked for, nothing to say
      return
    key = f"{path}={value!r}"
    text = keys.MESSAGES.get(path) or f"{_shown(path, value)} has no effect: {reason}"
    if key not in _NOTED:     # once per process, not once per re-validation
      _PENDING.append((key, text, _NO_EFFECT))
  else:
    _PENDING.append(("", f"{_shown(path, value)} is recognised but not "
                     f"honoured by zero1_jax: {reason}", NotHonouredWarning))


def _say_pending() -> None:
  """The notes and warnings of a config that turned out valid."""
  for key, text, category in _PENDING:
    if category is not None and category is not _NO_EFFECT:
      ds_log.warn(text, category)
    elif key not in _NOTED:
      _NOTED.add(key)
      tag = {} if category is None else {
          "extra": {"zero1_no_effect": key.split("=", 1)[0]}}
      logger.info("%s", text, **tag)
  _PENDING.clear()


def _section(raw: Mapping, key: str, cls) -> dict:
  """Validate one DeepSpeedConfigModel section into `cls` kwargs."""
  d = raw.get(key)
  d = {} if d is None else d
  if not isinstance(d, Mapping):
    raise ConfigError(f"section '{key}' must be an object, got {d!r}")
  name = "bf16" if key == "bfloat16" else key
  fields = {f.name: f.default for f in dataclasses.fields(cls)}
  notes = {p.split(".", 1)[1] for p in keys.NOTES if p.startswith(name + ".")}
  vals = {}
  for k, v in d.items():
    path = f"{name}.{k}"
    if k not in fields and k not in notes:
      raise _unknown(k, key, set(fields) | notes)
    if v == "auto":  # DeepSpeedConfigModel drops "auto": the default applies
      _PENDING.append((f"{path}='auto'", f"{path}='auto' dropped; "
                       "DeepSpeed's default applies", None))
      continue
    if k in fields:
      dflt = fields[k]
      check = as_bool if isinstance(dflt, bool) else (
          as_int if isinstance(dflt, int) else as_float)
      v = vals[k] = check(path, v, keys.MINIMUM.get(path))
    if path in keys.NOTES:
      _note(path, v)
  return vals


def _parse_zero(raw: Mapping) -> ZeroConfig:
  d = raw.get("zero_optimization")
  if isinstance(d, bool):  # deprecated form (zero/config.py)
    _PENDING.append(("", "DeepSpeedConfig: this format of ZeRO optimization "
                     "setup is deprecated; use {\"stage\": N}", UserWarning))
    d = {"stage": int(d)}
    if d["stage"]:
      d["allgather_bucket_size"] = raw.get("allgather_size", 5e8)
    raw = {"zero_optimization": d}
  if isinstance(d, Mapping) and d.get("legacy_stage1") is True:
    raise ConfigError("zero_optimization.legacy_stage1: the deprecated version "
                      "of ZeRO Stage 1 is not supported in deepspeed >= 0.5.9")
  # The optimizer-offload keys are read here, not by _section (not numbers).
  own = ("offload_optimizer", "cpu_offload")
  vals = _section({"zero_optimization": {k: v for k, v in d.items()
                                         if k not in own}}
                  if isinstance(d, Mapping) else raw,
                  "zero_optimization", ZeroConfig)
  stage = vals.get("stage", 0)
  if isinstance(d, Mapping):   # DeepSpeed's pydantic checks come first
    for k in ("offload_optimizer", "offload_param"):
      if d.get(k) != "auto":
        device = offload.check(k, d.get(k), stage)
        if k == "offload_optimizer":
          vals["offload_optimizer"] = device
    if d.get("cpu_offload") not in (None, "auto"):   # deprecated form
      if as_bool("zero_optimization.cpu_offload", d["cpu_offload"]) and \
          vals.get("offload_optimizer", "none") == "none":
        vals["offload_optimizer"] = "cpu"
    section = d.get("offload_optimizer")
    if (vals.get("offload_optimizer") == "cpu" and isinstance(section, Mapping)
        and not section.get("pin_memory", True)):
      _PENDING.append(("offload_optimizer.pin_memory", offload.PINNED_ANYWAY,
                       _NO_EFFECT))
  if stage not in (0, 1, 2):
    raise ConfigError(
        f"zero_optimization.stage={stage} is not supported: zero1_jax "
        "implements ZeRO stages 1 (optimizer-state sharding) and 2 (+ gradient "
        "sharding), and runs stage 0 (plain data parallelism) as stage 1, "
        "which trains the same weights; stage 3 also shards parameters. Use "
        "\"stage\": 1 or 2")
  return ZeroConfig(**vals)


def _named(raw: Mapping, key: str, cls):
  d = raw.get(key)
  if d is None:
    return None
  if not isinstance(d, Mapping):
    raise ConfigError(f"section '{key}' must be an object, got {d!r}")
  allowed = {"type", "params"} | ({"legacy_fusion"} if key == "optimizer"
                                   else set())
  for k in d:
    if k not in allowed:
      raise _unknown(k, key, allowed)
  if "legacy_fusion" in d:
    logger.info("optimizer.legacy_fusion=%r has no effect: it picks"
                " a fused CUDA kernel", d["legacy_fusion"],
                extra={"zero1_no_effect": "optimizer.legacy_fusion"})
  if not isinstance(d.get("type"), str):
    raise ConfigError(f"{key}.type must name the {key}, got {d.get('type')!r}")
  params = d.get("params") or {}
  if not isinstance(params, Mapping):
    raise ConfigError(f"{key}.params must be an object, got {params!r}")
  for k, v in params.items():
    if v == "auto":
      raise ConfigError(f"{key}.params.{k}='auto' must be filled in before "
                        "loading (the HF Trainer does that, DeepSpeed does not)")
  return cls(type=d["type"], params=copy.deepcopy(dict(params)))


def _build(raw: Mapping, world_size: int | None, source: str | None
           ) -> DeepSpeedConfig:
  if not isinstance(raw, Mapping):
    raise ConfigError("a DeepSpeed config must be a JSON object, got "
                      f"{type(raw).__name__}")
  raw = copy.deepcopy(dict(raw))
  _PENDING.clear()
  removed = keys.removed_key_error(raw)   # DeepSpeed checks these first
  if removed:
    raise ConfigError(removed)
  _refuse_auto(raw)   # monitor sections' "auto" is dropped
  for k in raw:
    if k not in keys.TOP_LEVEL:
      _PENDING.append(("", _unknown_top(k, raw), UnknownKeyWarning))
  if world_size is None:
    import jax  # pylint: disable=import-outside-toplevel
    world_size = jax.device_count()
  world_size = as_int("world_size", world_size, 1)
  batch_triple.check_parallelism(raw)
  fp16 = FP16Config(**_section(raw, "fp16", FP16Config))
  bf16 = BF16Config(**_section(
      raw, "bf16" if raw.get("bf16") is not None else "bfloat16", BF16Config))
  if fp16.enabled and bf16.enabled:
    raise ConfigError("bfloat16 and fp16 modes cannot be simultaneously "
                      "enabled (fp16.enabled and bf16.enabled are both true)")
  _check_dynamic_fp16(fp16)
  zero = _parse_zero(raw)
  comm = raw.get("communication_data_type")
  if comm is not None:
    if not isinstance(comm, str) or comm.lower() not in keys.COMM_DTYPES:
      raise ConfigError("Invalid communication_data_type. Supported data "
                        f"types: {list(keys.COMM_DTYPES)}. Got: {comm!r}")
    comm = comm.lower()
  for k, v in raw.items():
    if k in keys.NOTES:
      _note(k, v)
  tb, mb, ga = batch_triple.resolve(raw, world_size)
  spp = raw.get("steps_per_print")
  cfg = DeepSpeedConfig(
      train_batch_size=tb, train_micro_batch_size_per_gpu=mb,
      gradient_accumulation_steps=ga, world_size=world_size, fp16=fp16,
      bf16=bf16, zero=zero, optimizer=_named(raw, "optimizer", OptimizerConfig),
      scheduler=_named(raw, "scheduler", SchedulerConfig),
      gradient_clipping=as_float("gradient_clipping",
                                 raw.get("gradient_clipping", 1.0)),
      steps_per_print=None if spp is None else as_int("steps_per_print", spp, 1),
      zero_allow_untested_optimizer=as_bool(
          "zero_allow_untested_optimizer",
          raw.get("zero_allow_untested_optimizer", False)),
      communication_data_type=comm, monitor=monitor.parse(raw), raw=raw,
      source=source)
  if not zero.compute_grad_norm and cfg.gradient_clipping > 0:
    raise ConfigError("zero_optimization.compute_grad_norm=false requires "
                      "gradient_clipping=0 (DeepSpeed 0.19 clips by 1.0 when "
                      "the key is absent: set \"gradient_clipping\": 0)")
  optim.check(cfg.optimizer, cfg.scheduler, zero_stage=cfg.zero.stage,
              allow_untested=cfg.zero_allow_untested_optimizer)
  _say_pending()       # only a valid config's notes, after its errors
  return cfg


def _check_dynamic_fp16(fp16: FP16Config) -> None:
  """runtime/precision_config.py checks these only for dynamic fp16."""
  if not (fp16.enabled and fp16.dynamic_loss_scale):
    return
  for k in ("loss_scale_window", "min_loss_scale"):
    if getattr(fp16, k) <= 0:
      raise ConfigError(f"fp16.{k} must be > 0 with dynamic loss scaling, "
                        f"got {getattr(fp16, k)}")
  if fp16.hysteresis < 1:
    raise ConfigError(
        f"fp16.hysteresis={fp16.hysteresis} is not supported: DeepSpeed "
        "accepts it and then never lowers the loss scale. Use hysteresis >= 1.")


def load_config(config: str | os.PathLike | Mapping,
                world_size: int | None = None) -> DeepSpeedConfig:
  """Parse + validate a DeepSpeed config given as a JSON path or a dict.

  world_size is the data-parallel size used to resolve the batch triple
  (None: jax.device_count()).
  """
  source = None
  if isinstance(config, (str, os.PathLike)):
    source = os.fspath(config)
    try:
      with open(source, encoding="utf-8") as f:
        text = f.read()
    except OSError as e:
      raise ConfigError(f"cannot read DeepSpeed config {source!r}: "
                        f"{e.strerror or e}") from e
    config = parse_text(text, source)
  return _build(config, world_size, source)
