"""Checkpoints on orbax: sharded save, restore at any data-parallel size,
exact resume, and export of the fp32 master weights.

Example (needs a mesh, params and a train loop, so not run as a doctest)::

  ckpt = z1.checkpoint.Checkpointer("/ckpt", max_to_keep=3)
  ckpt.save(step, params, opt_state, extra={"step": step, "seed": 0})
  params, opt_state, extra = ckpt.restore(None, tx, params, mesh)
  z1.checkpoint.export_params("/ckpt", "/export")          # zero_to_fp32

One orbax step directory per saved step holds four items: ``params`` (the
replicated parameters), ``state`` (every :class:`Zero1State` leaf: master
copy, inner optimizer state and loss-scale state, each sharded leaf written
shard by shard by the devices that own it), ``meta`` (JSON manifest: N, every
leaf's path, shape, dtype and shard dim, and ``config``) and ``extra`` (the
caller's JSON). See ``docs/checkpoint.md`` and :mod:`zero1_jax.checkpoint.reshard`.

A step is loaded only once committed: orbax writes into a temporary directory
and renames it (or, on object stores, writes ``commit_success.txt`` last);
steps without a commit marker are never listed or loaded.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from zero1_jax.checkpoint import reshard
from zero1_jax.checkpoint.reshard import (CheckpointError, CheckpointMismatchError,
                               UnreadableCheckpointError)
from zero1_jax.core.transform import Zero1State

__all__ = ["Checkpointer", "CheckpointError", "CheckpointMismatchError",
           "UnreadableCheckpointError", "export_params", "load_params"]

log = logging.getLogger(__name__)

_COMMIT = "commit_success.txt"
_FILES = "zero1_files.json"      # every file of a committed step and its size
_EXPORT_INFO = "zero1_export.json"
_REQUIRED = {"params": "_METADATA", "state": "_METADATA", "meta": "metadata",
             "extra": "metadata"}


def _noise(r: logging.LogRecord) -> bool:
  m = r.getMessage()
  return (m.startswith(("Task exception was never retrieved",
                        "Future exception was never retrieved"))
          and ("orbax" in m or "tensorstore_spec" in m))


def _quiet_failed_reads() -> None:
  """When one of orbax's concurrent reads fails, the others finish after its
  event loop closed and print 'Event loop is closed' / 'Task exception was
  never retrieved' tracebacks. The error itself is already raised with a clear
  message; drop that noise (only it) from then on."""
  if not getattr(sys.unraisablehook, "_zero1", False):
    prev = sys.unraisablehook

    def hook(u):
      if not (isinstance(u.exc_value, RuntimeError)
              and str(u.exc_value) == "Event loop is closed"):
        prev(u)

    hook._zero1 = True
    sys.unraisablehook = hook
  aio = logging.getLogger("asyncio")
  if _noise not in [getattr(f, "__wrapped__", None) for f in aio.filters]:
    f = lambda r: not _noise(r)
    f.__wrapped__ = _noise
    aio.addFilter(f)


class Checkpointer:
  """Saves and restores zero1 training state in ``directory``.

  Args:
    directory: where step directories go (created if missing, unless
      ``create=False``).
    max_to_keep: keep only the newest this many steps (None: all).
    async_save: return from :meth:`save` once the arrays are copied to host;
      the files are written in the background (call :meth:`wait` before
      exiting, or use the Checkpointer as a context manager).
    create: create ``directory`` if it is missing.
  """

  def __init__(self, directory, *, max_to_keep: int | None = None,
               async_save: bool = True, create: bool = True):
    self.directory = epath.Path(directory)
    if not create and not self.directory.is_dir():
      raise UnreadableCheckpointError(
          f"zero1 checkpoint: directory {self.directory} does not exist")
    policy = (ocp.checkpoint_managers.LatestN(max_to_keep)
              if max_to_keep is not None else None)
    self._mgr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save, create=create,
            preservation_policy=policy))
    self._unrecorded: set[int] = set()
    self._async = async_save

  # -- listing --------------------------------------------------------------

  def _step_dirs(self) -> dict[int, epath.Path]:
    if not self.directory.is_dir():
      return {}
    return {int(p.name): p for p in self.directory.iterdir()
            if re.fullmatch(r"\d+", p.name) and p.is_dir()}

  @staticmethod
  def _committed(path: epath.Path) -> bool:
    if (path / _COMMIT).exists():
      return True
    try:   # orbax records the commit time in the step metadata at finalize
      meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
      return meta.get("commit_timestamp_nsecs") is not None
    except (OSError, ValueError):
      return False

  def all_steps(self) -> list[int]:
    """Committed steps, oldest first (unfinished saves are never listed)."""
    return sorted(s for s, p in self._step_dirs().items() if self._committed(p))

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

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
    step = int(step)
    extra = reshard.jsonable(extra or {}, "extra")
    meta = reshard.manifest(params, opt_state, reshard.jsonable(config, "config"))
    if step in self._step_dirs():
      if not force:
        raise CheckpointError(f"zero1 checkpoint: step {step} already exists "
                              f"in {self.directory} (pass force=True to "
                              f"replace it)")
      self.wait()
      self._mgr.delete(step)
    # orbax refuses zero-size arrays: those are rebuilt from the manifest.
    flat = lambda tree, recs: {r["name"]: x for r, x in
                               zip(recs, jax.tree.leaves(tree)) if np.size(x)}
    self._mgr.save(step, force=True, args=ocp.args.Composite(
        params=ocp.args.PyTreeSave(flat(params, meta["params"])),
        state=ocp.args.PyTreeSave(flat(opt_state, meta["state"])),
        meta=ocp.args.JsonSave(meta),
        extra=ocp.args.JsonSave(extra)))
    self._record_files()     # earlier saves: orbax finished them before this
    self._unrecorded.add(step)
    if not self._async:
      self._record_files()

  def _record_files(self) -> None:
    """Lists the files (and sizes) of this instance's finished saves in
    ``<step>/zero1_files.json``, so restore names a missing or truncated file
    before reading anything. Only call when no save is in flight."""
    for step in sorted(self._unrecorded):
      path = self.directory / str(step)
      if not path.is_dir():      # removed by max_to_keep
        self._unrecorded.discard(step)
      elif self._committed(path):
        if jax.process_index() == 0:
          tmp = path / (_FILES + ".tmp")
          tmp.write_text(json.dumps(reshard.files_of(path, _FILES), indent=0))
          tmp.rename(path / _FILES)
        self._unrecorded.discard(step)

  def wait(self) -> None:
    """Blocks until every pending save is committed."""
    self._mgr.wait_until_finished()
    self._record_files()

  def close(self) -> None:
    self.wait()
    self._mgr.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- restore --------------------------------------------------------------

  def _step_path(self, step: int) -> epath.Path:
    """The committed, complete directory of ``step``, else a clear error."""
    path = self._step_dirs().get(step)
    where = f"zero1 checkpoint: step {step} in {self.directory}"
    if path is None:
      tmp = [p.name for p in self.directory.iterdir()
             if p.name.startswith(f"{step}.") and "tmp" in p.name] \
          if self.directory.is_dir() else []
      if tmp:
        raise UnreadableCheckpointError(
            f"{where} is an unfinished save ({tmp[0]}); it is never loaded")
      raise UnreadableCheckpointError(
          f"{where} not found (committed steps: {self.all_steps()})")
    if not self._committed(path):
      raise UnreadableCheckpointError(
          f"{where} was never committed (no {step}/{_COMMIT}): an interrupted "
          f"save; it is never loaded")
    for item, name in _REQUIRED.items():
      if not (path / item / name).exists():
        raise UnreadableCheckpointError(
            f"{where} is incomplete: file {step}/{item}/{name} is missing")
    try:
      saved = json.loads((path / _FILES).read_text())
    except (OSError, ValueError):
      return path            # not recorded (saved elsewhere): orbax checks
    now = reshard.files_of(path, _FILES)
    for name, size in sorted(saved.items()):
      if name not in now:
        raise UnreadableCheckpointError(
            f"{where} is incomplete: file {step}/{name} is missing")
      if now[name] != size:
        raise UnreadableCheckpointError(
            f"{where} is damaged: file {step}/{name} has {now[name]} bytes, "
            f"{size} when saved (truncated or overwritten)")
    return path

  def _read_json(self, step: int, item: str) -> Any:
    path = self._step_path(step) / item / _REQUIRED[item]
    try:
      return json.loads(path.read_text())
    except (OSError, ValueError) as e:
      raise UnreadableCheckpointError(
          f"zero1 checkpoint: step {step} in {self.directory} is unreadable: "
          f"file {step}/{item}/{_REQUIRED[item]} is damaged or truncated "
          f"({str(e).splitlines()[0]})") from None

  def metadata(self, step: int | None = None) -> dict:
    """The manifest of ``step`` (latest): ``num_shards``, ``config``, leaves."""
    return self._read_json(self._resolve(step), "meta")

  def _resolve(self, step: int | None) -> int:
    if step is not None:
      return int(step)
    latest = self.latest_step()
    if latest is None:
      raise UnreadableCheckpointError(
          f"zero1 checkpoint: no committed checkpoint in {self.directory}")
    return latest

  def _restore_one(self, step: int, tx, params_template, mesh):
    where = f"zero1 checkpoint: step {step} in {self.directory}"
    meta = self._read_json(step, "meta")
    extra = self._read_json(step, "extra")
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

    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(
          params=args(p_t, True),
          state=args(s_t, False, len(s_t.names) < len(meta["state"]))))
    except Exception as e:  # orbax / tensorstore: missing or damaged files
      reason = reshard.read_error(e, str(self.directory))
      _quiet_failed_reads()
      raise UnreadableCheckpointError(f"{where} is unreadable: {reason}") from e
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
      ``(params, opt_state, extra)``.

    Raises:
      UnreadableCheckpointError: names the step and the file.
      CheckpointMismatchError: names the first parameter/state path that
        differs.
    """
    self.wait()
    if not fallback_to_valid:
      return self._restore_one(self._resolve(step), tx, params_template, mesh)
    dirs = self._step_dirs()
    top = int(step) if step is not None else max(dirs, default=None)
    if top is None:
      raise UnreadableCheckpointError(
          f"zero1 checkpoint: no checkpoint in {self.directory}")
    skipped = []
    for s in [top] + sorted((s for s in dirs if s < top), reverse=True):
      try:
        out = self._restore_one(s, tx, params_template, mesh)
      except UnreadableCheckpointError as e:
        log.warning("zero1 checkpoint: skipping step %d: %s", s, e)
        skipped.append(s)
        continue
      if skipped:
        log.warning("zero1 checkpoint: restored step %d instead (skipped %s)",
                    s, skipped)
      return out
    raise UnreadableCheckpointError(
        f"zero1 checkpoint: no restorable step in {self.directory} "
        f"(skipped {skipped})")


