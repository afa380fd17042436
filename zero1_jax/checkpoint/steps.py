"""Which steps a checkpoint directory holds, read from the directory alone.

orbax writes a step into a temporary directory and renames it when the save
is finalized (on object stores it writes ``commit_success.txt`` last and
records the commit time in ``_CHECKPOINT_METADATA``); a step directory
without either is an interrupted save and is never listed or loaded. No orbax
manager is built, so no process waits on the others: a process can list the
steps while its peers are busy in a step, or gone.

Example:
  >>> import tempfile
  >>> committed_steps(tempfile.mkdtemp())
  []
"""

from __future__ import annotations

import json
import re

from etils import epath

from zero1_jax.checkpoint import lifecycle

COMMIT = "commit_success.txt"
LATEST = "latest"   # DeepSpeed's name: the tag of the last save


def write_latest(directory, step: int) -> None:
  """Records ``step`` as the last one saved in ``directory`` (DeepSpeed's
  ``latest`` file, written whole by a rename: a reader never sees half)."""
  d = lifecycle.absolute(directory)
  tmp = d / f".{LATEST}.tmp"
  tmp.write_text(f"{int(step)}\n")
  tmp.replace(d / LATEST)


def read_latest(directory) -> int | None:
  """The step the ``latest`` file of ``directory`` names (None: no file, or
  not a step number)."""
  try:
    text = (lifecycle.absolute(directory) / LATEST).read_text().strip()
  except OSError:
    return None
  return int(text) if text.isdigit() else None


def latest_step(directory) -> int | None:
  """The step a resume continues from: the last one saved (the ``latest``
  file, as DeepSpeed), when it committed; else the highest committed step;
  None when there is none. A run resumed from an earlier step and saved
  again leaves higher steps of the run before it: they are not "latest".

  Example::

    latest_step("out/checkpoints")   # 15 after saves 5, 10, 15, 20, then 10 -> 15
  """
  committed = committed_steps(directory)
  named = read_latest(directory)
  if named is not None and named in committed:
    return named
  return committed[-1] if committed else None


def committed_steps(directory) -> list[int]:
  """The committed steps in ``directory``, oldest first, read from the
  directory alone: no orbax manager, so no collective. A process can call it
  while the others of its job are busy, or gone (after a Ctrl-C).

  Example::

    committed_steps("out/checkpoints")     # [2, 4, 6]; [] when there is none
  """
  return sorted(s for s, p in step_dirs(lifecycle.absolute(directory)).items()
                if is_committed(p))


def step_dirs(directory: epath.Path) -> dict[int, epath.Path]:
  """Every step directory (a name of digits) in ``directory``, committed or not."""
  if not directory.is_dir():
    return {}
  return {int(p.name): p for p in directory.iterdir()
          if re.fullmatch(r"\d+", p.name) and p.is_dir()}


def is_committed(path: epath.Path) -> bool:
  """Whether the step directory ``path`` holds a finalized save."""
  if (path / COMMIT).exists():
    return True
  try:   # orbax records the commit time in the step metadata at finalize
    meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
    return meta.get("commit_timestamp_nsecs") is not None
  except (OSError, ValueError):
    return False


def nearby_hint(directory) -> str:
  """Where the steps are when ``directory`` holds none: a run directory
  (zero1-train's OUTPUT_DIR, steps in ``checkpoints/``) or one step's own
  directory. ``""`` when neither."""
  d = lifecycle.absolute(directory)
  inner = committed_steps(d / "checkpoints")
  if inner:
    return (f"; it holds a run: its checkpoints (steps {inner}) are in "
            f"{d / 'checkpoints'}")
  if re.fullmatch(r"\d+", d.name) and int(d.name) in committed_steps(d.parent):
    return (f"; it is step {d.name}'s own directory: pass the directory that "
            f"holds the steps, {d.parent}, and the step number ({d.name})")
  return ""


def unfinished_steps(directory) -> list[int]:
  """Steps whose save was cut short (kill -9, power loss): orbax's temporary
  ``<step>.orbax-checkpoint-tmp*`` directory, or a step directory never
  committed. They are never loaded."""
  d = lifecycle.absolute(directory)
  if not d.is_dir():
    return []
  cut = {s for s, p in step_dirs(d).items() if not is_committed(p)}
  cut |= {int(m.group(1)) for p in d.iterdir()
          if (m := re.fullmatch(r"(\d+)\..*tmp.*", p.name))}
  return sorted(cut)
