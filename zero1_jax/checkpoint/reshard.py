"""The on-disk format of a zero1 checkpoint: the manifest written next to the
arrays, its comparison with the model being restored, the shapes and
shardings a restored state leaf takes at another N, the export tree, and the
small file/JSON helpers :mod:`zero1_jax.checkpoint` uses.

A sharded state leaf lives (in memory and on disk) as the parameter padded on
its shard dim to a multiple of N. Restoring at N' reads it with orbax's
padding/truncation (``ArrayRestoreArgs(strict=False)``) into the N' padded
shape under the N' sharding: each device reads only its own region of the
file; the saved and target shapes differ from the parameter on at most one dim
each, so their overlap is the parameter itself plus saved zero padding, and
the rest is zero filled. No device ever holds a whole state leaf.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from zero1_jax.core import layout as lay
from zero1_jax.core import param_axes as pax
from zero1_jax.core import shardings as zsh
from zero1_jax.core.state import Zero1State, master_tree

FORMAT = "zero1_jax.checkpoint/1"


class CheckpointError(ValueError):
  """A checkpoint cannot be saved or restored; the message says why."""


class UnreadableCheckpointError(CheckpointError):
  """A step is missing, uncommitted, or has a missing or damaged file."""


class CheckpointMismatchError(CheckpointError):
  """The checkpoint's tree or shapes differ from the model being restored."""


class CheckpointSaveError(CheckpointError):
  """A save (foreground or background) failed; nothing of it is committed."""


