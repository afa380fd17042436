"""What zero1-train says about a run's state: step lines, resumes, saves.

Each function prints (or returns) one message for the main process; none
changes the run. Split from :mod:`zero1_jax.cli.train`, which decides what
happens.
"""

from __future__ import annotations

import json
import logging
import os

from zero1_jax.cli import common


def report_batch_change(engine, output_dir: str) -> None:
  """A resume with another global batch (other --num_devices or micro batch
  with a derived train_batch_size) trains on, as DeepSpeed and the HF
  Trainer do, but says so: the run's ds_config.json is rewritten with it."""
  try:
    with open(os.path.join(output_dir, "ds_config.json")) as f:
      before = json.load(f)["train_batch_size"]
  except (OSError, ValueError, KeyError):
    return
  cfg = engine.config
  if before != cfg.train_batch_size:
    print(f"[zero1-train] note: the global batch changes at step "
          f"{engine.global_steps} from {before} to {cfg.train_batch_size} "
          f"sequences ({cfg.train_micro_batch_size_per_gpu} per device x "
          f"{cfg.gradient_accumulation_steps} accumulation x {cfg.world_size} "
          f"devices); the data order from here differs from a run at "
          f"{before}", flush=True)


class DropOrbaxTmpNotice(logging.Filter):
  """orbax's absl WARNING on re-saving an unfinished step's directory: said
  once, in zero1-train's own words, by :func:`report_unfinished_saves`."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "since it is not finalized" not in record.getMessage()


class NoEffectNotes(logging.Filter):
  """Keeps back the config's per-key "has no effect" INFO lines (records
  with ``zero1_no_effect``, deepspeed/config.py) and collects their keys, so
  that :meth:`summary` says them in one line: the demo's own config opened
  with three of them, one 230 characters long."""

  def __init__(self) -> None:
    super().__init__()
    self.keys: list[str] = []

  def filter(self, record: logging.LogRecord) -> bool:
    key = getattr(record, "zero1_no_effect", None)
    if key is None:
      return True
    if key not in self.keys:
      self.keys.append(key)
    return False

  def summary(self) -> str | None:
    """``3 keys of this config are accepted; each has no effect here: ...``
    (None: no such key)."""
    if not self.keys:
      return None
    n = len(self.keys)
    what = (f"{n} keys of this config are accepted; each has" if n > 1 else
            "1 key of this config is accepted and has")
    return (f"{what} no effect here: {', '.join(self.keys)} (why, key by "
            f"key: docs/deepspeed_config.md)")


def report_unfinished_saves(ckpt_dir: str) -> None:
  """A save cut short (kill -9, power loss) leaves a step directory that is
  never loaded; say so, instead of orbax's warning when it is replaced."""
  from zero1_jax.checkpoint import steps
  cut = steps.unfinished_steps(ckpt_dir)
  if cut:
    print(f"[zero1-train] step {', '.join(map(str, cut))} in {ckpt_dir}: a "
          f"save cut short, never loaded; replaced when saved again", flush=True)
    logging.getLogger("absl").addFilter(DropOrbaxTmpNotice())


def span(first: int, last: int) -> str:
  """'step 3' or 'steps 3-7'."""
  return f"step {first}" if first == last else f"steps {first}-{last}"


def where(ckpt_dir: str) -> str:
  """The committed step a --resume latest continues from, read from the
  directory alone: an orbax manager's constructor syncs every process, and
  another may be stuck in a step this one never joins."""
  from zero1_jax.checkpoint import steps
  last = steps.latest_step(ckpt_dir)
  if last is None:
    return ("no checkpoint was saved yet (--save_steps): --resume latest "
            "starts again from step 0")
  return (f"the last checkpoint is step {last} in {ckpt_dir}: "
          f"--resume latest continues from it")


def step_line(row: dict, fp16: bool, engine) -> str:
  """``step N loss L [scale S] R samples/s``; a skipped step says so, with
  the loss scale it halves to (DeepSpeed's "OVERFLOW! Skipping step")."""
  loss = float("nan") if row["loss"] is None else row["loss"]
  scale = f" scale {row['loss_scale']:.0f}" if fp16 else ""
  line = f"step {row['step']:5d} loss {loss:.4f}{scale} {row['samples_per_s']:.1f} samples/s"
  if row["skipped"]:
    why = "gradient overflow" if fp16 else "inf/nan gradients"
    after = float(engine.loss_scale) if fp16 else None
    if not fp16:
      scale = ""
    elif after == row["loss_scale"]:
      scale = f"; loss scale stays {after:.0f} (hysteresis)"
    else:
      scale = f"; loss scale {row['loss_scale']:.0f} -> {after:.0f}"
    line += f"  SKIPPED ({why}: weights and optimizer state unchanged{scale})"
  return line


def fp16_skip_note(fp16, step: int, scale: float | None = None) -> str | None:
  """The first skipped step of a dynamic fp16 run, explained once (it was
  explained only in a plot legend): the loss scale starts high on purpose
  and comes down by skipping steps. None for other skips (static scale,
  bf16, fp32, or a step tried at a ``scale`` other than the initial one,
  as after a resume: the step line says why)."""
  if not (fp16.enabled and fp16.dynamic_loss_scale):
    return None
  p = fp16.initial_scale_power
  if scale is not None and scale != 2.0 ** p:
    return None
  whose = "DeepSpeed's default" if p == 16 else "fp16.initial_scale_power"
  return (f"[zero1-train] fp16: step {step} skipped, as expected in the first "
          f"steps: the dynamic loss scale starts at 2^{p} ({whose}), too high "
          f"for these gradients in fp16; each overflow skips its step (weights "
          f"and optimizer state unchanged) and halves the scale until they "
          f"fit. Skipped steps count toward --max_steps, as in DeepSpeed")


def nothing_to_train(engine, args, ckpt_dir: str, main_process) -> dict | None:
  """A resume at or past --max_steps: says so and leaves every file in the
  output directory as it was (metrics, summary, plots, config)."""
  if not main_process:
    return None
  print(f"[zero1-train] nothing to train: the run is at step "
        f"{engine.global_steps} (--max_steps {args.max_steps}; a larger one "
        f"continues it); {args.output_dir} left as it was", flush=True)
  try:
    with open(os.path.join(args.output_dir, "summary.json")) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def report_setting_change(engine, args) -> None:
  """A resume with another ZeRO stage, device count, micro batch or dtype
  trains on (the checkpoint reshards) but says so; summary.json keeps each
  segment's settings under "segments"."""
  earlier = common.earlier_segments(args.output_dir, engine.global_steps)
  if not earlier:
    return
  before = earlier[-1]   # the stretch that trained up to this step
  now = common.run_record(args, engine)
  keys = ("zero_stage", "num_devices", "num_processes",
          "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
          "dtype")
  changed = [f"{k} {before[k]} -> {now[k]}" for k in keys
             if k in before and before[k] != now[k]]
  if changed:
    print(f"[zero1-train] note: from step {engine.global_steps} this run "
          f"trains with {', '.join(changed)}; summary.json keeps each "
          f"segment's settings under \"segments\"", flush=True)