def export_params(ckpt_dir, out_dir, step: int | None = None, *,
                  overwrite: bool = False) -> int:
  """Writes the consolidated fp32 master weights of ``step`` (latest) as a
  plain orbax PyTree checkpoint in ``out_dir``; returns the step exported.

  The DeepSpeed ``zero_to_fp32`` equivalent: every floating parameter is its
  unpadded master copy (fp32 even for fp16/bf16 training), integer leaves are
  the saved parameters. Load it with :func:`load_params`, or with plain orbax:
  ``ocp.StandardCheckpointer().restore(out_dir)``.
  """
  out = epath.Path(out_dir)
  if out.exists():
    if any(out.iterdir()) and not overwrite:
      raise CheckpointError(f"zero1 export: output directory {out} already "
                            f"exists and is not empty (use overwrite=True / "
                            f"--overwrite)")
    out.rmtree()
  ckpt = Checkpointer(ckpt_dir, async_save=False, create=False)
  try:
    step = ckpt._resolve(step)
    meta = ckpt._read_json(step, "meta")
    p_names, s_names = reshard.master_names(meta)
    np_args = lambda names: ocp.args.PyTreeRestore(
        item={n: 0 for n in names}, partial_restore=True, restore_args={
            n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names})
    items = {"state": np_args(s_names)} if s_names else {}
    if p_names:
      items["params"] = np_args(p_names)
    try:
      got = ckpt._mgr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:
      reason = reshard.read_error(e, str(ckpt.directory))
      _quiet_failed_reads()
      raise UnreadableCheckpointError(
          f"zero1 checkpoint: step {step} in {ckpt.directory} is unreadable: "
          f"{reason}") from e
  finally:
    ckpt.close()
  items = reshard.export_items(meta, got.get("params") or {},
                               got.get("state") or {})
  # orbax cannot store zero-size arrays: they are listed in a JSON file.
  empty = [{"keys": k, "shape": list(x.shape), "dtype": x.dtype.name}
           for k, x in items if not x.size]
  with ocp.StandardCheckpointer() as c:
    c.save(out.absolute(), reshard.nest([(k, x) for k, x in items if x.size]))
  (out / _EXPORT_INFO).write_text(json.dumps(
      {"format": reshard.FORMAT, "checkpoint_dir": str(ckpt.directory),
       "step": step, "zero_size_leaves": empty}, indent=1))
  return step


def load_params(out_dir):
  """Loads an :func:`export_params` directory as a tree of numpy arrays."""
  path = epath.Path(out_dir)
  if not (path / "_METADATA").exists():
    raise UnreadableCheckpointError(
        f"zero1 export: {path} is not an exported parameter directory "
        f"(no _METADATA)")
  with ocp.PyTreeCheckpointer() as c:
    meta = c.metadata(path.absolute()).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = c.restore(path.absolute(), args=ocp.args.PyTreeRestore(
        restore_args=args))
  info = path / _EXPORT_INFO
  empty = json.loads(info.read_text())["zero_size_leaves"] if info.exists() else []
  if not empty:
    return tree
  items = [(reshard.encode_path(p), x)
           for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
  items += [(e["keys"], np.zeros(e["shape"], jax.numpy.dtype(e["dtype"])))
            for e in empty]
  return reshard.nest(items)
