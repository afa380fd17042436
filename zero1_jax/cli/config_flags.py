"""zero1-train's flags applied to the DeepSpeed JSON: ``"auto"`` values filled
as the HF Trainer fills them (:mod:`.hf_auto`), then each given flag set on
top, a JSON value that differs being an error naming both
(:meth:`DeepSpeedConfig.with_overrides`)."""

from __future__ import annotations

import datetime
import logging
import os
import socket

from zero1_jax.cli import common, hf_auto, train_args

log = logging.getLogger("zero1_jax")


def load(zconfig, path: str, world_size: int, flags: dict, *, max_steps: int,
         hidden_size):
  """:func:`_load`; a config error that a flag caused, or that a flag would
  fix, says which flag."""
  try:
    return _load(zconfig, path, world_size, flags, max_steps=max_steps,
                 hidden_size=hidden_size)
  except zconfig.ConfigError as e:
    hint = _flag_hint(str(e), flags)
    if not hint:
      raise
    raise type(e)(f"{e}; {hint}") from None


def _flag_hint(message: str, flags: dict) -> str | None:
  if "needs to be provided" in message:
    return ("zero1-train's --per_device_train_batch_size gives the micro "
            "batch")
  if "both true" in message:
    for flag, other in (("bf16", "fp16"), ("fp16", "bf16")):
      if flags.get(flag):
        return (f"--{flag} set {flag}.enabled and the JSON enables {other}: "
                f"drop --{flag} or set {other}.enabled false in the JSON")
  return None


def _load(zconfig, path: str, world_size: int, flags: dict, *, max_steps: int,
          hidden_size):
  """The JSON with its "auto" values filled as the HF Trainer fills them
  (:mod:`.hf_auto`) and the command-line flags applied, validated once: an
  error names the numbers the flags gave (not the JSON's alone), and the
  config's notes are printed only once it is valid. ``hidden_size()``: the
  model's, for an "auto" reduce_bucket_size."""
  raw = read_json(path)
  flags = dict(flags)
  monitors = (flags.pop("report_to", None), flags.pop("logging_dir", None),
              flags.pop("output_dir", None))
  warmup = flags.pop("warmup_steps", None)
  hf_builds = isinstance(raw, dict) and raw.get("optimizer") is None
  betas = (flags.pop("adam_beta1", None), flags.pop("adam_beta2", None))
  if betas != (None, None):
    now = ((((raw or {}).get("optimizer") or {}).get("params") or {}).get("betas")
           if isinstance(raw, dict) else None)
    base = list(now) if isinstance(now, list) and len(now) == 2 else [
        hf_auto.HF_DEFAULTS["adam_beta1"], hf_auto.HF_DEFAULTS["adam_beta2"]]
    flags[hf_auto.BETAS] = [b if b is not None else o for b, o in zip(betas, base)]
  if warmup is not None:
    sched = (raw or {}).get("scheduler") if isinstance(raw, dict) else None
    now = ((sched or {}).get("params") or {}).get("warmup_num_steps", "unset")
    if now != "auto" and now != warmup and not (hf_builds and sched is None):
      has = "none" if now == "unset" else repr(now)
      raise common.UsageError(
          f"--warmup_steps {warmup} fills scheduler.params.warmup_num_steps="
          f"'auto', but {path} has {has} there: set it in the JSON instead "
          "(or make it 'auto')")
  said = []
  if isinstance(raw, dict):
    flags.update(monitor_flags(raw, *monitors))
    try:    # before any parameter exists: the HF Trainer's AdamW, said once valid
      said = [hf_auto.hf_optimizer(raw, flags=dict(flags, warmup_steps=warmup),
                                   max_steps=max_steps)]
    except ValueError as e:
      raise common.UsageError(f"{path}: {e}") from None
  if isinstance(raw, dict) and hf_auto.has_auto(raw):
    try:
      filled = hf_auto.fill(raw, flags=dict(flags, warmup_steps=warmup),
                            max_steps=max_steps, hidden_size=hidden_size())
    except ValueError as e:
      raise common.UsageError(f"{path}: {e}") from None
    if filled:
      log.info("'auto' in the config, filled as the HF Trainer "
               "does: %s", "; ".join(filled))
  elif all(v is None for v in flags.values()) and not any(said):
    return zconfig.load_config(path, world_size=world_size)
  if not isinstance(raw, dict):   # load_config says what is wrong with it
    return zconfig.load_config(path, world_size=world_size)
  stub = zconfig.DeepSpeedConfig(1, 1, 1, world_size, raw=raw, source=path)
  cfg = stub.with_overrides(flag_names=FLAG_NAMES, **flags)
  for line in filter(None, said):
    log.info("%s", line)
  return cfg


