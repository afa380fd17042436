"""A committed step's files, checked before a restore reads any of them.

After a save commits, :class:`~zero1_jax.checkpoint.Checkpointer` lists every
file of the step and its size in ``<step>/zero1_files.json`` (:func:`record`).
A restore first finds the step's directory (:func:`step_path`): present,
committed (:mod:`.steps`), written by zero1_jax (its four items ``params``,
``state``, ``meta``, ``extra``), complete, and every recorded file at its
recorded size; each failure is an :class:`UnreadableCheckpointError` naming
the step and the file. :func:`read_json` reads the ``meta`` / ``extra`` items
through that check.

Example:
  >>> import tempfile
  >>> from etils import epath
  >>> d = epath.Path(tempfile.mkdtemp())
  >>> (d / "a").mkdir(); _ = (d / "a" / "x.bin").write_text("123")
  >>> files_of(d, FILES)
  {'a/x.bin': 3}
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
from etils import epath

from zero1_jax.checkpoint import steps
from zero1_jax.checkpoint.reshard import UnreadableCheckpointError

FILES = "zero1_files.json"      # every file of a committed step and its size
# the items of a zero1 step and the file orbax writes last in each
REQUIRED = {"params": "_METADATA", "state": "_METADATA", "meta": "metadata",
            "extra": "metadata"}


def files_of(path, skip: str) -> dict[str, int]:
  """Size of every file under ``path`` (an ``epath.Path``), by relative name."""
  out, todo = {}, [path]
  while todo:
    for f in todo.pop().iterdir():
      if f.is_dir():
        todo.append(f)
      elif f.name != skip:
        out[os.path.relpath(str(f), str(path))] = f.stat().length
  return out


def record(path: epath.Path) -> None:
  """Writes the committed step ``path``'s files and sizes to its
  ``zero1_files.json`` (process 0; a temporary file renamed into place)."""
  if jax.process_index() == 0:
    tmp = path / (FILES + ".tmp")
    tmp.write_text(json.dumps(files_of(path, FILES), indent=0))
    tmp.rename(path / FILES)


def record_if_missing(directory: epath.Path, step: int) -> None:
  """Lists ``step``'s files once a restore has read every one of them, where
  the list is missing: a run killed between orbax's commit and
  :func:`record` left none, and a later truncation would then be named
  only by orbax's read error. A directory that cannot be written (a
  read-only copy) keeps the step as it is."""
  path = steps.step_dirs(directory).get(step)
  if path is None or (path / FILES).exists():
    return
  try:
    record(path)
  except OSError:
    pass


def step_path(directory: epath.Path, step: int) -> epath.Path:
  """The committed, complete directory of ``step``, else a clear error."""
  path = steps.step_dirs(directory).get(step)
  where = f"zero1 checkpoint: step {step} in {directory}"
  if path is None:
    tmp = [p.name for p in directory.iterdir()
           if p.name.startswith(f"{step}.") and "tmp" in p.name] \
        if directory.is_dir() else []
    if tmp:
      raise UnreadableCheckpointError(
          f"{where} is an unfinished save ({tmp[0]}); it is never loaded")
    raise UnreadableCheckpointError(
        f"{where} not found (committed steps: "
        f"{steps.committed_steps(directory)})")
  if not steps.is_committed(path):
    raise UnreadableCheckpointError(
        f"{where} was never committed (no {step}/{steps.COMMIT}): an interrupted "
        f"save; it is never loaded")
  if not any((path / item).exists() for item in REQUIRED):
    items = sorted(p.name for p in path.iterdir() if p.is_dir())
    raise UnreadableCheckpointError(
        f"{where} is not a zero1_jax checkpoint (it holds {items}: written "
        f"by orbax itself?); zero1_jax.checkpoint reads what its "
        f"Checkpointer.save wrote. Restore this one with orbax at the N it "
        f"was saved at; if it is an optax run's optimizer state, restore it "
        f"against that optax state's template (jax.eval_shape("
        f"tx.inner.init, params)) and convert it with "
        f"z1.from_optax_state(tx, optax_state, params), or a flax "
        f"TrainState checkpoint with z1.flax.restore_checkpoint(ckpt_dir, "
        f"state). (Restored into zero1's state with partial_restore=True, "
        f"its moments and counts would start again at 0.)")
  for item, name in REQUIRED.items():
    if not (path / item / name).exists():
      raise UnreadableCheckpointError(
          f"{where} is incomplete: file {step}/{item}/{name} is missing")
  return _check_sizes(path, step, where)


def _check_sizes(path: epath.Path, step: int, where: str) -> epath.Path:
  """``path`` if every file ``zero1_files.json`` lists is there at its size."""
  try:
    saved = json.loads((path / FILES).read_text())
  except (OSError, ValueError):
    return path            # not recorded (saved elsewhere): orbax checks
  now = files_of(path, FILES)
  for name, size in sorted(saved.items()):
    if name not in now:
      raise UnreadableCheckpointError(
          f"{where} is incomplete: file {step}/{name} is missing")
    if now[name] != size:
      raise UnreadableCheckpointError(
          f"{where} is damaged: file {step}/{name} has {now[name]} bytes, "
          f"{size} when saved (truncated or overwritten)")
  return path


def read_json(directory: epath.Path, step: int, item: str) -> Any:
  """The JSON item ``meta`` or ``extra`` of ``step``, checked first."""
  path = step_path(directory, step) / item / REQUIRED[item]
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise UnreadableCheckpointError(
        f"zero1 checkpoint: step {step} in {directory} is unreadable: "
        f"file {step}/{item}/{REQUIRED[item]} is damaged or truncated "
        f"({str(e).splitlines()[0]})") from None
