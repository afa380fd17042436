"""What ``Engine.load_checkpoint`` reads besides the arrays: which step to
load, and why a checkpoint does not fit.

DeepSpeed's ``load_checkpoint(dir)`` loads the tag its ``latest`` file names
(the last save), not the highest step; ``Checkpointer`` keeps that file and
loads it, and :func:`warn_uncommitted_latest` says when it names a save that
never committed. A
scheduler or optimizer type added or removed between save and resume changes
the optimizer state's tree; :func:`config_change` names that change.

Example::

  warn_uncommitted_latest(ckpt)   # before load_checkpoint(dir) with no tag
"""

from __future__ import annotations

import json
import logging

from zero1_jax import checkpoint

logger = logging.getLogger("zero1_jax")


def warn_uncommitted_latest(ckpt: checkpoint.Checkpointer) -> None:
  """Says so when the directory's ``latest`` file names a save that never
  committed (interrupted): the load then takes the highest committed step
  (``Checkpointer.latest_step``)."""
  ckpt.wait()
  step = checkpoint.steps.read_latest(ckpt.directory)
  if step is not None and step not in ckpt.all_steps():
    logger.warning("zero1 checkpoint: %s names step %d, whose save never "
                   "committed (interrupted?); loading the highest committed "
                   "step instead", ckpt.directory / checkpoint.steps.LATEST,
                   step)


def config_change(ckpt: checkpoint.Checkpointer, step: int | None,
                  config: dict) -> str:
  """What of the ``optimizer``/``scheduler`` sections of ``config`` (a
  DeepSpeed dict) differs from those ``step`` was saved with, and what to
  do; "" when nothing differs or the saved config cannot be read."""
  try:
    saved = ckpt.metadata(step).get("config") or {}
  except Exception:  # pylint: disable=broad-except
    return ""
  changed = [k for k in ("optimizer", "scheduler")
             if saved.get(k) != config.get(k)]
  if not changed:
    return ""
  was = "; ".join(f'"{k}": {json.dumps(saved.get(k))} when saved, '
                  f'{json.dumps(config.get(k))} now' for k in changed)
  return (f"The config differs ({was}): a scheduler or optimizer type added "
          f"or removed changes the optimizer state, so resume with the config "
          f"it was saved with (stored in its step)")
