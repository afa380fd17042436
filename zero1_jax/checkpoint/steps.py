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
