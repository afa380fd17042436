"""Export of the fp32 master weights (DeepSpeed's ``zero_to_fp32``) and their
loading as a plain tree.

Example (needs a saved checkpoint, so not run as a doctest)::

  step = z1.checkpoint.export_params("ckpt", "fp32_params")
  params = z1.checkpoint.load_params("fp32_params")   # numpy arrays
"""

from __future__ import annotations

import json

import jax
import numpy as np
import orbax.checkpoint as ocp

from zero1_jax.checkpoint import lifecycle, reshard
from zero1_jax.checkpoint.lifecycle import quiet_failed_reads
from zero1_jax.checkpoint.manager import Checkpointer
from zero1_jax.checkpoint.reshard import CheckpointError, UnreadableCheckpointError

__all__ = ["export_params", "load_params"]

_EXPORT_INFO = "zero1_export.json"


def export_params(ckpt_dir, out_dir, step: int | None = None, *,
                  overwrite: bool = False) -> int:
  """Writes the consolidated fp32 master weights of ``step`` (latest) as a
  plain orbax PyTree checkpoint in ``out_dir``; returns the step exported.

  The DeepSpeed ``zero_to_fp32`` equivalent: every floating parameter is its
  unpadded master copy (fp32 even for fp16/bf16 training), integer leaves are
  the saved parameters. Load it with :func:`load_params`, or with plain orbax:
  ``ocp.StandardCheckpointer().restore(out_dir)``.
  """
  out = lifecycle.absolute(out_dir)
  if out.exists():
    if any(out.iterdir()) and not overwrite:
      raise CheckpointError(f"zero1 export: output directory {out} already "
                            f"exists and is not empty (overwrite=True "
                            f"replaces it)")
    out.rmtree()
  ckpt = Checkpointer(ckpt_dir, async_save=False, create=False)
  try:
    step = ckpt.resolve_step(step)
    meta = ckpt.metadata(step)
    p_names, s_names = reshard.master_names(meta)
    np_args = lambda names: ocp.args.PyTreeRestore(
        item={n: 0 for n in names}, partial_restore=True, restore_args={
            n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names})
    items = {"state": np_args(s_names)} if s_names else {}
    if p_names:
      items["params"] = np_args(p_names)
    try:
      got = ckpt.restore_items(step, items)
    except Exception as e:
      reason = reshard.read_error(e, str(ckpt.directory))
      quiet_failed_reads()
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
    c.save(out, reshard.nest([(k, x) for k, x in items if x.size]))
  (out / _EXPORT_INFO).write_text(json.dumps(
      {"format": reshard.FORMAT, "checkpoint_dir": str(ckpt.directory),
       "step": step, "zero_size_leaves": empty}, indent=1))
  return step


def load_params(out_dir):
  """Loads an :func:`export_params` directory as a tree of numpy arrays."""
  path = lifecycle.absolute(out_dir)
  if not (path / "_METADATA").exists():
    raise UnreadableCheckpointError(
        f"zero1 export: {path} is not an exported parameter directory "
        f"(no _METADATA)")
  with ocp.PyTreeCheckpointer() as c:
    meta = c.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = c.restore(path, args=ocp.args.PyTreeRestore(
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