def monitor_flags(raw: dict, report_to, logging_dir, output_dir) -> dict:
  """``--report_to`` / ``--logging_dir`` as overrides of the JSON's monitor
  sections: each section named is enabled; tensorboard and csv write to
  --logging_dir, else to the JSON's output_path, else to the HF Trainer's
  default OUTPUT_DIR/runs/<time>_<host> (transformers 5.x
  integrations/integration_utils.py default_logdir)."""
  out = {}
  named = train_args.report_sections(report_to)
  for sec in named:
    out[f"{sec}__enabled"] = True
  dirs = [s for s in ("tensorboard", "csv_monitor") if s in named or (
      isinstance(raw.get(s), dict) and raw[s].get("enabled") is True)]
  if logging_dir is not None and not dirs:
    raise common.UsageError(
        f"--logging_dir {logging_dir}: nothing writes there; add --report_to "
        "tensorboard (or csv), or enable a tensorboard / csv_monitor section "
        "in the JSON")
  for sec in dirs:
    given = isinstance(raw.get(sec), dict) and "output_path" in raw[sec]
    if logging_dir is None and (given or sec not in named):
      continue
    where = logging_dir
    if where is None:
      stamp = datetime.datetime.now().strftime("%b%d_%H-%M-%S")
      where = os.path.join(output_dir or ".", "runs",
                           f"{stamp}_{socket.gethostname()}")
    out[f"{sec}__output_path"], out[f"{sec}__job_name"] = where, ""
  return out


_FLAG_OF = {hf_auto.WEIGHT_DECAY: "weight_decay", hf_auto.EPS: "adam_epsilon",
            hf_auto.BETAS: "adam_beta1/--adam_beta2"}
# The command-line flag of each override (errors name what the user typed).
FLAG_NAMES = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
              "gradient_accumulation_steps": "--gradient_accumulation_steps",
              "train_batch_size": "--train_batch_size", "lr": "--learning_rate",
              "fp16": "--fp16", "bf16": "--bf16",
              "gradient_clipping": "--max_grad_norm",
              **{f"{s}__{k}": f"--report_to/--logging_dir ({s}.{k})"
                 for s in ("tensorboard", "csv_monitor", "wandb")
                 for k in ("enabled", "output_path", "job_name")},
              **{k: "--" + v for k, v in _FLAG_OF.items()}}


def read_json(path: str):
  """The config in ``path`` (JSON or Hjson, as DeepSpeed reads it), or None
  when it cannot be read (then ``load_config`` names the problem)."""
  from zero1_jax.deepspeed import config as zconfig
  try:
    with open(path, encoding="utf-8") as f:
      return zconfig.parse_text(f.read(), path)
  except (OSError, ValueError):
    return None


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps")


def pinned_batch_keys(path: str) -> frozenset:
  """The batch keys the JSON in ``path`` sets to a value (not "auto"): a
  flag may fill them only with the same value."""
  raw = read_json(path)
  if not isinstance(raw, dict):
    return frozenset()
  return frozenset(k for k in BATCH_KEYS if raw.get(k, "auto") != "auto")
