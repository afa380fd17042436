"""``zero1-train --resume latest|latest-valid|STEP``: whether there is a
checkpoint to continue from (:func:`wanted`, asked before the parameters
exist) and the load itself, with what process 0 says about it (:func:`load`).

The checkpoints are ``OUTPUT_DIR/checkpoints``; ``latest`` with none there is
an error (a mistyped ``--output_dir`` must not restart training from step 0).
"""

from __future__ import annotations

import os

from zero1_jax.cli import common, reports, rundir


def wanted(args, ckpt_dir: str) -> bool:
  """Whether --resume has a checkpoint to load. ``latest`` with none is an
  error (a mistyped --output_dir must not restart training), and so is a
  finished run that saved none, except after a run that stopped before its
  first save (its metrics are there, its summary is not)."""
  if not args.resume:
    return False
  if args.resume not in ("latest", "latest-valid"):
    try:
      int(args.resume)
    except ValueError:
      raise common.UsageError(f"--resume takes latest, latest-valid or a step "
                              f"number, got {args.resume!r}") from None
    return True
  from zero1_jax import checkpoint
  if os.path.isdir(ckpt_dir) and (
      checkpoint.committed_steps(ckpt_dir) or args.resume == "latest-valid"):
    return True
  if rundir.finished(args.output_dir):
    raise common.UsageError(
        f"--resume {args.resume}: the run in {args.output_dir} finished "
        f"without saving a checkpoint (it had no --save_steps), so there is "
        f"nothing to continue from. Pass --overwrite_output_dir to run it "
        f"again, or another --output_dir")
  if rundir.has_metrics(args.output_dir):
    print(f"[zero1-train] --resume {args.resume}: the run in {args.output_dir} "
          f"stopped before its first checkpoint; starting it again from step 0",
          flush=True)
    reports.report_unfinished_saves(ckpt_dir)   # that first save, cut short
    return False
  raise common.UsageError(
      f"--resume {args.resume}: no checkpoint in {ckpt_dir} (is --output_dir "
      f"right?). Drop --resume to start a new run")


def load(engine, args, ckpt_dir, main_process=True) -> None:
  """--resume latest|latest-valid|STEP (checked by :func:`wanted`); process 0
  says what it resumed (every process loads the same step)."""
  from zero1_jax import checkpoint
  tag = None if args.resume in ("latest", "latest-valid") else int(args.resume)
  try:
    _, extra = engine.load_checkpoint(
        ckpt_dir, tag, fallback_to_valid=args.resume == "latest-valid")
  except checkpoint.UnreadableCheckpointError as e:
    if args.resume != "latest":
      raise
    raise common.UsageError(f"{e}. --resume latest-valid continues from the "
                            f"newest step that is readable") from None
  if not main_process:
    return
  print(f"[zero1-train] resumed from {ckpt_dir} at step {engine.global_steps} "
        f"(data position {extra.get('data_step', engine.global_steps)})",
        flush=True)
  reports.report_batch_change(engine, args.output_dir)
  reports.report_unfinished_saves(ckpt_dir)
  later = [s for s in checkpoint.committed_steps(ckpt_dir)
           if s > engine.global_steps]
  if later:
    print(f"[zero1-train] step {', '.join(map(str, later))} in {ckpt_dir}: "
          f"from the run before this resume, not continued (once this run "
          f"saves, --resume latest and zero1-export take its last save; a "
          f"save at the same step replaces one)", flush=True)
