"""``--output_dir``: one run per directory, as the HF Trainer does it.

A non-empty output directory is refused unless ``--resume`` continues the run
in it or ``--overwrite_output_dir`` replaces it (only the files zero1-train
writes are removed). A file in its place, or ``--resume`` with nothing to
resume, is one line and exit 2.

Example:
  >>> import tempfile, os
  >>> d = tempfile.mkdtemp()
  >>> check(d, overwrite=False, resume=None) == os.path.abspath(d)
  True
"""

from __future__ import annotations

import os
import shutil

from zero1_jax.cli.common import UsageError

RUN_FILES = ("metrics.jsonl", "summary.json", "segments.json",
             "ds_config.json", "loss_curve.png", "memory.png", "checkpoints")


def check(output_dir: str, *, overwrite: bool, resume: str | None) -> str:
  """Refuses a directory that would mix two runs; returns its absolute path.
  Touches nothing (safe to call from every process and the launcher)."""
  path = os.path.abspath(os.path.expanduser(output_dir))
  if os.path.exists(path) and not os.path.isdir(path):
    raise UsageError(f"--output_dir {output_dir} is a file, not a directory")
  if overwrite and resume:
    raise UsageError("--overwrite_output_dir and --resume contradict each "
                     "other: resume continues the run in --output_dir, "
                     "overwrite replaces it")
  entries = sorted(os.listdir(path)) if os.path.isdir(path) else []
  if entries and not (overwrite or resume):
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    ckpts = os.path.join(path, "checkpoints")
    saved = os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts))
    fix = ("Pass --resume latest to continue it, --overwrite_output_dir to "
           "replace it, or another --output_dir" if saved else
           "It saved no checkpoint (no --save_steps), so it cannot be "
           "continued: pass --overwrite_output_dir to replace it, or another "
           "--output_dir")
    raise UsageError(
        f"--output_dir {output_dir} is not empty ({shown}): it holds an earlier "
        f"run. {fix}")
  return path


def clear(path: str) -> list[str]:
  """``--overwrite_output_dir``: removes what an earlier run wrote there;
  returns the names removed (zero1-train lists them)."""
  gone = []
  for name in RUN_FILES:
    p = os.path.join(path, name)
    if os.path.isdir(p) and not os.path.islink(p):
      shutil.rmtree(p)
    elif os.path.lexists(p):
      os.remove(p)
    else:
      continue
    gone.append(name + "/" if name == "checkpoints" else name)
  return gone


def has_metrics(path: str) -> bool:
  return os.path.exists(os.path.join(path, "metrics.jsonl"))


def finished(path: str) -> bool:
  """Whether the run in ``path`` ran to its end (it wrote its summary)."""
  return os.path.exists(os.path.join(path, "summary.json"))