def entries(tree) -> list[tuple[str, tuple, Any]]:
  """``(keystr, keypath, leaf)`` for each leaf of ``tree``, in flatten order."""
  return [(jax.tree_util.keystr(p), p, x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def names(paths: list[str]) -> list[str]:
  """Readable, unique on-disk names: ``['dense']['kernel']`` -> dense.kernel."""
  out, seen = [], set()
  for i, p in enumerate(paths):
    name = ".".join(re.findall(r"[A-Za-z0-9_\-]+", p)) or "leaf"
    if name in seen:
      name = f"{name}~{i}"
    seen.add(name)
    out.append(name)
  return out


def encode_path(path: tuple) -> list:
  """A JSON form of a key path, enough to rebuild nested dicts and lists."""
  out = []
  for k in path:
    if isinstance(k, DictKey):
      key = k.key if isinstance(k.key, (str, int)) else str(k.key)
      out.append(["key", key])
    elif isinstance(k, SequenceKey):
      out.append(["index", k.idx])
    elif isinstance(k, GetAttrKey):
      out.append(["key", k.name])
    elif isinstance(k, FlattenedIndexKey):
      out.append(["index", k.key])
    else:
      out.append(["key", str(k)])
  return out


def nest(items: list[tuple[list, Any]]):
  """Rebuilds plain nested dicts/lists from ``(encode_path(...), value)``."""
  if len(items) == 1 and not items[0][0]:
    return items[0][1]
  groups: dict[Any, list] = {}
  kinds = set()
  for path, v in items:
    (kind, key), rest = path[0], path[1:]
    kinds.add(kind)
    groups.setdefault(key, []).append((rest, v))
  node = {k: nest(g) for k, g in groups.items()}
  return [node[k] for k in sorted(node)] if kinds == {"index"} else node


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def sharded_dim(x, axis: str | None = None) -> tuple[int | None, str | None, int]:
  """``(dim, axis, axis size)`` of the dim of ``x`` sharded over ``axis``
  (None: the first sharded dim, on one mesh axis), else ``(None, None, 1)``."""
  s = getattr(x, "sharding", None)
  if isinstance(s, NamedSharding):
    for d, a in enumerate(s.spec):
      if axis is not None:
        if axis in _axes(a):
          return d, axis, s.mesh.shape[axis]
      elif a is not None:
        return d, a if isinstance(a, str) else None, math.prod(
            s.mesh.shape[ax] for ax in _axes(a))
  return None, None, 1


def data_axis(params, opt_state) -> str | None:
  """The mesh axis the state is sharded over and the params are not: the
  data axis (params may be sharded over others, on a 2-D mesh); or the
  state's only axis, which params kept sharded between steps use too
  (``z1.train_step(..., shard_params=True)``)."""
  def used(tree):
    out = set()
    for x in jax.tree.leaves(tree):
      s = getattr(x, "sharding", None)
      if isinstance(s, NamedSharding):
        out.update(a for entry in s.spec for a in _axes(entry))
    return out
  state = used(opt_state)
  rest = state - used(params)
  if len(rest) == 1:
    return next(iter(rest))
  return next(iter(state)) if len(state) == 1 else None


def leaf_record(path: str, name: str, x) -> dict:
  return {"path": path, "name": name, "shape": list(np.shape(x)),
          "dtype": np.dtype(x.dtype).name}


def manifest(params, opt_state: Zero1State, config) -> dict:
  """What :func:`check` compares against at restore, and export reads."""
  p_ent, s_ent = entries(params), entries(opt_state)
  p_names = names([p for p, _, _ in p_ent])
  s_names = names([p for p, _, _ in s_ent])
  state, n, axis = [], 1, None
  data = data_axis(params, opt_state)
  for (path, _, x), name in zip(s_ent, s_names):
    rec = leaf_record(path, name, x)
    dim, ax, size = sharded_dim(x, data)
    rec["dim"] = dim
    if dim is not None:
      n, axis = size, ax or axis
    state.append(rec)
  return {
      "format": FORMAT, "num_shards": n, "axis_name": axis,
      "params": [dict(leaf_record(path, name, x), keys=encode_path(kp))
                 for (path, kp, x), name in zip(p_ent, p_names)],
      "state": state, "config": config,
  }


def _first_difference(what: str, saved: list[dict], want: list[tuple]) -> str:
  have = [r["path"] for r in saved]
  need = [p for p, _ in want]
  for i in range(max(len(have), len(need))):
    h = have[i] if i < len(have) else None
    w = need[i] if i < len(need) else None
    if h == w:
      continue
    if w is not None and w not in have:
      return f"{what} {w} is in the model, not in the checkpoint"
    if h is not None and h not in need:
      return f"{what} {h} is in the checkpoint, not in the model"
    return f"{what} {w} is leaf {i} of the model but not of the checkpoint"
  return f"{what} trees differ"


class Target(NamedTuple):
  """Where restored leaves go: names, global shapes/dtypes and shardings."""

  treedef: Any
  names: list[str]
  shapes: list[jax.ShapeDtypeStruct]   # global shape after restore
  shardings: list[NamedSharding]


def _compatible(stored, canon, dim, n) -> bool:
  if len(stored) != len(canon):
    return False
  return all(s == c or (d == dim and s == -(-c // n) * n)
             for d, (s, c) in enumerate(zip(stored, canon)))


def check(meta: dict, tx, params_template, mesh, where: str
          ) -> tuple[Target, Target]:
  """Compares the checkpoint with the model; returns the restore targets.

  Raises:
    CheckpointMismatchError naming the first path whose name, shape or dtype
    differs (parameters first, then optimizer state).
  """
  if meta.get("format") != FORMAT:
    raise UnreadableCheckpointError(
        f"{where} is not a zero1_jax checkpoint (format {meta.get('format')!r}, "
        f"expected {FORMAT!r})")
  fail = lambda msg: CheckpointMismatchError(
      f"{where} does not fit the model: {msg}")
  # Parameters.
  p_ent = entries(params_template)
  want = [(p, x) for p, _, x in p_ent]
  saved = meta["params"]
  if [r["path"] for r in saved] != [p for p, _ in want]:
    raise fail(_first_difference("parameter", saved, want))
  for rec, (path, x) in zip(saved, want):
    shape, dtype = tuple(np.shape(x)), np.dtype(x.dtype).name
    if tuple(rec["shape"]) != shape or rec["dtype"] != dtype:
      raise fail(f"parameter {path} is {rec['dtype']}{list(rec['shape'])} in "
                 f"the checkpoint but {dtype}{list(shape)} in the model")
  p_target = Target(jax.tree.structure(params_template),
                    [r["name"] for r in saved],
                    [jax.ShapeDtypeStruct(tuple(np.shape(x)), x.dtype)
                     for _, x in want],
                    jax.tree.leaves(zsh.param_shardings(tx, params_template,
                                                          mesh)))
  # Optimizer state: global shapes at the new N and N-independent ones (on a
  # 2-D mesh: of each block's 1/N split, gathered; :mod:`..core.param_axes`).
  n = zsh.data_size(tx, mesh)
  layout = pax.global_layout(params_template, n,
                             zsh.param_axes(tx, params_template, mesh))
  mdt = tx.config.master_dtype

  def abstract(shape_of):
    shards = [jax.ShapeDtypeStruct(shape_of(s), lay.master_dtype(s.dtype, mdt))
              for s in layout.leaves]
    ls = jax.eval_shape(tx.loss_scaler(params_template).init)
    return Zero1State(master_tree(layout, mdt, shards),
                      jax.eval_shape(tx.inner.init, layout.inner_tree(shards)),
                      ls)

  padded = abstract(lambda s: s.padded_shape)
  canon = jax.tree.leaves(abstract(lambda s: s.shape))
  s_ent = entries(padded)
  shardings = jax.tree.leaves(zsh.state_shardings(tx, params_template, mesh))
  assert len(shardings) == len(s_ent) == len(canon)
  # Written before params in the master dtype stopped carrying a master copy:
  # that copy equals the params (restored above), so it is not read.
  saved = [r for r in meta["state"] if r["path"] not in legacy_masters(
      meta, mdt)]
  want = [(p, x) for p, _, x in s_ent]
  if [r["path"] for r in saved] != [p for p, _ in want]:
    raise fail(_first_difference("optimizer state", saved, want) +
               " (was it saved with another inner optimizer?)")
  n_saved = int(meta["num_shards"])
  for rec, (path, x), c in zip(saved, want, canon):
    if (not _compatible(rec["shape"], c.shape, rec["dim"], n_saved)
        or rec["dtype"] != np.dtype(x.dtype).name):
      raise fail(f"optimizer state {path} is {rec['dtype']}{rec['shape']} in "
                 f"the checkpoint (N={n_saved}) but the model needs "
                 f"{np.dtype(x.dtype).name}{list(c.shape)} before padding")
  s_target = Target(jax.tree.structure(padded), [r["name"] for r in saved],
                    [x for _, x in want], shardings)
  return p_target, s_target


def legacy_masters(meta: dict, master_dtype) -> set[str]:
  """State paths of the master copies that checkpoints of earlier zero1_jax
  (commit 0129125 and before) hold for parameters already in the master
  dtype; such parameters are their own master now, so these are not read."""
  mdt = np.dtype(master_dtype).name
  by_path = {r["path"]: r for r in meta["state"]}
  out = set()
  for rec in meta["params"]:
    m = by_path.get(".master" + rec["path"])
    if m is not None and rec["dtype"] == mdt and m["dtype"] == mdt:
      out.add(m["path"])
  return out


def export_items(meta: dict, params: dict, state: dict) -> list[tuple[list, Any]]:
  """``(encode_path(...), numpy array)`` per parameter: the unpadded master
  copy for floating leaves, in the master dtype (zero-size floating leaves
  too), integer leaves as saved."""
  by_path = {r["path"]: r for r in meta["state"]}
  masters = [by_path[".master" + r["path"]]["dtype"] for r in meta["params"]
             if ".master" + r["path"] in by_path]
  master_dtype = jax.numpy.dtype(masters[0] if masters else "float32")
  items = []
  for rec in meta["params"]:
    m = by_path.get(".master" + rec["path"])
    if m is not None:
      x = np.asarray(state[m["name"]])
      x = x[tuple(slice(0, s) for s in rec["shape"])]
    else:
      x = (np.asarray(params[rec["name"]]) if math.prod(rec["shape"]) else
           np.zeros(rec["shape"], jax.numpy.dtype(rec["dtype"])))
      if jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
        x = x.astype(master_dtype)
    items.append((rec["keys"], x))
  return items


def master_names(meta: dict) -> tuple[dict, dict]:
  """On-disk names export needs: master leaves (state) and the others (params)."""
  by_path = {r["path"]: r for r in meta["state"]}
  state, params = {}, {}
  for rec in meta["params"]:
    m = by_path.get(".master" + rec["path"])
    if m is not None:
      state[m["name"]] = m
    elif math.prod(rec["shape"]):
      params[rec["name"]] = rec
  return params, state


def jsonable(x, what: str):
  """``x`` as plain JSON types (numpy scalars, dataclasses, paths converted)."""
  def default(o):
    if isinstance(o, (np.generic, np.ndarray, jax.Array)) and np.ndim(o) == 0:
      return np.asarray(o).item()
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
      return dataclasses.asdict(o)
    if isinstance(o, os.PathLike):
      return os.fspath(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")
  try:
    return json.loads(json.dumps(x, default=default))
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"zero1 checkpoint: {what} must be JSON-serialisable "
                          f"({e})") from None


def read_error(e: BaseException, root: str) -> str:
  """One line: the damaged file (relative to ``root``) and the first cause."""
  chain, c = [], e
  while c is not None and len(chain) < 8:
    chain.append(c)
    c = c.__cause__ or c.__context__
  text = " | ".join(str(c) for c in chain)
  files = (re.findall(r'local file "([^"]+)"', text) +
           re.findall(r"File (\S+) not found", text))
  files = [f for f in files if not f.endswith("/")] or files
  msg = next((str(c) for c in reversed(chain) if str(c).strip()), type(e).__name__)
  msg = msg.split(" [tensorstore_spec")[0].splitlines()[0]
  if files:
    msg = msg.split(f'local file "{files[-1]}"')[-1].lstrip(": ") or msg
    return f"file {os.path.relpath(files[-1], root)} is damaged ({msg[:200]})"
  return msg[:300]

