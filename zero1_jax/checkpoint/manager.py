"""Checkpoints on orbax: sharded save, restore at any data-parallel size,
exact resume, and export of the fp32 master weights.

Example (needs a mesh, params and a train loop, so not run as a doctest)::

  with z1.checkpoint.Checkpointer("ckpt", max_to_keep=3) as ckpt:
    ckpt.save(step, params, opt_state, extra={"step": step, "seed": 0})
    params, opt_state, extra = ckpt.restore(None, tx, params, mesh)
  z1.checkpoint.export_params("ckpt", "export")  # zero_to_fp32 (export.py)

Relative paths are resolved against the current directory once, when they
enter the API. A failed save, foreground or background, raises
:class:`CheckpointSaveError` at the next call that waits for it (the next
``save``, ``restore``, ``wait``, ``close`` or the end of the ``with`` block);
saves still pending at a normal interpreter exit are finished first, and a
failure then is one line on stderr and exit status 1.

One orbax step directory per saved step holds four items: ``params`` (the
replicated parameters), ``state`` (every :class:`Zero1State` leaf: master
copy, inner optimizer state and loss-scale state, each sharded leaf written
shard by shard by the devices that own it), ``meta`` (JSON manifest: N, every
leaf's path, shape, dtype and shard dim, and ``config``) and ``extra`` (the
caller's JSON). See ``docs/checkpoint.md`` and :mod:`zero1_jax.checkpoint.reshard`.

A step is loaded only once committed (:mod:`.steps`): orbax writes into a
temporary directory and renames it (or, on object stores, writes
``commit_success.txt`` last); steps without a commit marker are never listed
or loaded. Before a restore reads a step, its files are checked against the
list its save recorded (:mod:`.step_files`).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from zero1_jax.checkpoint import lifecycle, reshard, step_files, steps
from zero1_jax.checkpoint.lifecycle import quiet_failed_reads
from zero1_jax.checkpoint.reshard import (CheckpointError, CheckpointMismatchError,
                                          CheckpointSaveError,
                                          UnreadableCheckpointError)
from zero1_jax.core import boxes
from zero1_jax.core import param_axes as pax
from zero1_jax.core.transform import Zero1State

__all__ = ["Checkpointer", "CheckpointError", "CheckpointMismatchError",
           "CheckpointSaveError", "UnreadableCheckpointError"]

log = logging.getLogger(__name__)


class Checkpointer:
  """Saves and restores zero1 training state in ``directory``.

  Use it as a context manager (or call :meth:`close`): leaving the block
  waits for the pending saves and raises if one failed.

  Args:
    directory: where step directories go (created if missing, unless
      ``create=False``); a relative path is taken from the current directory
      now, so a later ``os.chdir`` does not move it.
    max_to_keep: keep only the newest this many steps (None: all; at
      least 1).
    async_save: return from :meth:`save` once the arrays are copied to host;
      the files are written in the background. Pending saves are finished
      by :meth:`wait`, :meth:`close`, the next :meth:`save` and, at the
      latest, at interpreter exit (on CPython 3.12.0 to 3.12.2, which cannot
      do that, saves are synchronous, with a warning).
    create: create ``directory`` if it is missing.

  Raises:
    CheckpointError: ``directory`` is a file or cannot be created.
  """

  def __init__(self, directory, *, max_to_keep: int | None = None,
               async_save: bool = True, create: bool = True):
    self.directory = lifecycle.absolute(directory)
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"zero1 checkpoint: max_to_keep={max_to_keep} would "
                       f"delete every checkpoint; pass at least 1, or None to "
                       f"keep all")
    self.max_to_keep = max_to_keep
    async_save = lifecycle.async_save_allowed(async_save)
    if self.directory.exists() and not self.directory.is_dir():
      raise CheckpointError(f"zero1 checkpoint: {self.directory} is a file, "
                            f"not a directory")
    if not create and not self.directory.is_dir():
      raise UnreadableCheckpointError(
          f"zero1 checkpoint: directory {self.directory} does not exist")
    self._options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=async_save, create=create,
        preservation_policy=(ocp.checkpoint_managers.LatestN(max_to_keep)
                             if max_to_keep is not None else None))
    try:
      self._mgr = ocp.CheckpointManager(self.directory, options=self._options)
    except OSError as e:
      raise CheckpointError(f"zero1 checkpoint: cannot create "
                            f"{self.directory}: {e.strerror or e}") from e
    self.restored_step: int | None = None   # the step the last restore read
    self._unrecorded: set[int] = set()
    self._pending: list[int] = []     # saves not yet known to be committed
    self._async = async_save
    lifecycle.finish_at_exit(self, "_finish_at_exit")

  # -- listing --------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Committed steps, oldest first (unfinished saves are never listed)."""
    return steps.committed_steps(self.directory)

  def latest_step(self) -> int | None:
    """The step a resume continues from: the last saved (the directory's
    ``latest`` file, as DeepSpeed) if it committed, else the highest
    committed one (:func:`zero1_jax.checkpoint.steps.latest_step`)."""
    return steps.latest_step(self.directory)

  # -- save -----------------------------------------------------------------

  def save(self, step: int, params, opt_state: Zero1State, *,
           extra: dict | None = None, config: dict | None = None,
           force: bool = False) -> None:
    """Saves ``params``, ``opt_state`` (master, inner, loss scale) and JSON.

    Every device writes only the shards it holds; nothing is gathered.
    ``extra`` (step counters, data position, RNG seed, ...) comes back from
    :meth:`restore`; ``config`` is stored in the manifest
    (:meth:`metadata`). With ``force``, an existing step is replaced.

    With ``async_save`` this returns once the arrays are on the host, so the
    next (donating) train step may run at once.
    """
    if not isinstance(opt_state, Zero1State):
      raise CheckpointError(f"zero1 checkpoint: opt_state must be a "
                            f"Zero1State, got {type(opt_state).__name__}")
    # nnx: nnx.state(model, nnx.Param) and nnx.Optimizer's opt_state hold
    # Variables; stored as their values, the checkpoint restores with or
    # without them
    params, opt_state = pax.strip_variables((params, opt_state))
    # linen: tx.init boxes the state's sharded leaves (core/boxes.py); the
    # checkpoint stores their values, as restore's template names them.
    opt_state = boxes.strip(opt_state)
    step = int(step)
    extra = reshard.jsonable(extra or {}, "extra")
    meta = reshard.manifest(params, opt_state, reshard.jsonable(config, "config"))
    self.wait()              # an earlier save's failure surfaces here
    if step in steps.step_dirs(self.directory):
      if not force:
        raise CheckpointError(f"zero1 checkpoint: step {step} already exists "
                              f"in {self.directory} (pass force=True to "
                              f"replace it)")
      self._mgr.delete(step)
    # orbax refuses zero-size arrays: those are rebuilt from the manifest.
    flat = lambda tree, recs: {r["name"]: x for r, x in
                               zip(recs, jax.tree.leaves(tree)) if np.size(x)}
    self._pending.append(step)
    self._unrecorded.add(step)
    try:
      self._mgr.save(step, force=True, args=ocp.args.Composite(
          params=ocp.args.PyTreeSave(flat(params, meta["params"])),
          state=ocp.args.PyTreeSave(flat(opt_state, meta["state"])),
          meta=ocp.args.JsonSave(meta),
          extra=ocp.args.JsonSave(extra)))
    except Exception as e:  # orbax / tensorstore / the file system
      raise self._save_failed(e) from e
    if jax.process_index() == 0:   # what latest_step() returns once committed
      steps.write_latest(self.directory, step)
    if not self._async:
      self.wait()

  def _save_failed(self, e: BaseException) -> CheckpointSaveError:
    """The error for the pending saves; the orbax manager, which would raise
    the same error again at every later call, is replaced by a fresh one."""
    steps, self._pending = self._pending, []
    self._unrecorded.difference_update(steps)
    # Not close()d: that would stop thread pools orbax shares with the new one.
    self._mgr = ocp.CheckpointManager(self.directory, options=self._options)
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    what = ", ".join(map(str, steps)) or "?"
    return CheckpointSaveError(
        f"zero1 checkpoint: saving step {what} to {self.directory} failed: "
        f"{msg}; that step is not committed")

  def _record_files(self) -> None:
    """Lists the files (and sizes) of this instance's finished saves in
    ``<step>/zero1_files.json``, so restore names a missing or truncated file
    before reading anything. Only call when no save is in flight."""
    for step in sorted(self._unrecorded):
      path = self.directory / str(step)
      if not path.is_dir():      # removed by max_to_keep
        self._unrecorded.discard(step)
      elif steps.is_committed(path):
        step_files.record(path)
        self._unrecorded.discard(step)

  def wait(self) -> None:
    """Blocks until every pending save is committed.

    Raises:
      CheckpointSaveError: a pending save failed (named by step).
    """
    try:
      self._mgr.wait_until_finished()
    except Exception as e:  # the background save's own error
      raise self._save_failed(e) from e
    self._pending.clear()
    self._record_files()

  def _finish_at_exit(self) -> None:
    if self._pending:
      self.wait()

  def close(self) -> None:
    """Waits for pending saves (raising if one failed) and releases orbax."""
    try:
      self.wait()
    finally:
      self._mgr.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, exc_type, *exc) -> None:
    if exc_type is None:
      self.close()
      return
    try:                     # the body's error wins over a save failure
      self.close()
    except CheckpointError as e:
      log.error("%s", e)

  # -- restore --------------------------------------------------------------

  def resolve_step(self, step: int | None) -> int:
    """``step``, or the newest committed one (UnreadableCheckpointError: none)."""
    return self._resolve(step)

  def restore_items(self, step: int, items: dict) -> Any:
    """orbax restore of ``items`` (name -> ``ocp.args``) of ``step``."""
    return self._mgr.restore(step, args=ocp.args.Composite(**items))

  def metadata(self, step: int | None = None) -> dict:
    """The manifest of ``step`` (latest): ``num_shards``, ``config``, leaves."""
    return step_files.read_json(self.directory, self._resolve(step), "meta")

  def _resolve(self, step: int | None) -> int:
    if step is not None:
      return int(step)
    latest = self.latest_step()
    if latest is None:
      raise UnreadableCheckpointError(
          f"zero1 checkpoint: no committed checkpoint in {self.directory}"
          f"{steps.nearby_hint(self.directory)}")
    return latest

  def _restore_one(self, step: int, tx, params_template, mesh):
    where = f"zero1 checkpoint: step {step} in {self.directory}"
    meta = step_files.read_json(self.directory, step, "meta")
    extra = step_files.read_json(self.directory, step, "extra")
    self.restored_step = step   # which one "latest" / a fallback turned out
    p_t, s_t = reshard.check(meta, tx, params_template, mesh, where)

    def args(t: reshard.Target, strict: bool, partial: bool = False):
      restore_args = {
          name: ocp.ArrayRestoreArgs(sharding=sh, global_shape=x.shape,
                                     dtype=x.dtype, strict=strict)
          for name, x, sh in zip(t.names, t.shapes, t.shardings) if x.size}
      if not partial:
        return ocp.args.PyTreeRestore(restore_args=restore_args)
      # Skips entries the model has no use for: the fp32 masters of fp32
      # params in checkpoints of earlier versions (reshard.legacy_masters).
      return ocp.args.PyTreeRestore(item={n: 0 for n in restore_args},
                                    restore_args=restore_args,
                                    partial_restore=True)

    def leaves(t: reshard.Target, got: dict):
      return t.treedef.unflatten([
          got[name] if x.size else jax.device_put(np.zeros(x.shape, x.dtype), sh)
          for name, x, sh in zip(t.names, t.shapes, t.shardings)])

    partial = len(s_t.names) < len(meta["state"])
    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(
          params=args(p_t, True), state=args(s_t, False, partial)))
    except Exception as e:  # orbax / tensorstore: missing or damaged files
      reason = reshard.read_error(e, str(self.directory))
      quiet_failed_reads()
      raise UnreadableCheckpointError(f"{where} is unreadable: {reason}") from e
    if not partial:     # every file read: list them where a crash did not
      step_files.record_if_missing(self.directory, step)
    return leaves(p_t, out["params"]), leaves(s_t, out["state"]), extra

  def restore(self, step: int | None, tx, params_template, mesh, *,
              fallback_to_valid: bool = False):
    """Restores ``step`` (None: the latest committed) onto ``mesh``.

    Works at any data-parallel size: a checkpoint saved at N restores at any
    N'. Params come back replicated, the state sharded as
    :func:`zero1_jax.state_shardings` says (padding entries zero).

    Args:
      step: the step to load, or None for the latest committed one.
      tx: the :func:`zero1_jax.zero1` transformation of the run.
      params_template: params (or ``jax.ShapeDtypeStruct``s) of the model.
      mesh: the mesh to restore onto.
      fallback_to_valid: if ``step`` cannot be read (missing, uncommitted,
        missing or damaged file), log why and try the next older step
        (``--resume latest-valid``). Tree/shape mismatches never fall back.

    Returns:
      ``(params, opt_state, extra)``; params in ``params_template``'s nnx
      Variables if it has them (``nnx.update(model, params)``; put the
      state into an ``nnx.Optimizer`` with :func:`zero1_jax.flax.assign`).

    Raises:
      UnreadableCheckpointError: names the step and the file.
      CheckpointMismatchError: names the first parameter/state path that
        differs.
    """
    like, params_template = params_template, pax.strip_variables(
        params_template)
    params, opt_state, extra = self._restore(step, tx, params_template, mesh,
                                             fallback_to_valid)
    return pax.rewrap_variables(like, params), opt_state, extra

  def _restore(self, step, tx, params_template, mesh, fallback_to_valid):
    self.wait()
    if not fallback_to_valid:
      return self._restore_one(self._resolve(step), tx, params_template, mesh)
    dirs = steps.step_dirs(self.directory)
    named = steps.read_latest(self.directory)   # the last save, as latest_step
    top = (int(step) if step is not None else named if named in dirs
           else max(dirs, default=None))
    if top is None:
      raise UnreadableCheckpointError(
          f"zero1 checkpoint: no checkpoint in {self.directory}")
    skipped = []
    for s in [top] + sorted((s for s in dirs if s < top), reverse=True):
      try:
        out = self._restore_one(s, tx, params_template, mesh)
      except UnreadableCheckpointError as e:
        log.warning("zero1 checkpoint: skipping step %d: %s", s,
                    str(e).removeprefix("zero1 checkpoint: "))
        skipped.append(s)
        continue
      if skipped:
        log.warning("zero1 checkpoint: restored step %d instead (skipped %s)",
                    s, skipped)
      return out
    raise UnreadableCheckpointError(
        f"zero1 checkpoint: no restorable step in {self.directory} "
        f"(skipped {skipped})")
