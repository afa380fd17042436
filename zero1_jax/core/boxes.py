"""Flax partitioning metadata on the params and on zero1's state leaves.

A Flax program says how each array is placed in metadata around it: linen's
``nn.Partitioned`` / ``nn.LogicallyPartitioned`` boxes (logical names mapped
to mesh axes by the program's logical axis rules) and nnx ``Variable``
metadata (``out_sharding``). Such programs derive their ``jax.jit`` shardings
from that metadata (``nn.get_partition_spec(abstract_state)`` then
``nn.logical_to_mesh_sharding(..., rules)``; ``nnx.get_partition_spec``).

This module reads the params' metadata through the rules
(:func:`mesh_axes`), takes the boxes off (:func:`strip`), and puts metadata
on zero1's state leaves (:func:`box_state`) naming zero1's own placement,
the data axis on each leaf's shard dim.

No flax import: flax's modules are looked up in ``sys.modules`` (a box or
Variable exists only once flax is loaded).

A linen state leaf keeps its parameter's logical names, with the data axis
added on its shard dim under a name the rules map to it (``'batch'``), so
``nn.logical_to_mesh_sharding(..., rules)`` gives zero1's spec
(:func:`_box_names`).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import linen as nn
  >>> from jax.sharding import PartitionSpec as P
  >>> box = nn.LogicallyPartitioned(jnp.zeros((4, 2)), ("vocab", "embed"))
  >>> spec = mesh_axes(box, {"data": 4, "model": 2}, (("vocab", "model"),), "w")
  >>> spec == P("model", None)
  True
  >>> rules = (("batch", "data"), ("vocab", "model"))
  >>> state = box_state({"mu": {"w": jnp.zeros((4, 2))}},
  ...                   {"mu": {"w": P("model", "data")}}, {"w": box}, rules)
  >>> state["mu"]["w"].names
  ('vocab', 'batch')
  >>> nn.logical_to_mesh(nn.get_partition_spec(state), rules)
  {'mu': {'w': P('model', 'data')}}
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import jax
from jax.sharding import PartitionSpec as P

_DROP = ("out_sharding", "sharding_rules", "optimizer_sharding", "opt_sharding")


def is_box(x) -> bool:
  """A linen partitioning box (``nn.Partitioned`` and subclasses)."""
  return hasattr(x, "names") and callable(getattr(x, "unbox", None)) \
      and hasattr(x, "replace")


def is_variable(x) -> bool:
  """An nnx ``Variable``."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def is_logical(box) -> bool:
  """``nn.LogicallyPartitioned``: its names are logical, mapped by rules."""
  spmd = sys.modules.get("flax.linen.spmd")
  return spmd is not None and isinstance(box, spmd.LogicallyPartitioned)


def _wrapped(x) -> bool:
  return is_box(x) or is_variable(x)


def strip(tree: Any) -> Any:
  """``tree`` with linen boxes and nnx Variables replaced by their values
  (no sharding constraint applied)."""
  return jax.tree.map(
      lambda x: x.get_value() if is_variable(x) else x.value if is_box(x) else x,
      tree, is_leaf=_wrapped)


def rebox(like: Any, tree: Any) -> Any:
  """``tree`` (``like`` with its wrappers stripped) back in ``like``'s boxes
  and Variables: same leaves, in order."""
  if not any(map(_wrapped, jax.tree.leaves(like, is_leaf=_wrapped))):
    return tree
  return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(tree))


def context_rules() -> tuple:
  """The logical axis rules of the ``nn.logical_axis_rules`` context."""
  spmd = sys.modules.get("flax.core.spmd")
  return tuple(spmd.get_logical_axis_rules()) if spmd is not None else ()


def mesh_axes(box, sizes: Mapping[str, int], rules: Any, where: str) -> P:
  """The mesh ``PartitionSpec`` of a linen box's value.

  ``nn.Partitioned``: its names are mesh axes. ``nn.LogicallyPartitioned``:
  its names go through the box's own rules, else ``rules`` (as
  ``nn.logical_to_mesh_axes`` maps them: a name no rule maps is unsharded);
  with no rules at all, names that are all mesh axes are taken as such.

  Raises:
    ValueError: logical names that are not mesh axes and no rules to map
      them, naming the ways to pass the rules.
  """
  names = tuple(box.names)
  if not is_logical(box):
    return P(*names)
  rules = getattr(box, "rules", None) or rules
  if rules:
    return sys.modules["flax.linen.spmd"].logical_to_mesh_axes(names,
                                                               tuple(rules))
  flat = [a for n in names if n is not None
          for a in ((n,) if isinstance(n, str) else n)]
  missing = [a for a in flat if a not in sizes]
  if missing:
    raise ValueError(
        f"zero1: parameter {where} is annotated with the logical axis names "
        f"{names} (nn.with_logical_partitioning), and no logical axis rules "
        f"map them to the mesh's axes {tuple(sizes)}: {missing[0]!r} is not "
        f"a mesh axis. Pass the rules your program shards with: "
        f"zero1(..., logical_axis_rules=rules), or call tx.init / "
        f"TrainState.create under `with nn.logical_axis_rules(rules):`.")
  return P(*names)


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _same(a, b) -> bool:
  n = max(len(a), len(b))
  pad = lambda s: [_axes(e) for e in tuple(s) + (None,) * (n - len(s))]
  return pad(a) == pad(b)


def _box_names(spec: P, box, rules: Any) -> tuple:
  """Names for the box of a state leaf placed as ``spec`` whose parameter
  is boxed as ``box``: under ``rules`` they must map back to ``spec``.

  The parameter's logical names are kept; on the shard dim the data axis
  goes in as a logical name the rules map to it alone (``'batch'`` under
  ``('batch', 'data')``), or, shared with other axes there, as their tuple
  (rules pass tuples through; ``PartitionSpec`` folds a 1-tuple into a
  string, which rules would then look up). Without rules, or when no
  rule fits: the spec's mesh axes themselves."""
  raw = tuple(e for e in spec)
  if not rules or box is None or not is_logical(box):
    return raw
  to_mesh = sys.modules["flax.linen.spmd"].logical_to_mesh_axes
  names = list(box.names) + [None] * (len(raw) - len(box.names))
  for d, e in enumerate(raw):
    own = to_mesh((names[d],), rules)[0] if names[d] is not None else None
    if _axes(e) == _axes(own):
      continue
    axes = _axes(e)
    if len(axes) > 1:
      names[d] = axes
      continue
    alias = [r for r, m in rules if _axes(m) == axes and isinstance(r, str)]
    names[d] = alias[0] if alias else e
  names = tuple(names)
  return names if _same(to_mesh(names, rules), spec) else raw


def _param_boxes(like: Any) -> list[tuple[str, Any]]:
  """(keystr path, wrapper) of each wrapped leaf of ``like``."""
  flat = jax.tree_util.tree_flatten_with_path(like, is_leaf=_wrapped)[0]
  return [(jax.tree_util.keystr(p), x) for p, x in flat if _wrapped(x)]


OPTIMIZER_SHARDING = (
    "zero1: {count} param(s) carry nnx's optimizer-sharding metadata (e.g. "
    "{where}: {key}={value!r}), which asks for their optimizer state to be "
    "placed unlike the param. zero1 places that state itself: the param's "
    "own sharding with the data axis added on its shard dim (1/N per device), "
    "so {key} is not applied. Remove it from those params, or leave them out "
    "of zero1 (optax.multi_transform) if their state must be placed so.")


def _say_optimizer_sharding(found) -> None:
  """Warns once per init when nnx params ask for an optimizer-state
  placement (``optimizer_sharding`` / ``opt_sharding``) other than their
  own sharding: zero1's placement replaces it."""
  import warnings
  asked = []
  for path, b in found:
    if is_box(b):
      continue
    meta = b.get_metadata()
    for key in ("optimizer_sharding", "opt_sharding"):
      v = meta.get(key)
      if v is not None and tuple(v) != tuple(meta.get("out_sharding") or ()):
        asked.append((path or "<root>", key, v))
  if asked:
    where, key, value = asked[0]
    warnings.warn(OPTIMIZER_SHARDING.format(
        count=len(asked), where=where, key=key, value=value), UserWarning,
        stacklevel=5)


def box_state(state: Any, specs: Any, like: Any, rules: Any = ()) -> Any:
  """``state`` with each sharded leaf wrapped as ``like``'s params are
  wrapped, its metadata naming its spec in ``specs``. Each state leaf takes
  the wrapper of the parameter whose path its path ends with (optax states
  mirror the param tree), else the first one. Linen params: a box of the
  same class whose names map to the spec under ``rules``
  (:func:`_box_names`); nnx params: a Variable of the same type with
  ``out_sharding`` the spec (no ``sharding_rules`` or optimizer-sharding
  keys: the spec is in mesh axes). Leaves with a replicated spec stay bare.
  ``like`` without wrappers: ``state`` unchanged."""
  found = _param_boxes(like)
  if not found:
    return state
  _say_optimizer_sharding(found)
  is_p = lambda s: isinstance(s, P)
  flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_p)
  leaves = treedef.flatten_up_to(state)
  out = []
  for (path, spec), x in zip(flat, leaves):
    if x is None or not any(e is not None for e in spec):
      out.append(x)
      continue
    key = jax.tree_util.keystr(path)
    mine = [b for p, b in found if p and key.endswith(p)]
    template = mine[0] if mine else found[0][1]
    if is_box(template):
      out.append(template.replace(
          value=x, names=_box_names(spec, template if mine else None, rules)))
    else:
      meta = {k: v for k, v in template.get_metadata().items()
              if k not in _DROP}
      meta["out_sharding"] = tuple(spec)
      out.append(type(template).from_metadata(x, meta))
  return treedef.unflatten(out)
