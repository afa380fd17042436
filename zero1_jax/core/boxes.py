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

# A param Variable's metadata that would undo zero1's spec on a state
# Variable made from it: its sharding under each name flax reads (flax maps
# the deprecated 'sharding' and 'sharding_names' onto 'out_sharding' each time
# a Variable is made, as nnx.Optimizer makes its OptVariables), the rules
# it is read through, placements asked for the optimizer, and the scan axis
# a program inserts into an unscanned spec (nnx.PARTITION_NAME, MaxText's
# 'param_scan_axis'): zero1's spec has every dim already.
_DROP = ("out_sharding", "sharding", "sharding_names", "sharding_rules",
         "optimizer_sharding", "opt_sharding", "partition_name",
         "param_scan_axis")


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


def mesh_axes(box, sizes: Mapping[str, int], rules: Any, where: str,
              data_axis: str | None = None) -> P:
  """The mesh ``PartitionSpec`` of a linen box's value.

  ``nn.Partitioned``: its names are mesh axes. ``nn.LogicallyPartitioned``:
  its names go through the box's own rules, else ``rules`` (as
  ``nn.logical_to_mesh_axes`` maps them: a name no rule maps is unsharded);
  with no rules at all, names that are all mesh axes are taken as such.
  With no rules and every mesh axis but ``data_axis`` of size 1 (a
  data-parallel mesh, e.g. flax's lm1b with its ``jax.eval_shape`` of the
  init outside its rules), logical names are unsharded: whatever the rules
  map them to splits nothing. (A rule mapping one to the data axis itself
  is refused once the rules are known, at the update.)

  Raises:
    ValueError: logical names that are not mesh axes and no rules to map
      them on a mesh with other axes of size > 1, naming the ways to pass
      the rules.
  """
  names = tuple(box.names)
  if not is_logical(box):
    return P(*names)
  return names_to_mesh(names, getattr(box, "rules", None) or rules, sizes,
                       where, data_axis)


def sharding_names(out_sharding: Any) -> tuple:
  """The axis names of an nnx ``out_sharding`` in each form flax shards a
  Variable by: names, a ``PartitionSpec``, a ``NamedSharding`` (its spec:
  JAX's LLM-pretraining tutorial writes ``nnx.with_partitioning(init,
  NamedSharding(mesh, P(None, 'model')))``) or a layout ``Format`` (its
  sharding's).

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> sharding_names(P(None, "model")), sharding_names(("data", None))
    ((None, 'model'), ('data', None))
  """
  s = getattr(out_sharding, "sharding", out_sharding)   # a Format's
  return tuple(getattr(s, "spec", s))


def variable_axes(var, sizes: Mapping[str, int], rules: Any, where: str,
                  data_axis: str | None = None) -> P | None:
  """The mesh ``PartitionSpec`` an nnx ``Variable``'s metadata names
  (``nnx.with_partitioning``'s ``out_sharding``, through its
  ``sharding_rules``, else ``rules``, where they are logical names, as
  :func:`mesh_axes`), or None where it names none."""
  meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
  names = meta.get("out_sharding", meta.get("sharding"))
  if names is None:
    return None
  names = sharding_names(names)
  flat = [a for n in names if n is not None
          for a in ((n,) if isinstance(n, str) else n)]
  own = meta.get("sharding_rules")
  if all(a in sizes for a in flat) and not own:
    return P(*names)
  return names_to_mesh(names, own or rules, sizes, where, data_axis)


def names_to_mesh(names: tuple, rules: Any, sizes: Mapping[str, int],
                  where: str, data_axis: str | None = None) -> P:
  """Logical axis ``names`` as mesh axes (:func:`mesh_axes`' rules)."""
  if rules:
    return sys.modules["flax.linen.spmd"].logical_to_mesh_axes(names,
                                                               tuple(rules))
  flat = [a for n in names if n is not None
          for a in ((n,) if isinstance(n, str) else n)]
  missing = [a for a in flat if a not in sizes]
  if missing and data_axis is not None and all(
      int(m) == 1 for a, m in sizes.items() if a != data_axis):
    return P(*(n if n is not None and all(a in sizes for a in _axes(n))
               else None for n in names))
  if missing:
    raise ValueError(
        f"zero1: parameter {where} is annotated with the logical axis names "
        f"{names} (nn.with_logical_partitioning), and no logical axis rules "
        f"map them to the mesh's axes {tuple(sizes)}: {missing[0]!r} is not "
        f"a mesh axis. Pass the rules your program shards with: "
        f"zero1(..., logical_axis_rules=rules) (needed when the state is "
        f"first built outside the rules' context, e.g. by jax.eval_shape of "
        f"the init as flax's lm1b does), or call tx.init / "
        f"TrainState.create under `with nn.logical_axis_rules(rules):`.")
  return P(*names)


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _same(a, b, sizes: Mapping[str, int] | None = None) -> bool:
  """Same placement; axes of size 1 in ``sizes`` aside (they split nothing)."""
  n = max(len(a), len(b))
  real = lambda e: tuple(x for x in _axes(e) if (sizes or {}).get(x) != 1)
  pad = lambda s: [real(e) for e in tuple(s) + (None,) * (n - len(s))]
  return pad(a) == pad(b)


def _data_name(entry, sizes: Mapping[str, int] | None, data_axis: str | None):
  """A name for the dim placed ``entry`` (which holds the data axis) that
  any logical axis rules pass through unchanged: flax maps only string
  names and passes tuples of mesh axes as they are, but ``PartitionSpec``
  folds a 1-tuple into a string. So the data axis alone is paired with a
  mesh axis of size 1 (which splits nothing): ``('data', 'tensor')``.
  Without such an axis: ``entry`` itself (a rule must then map it)."""
  axes = _axes(entry)
  if len(axes) > 1:
    return axes
  units = [a for a, m in (sizes or {}).items()
           if int(m) == 1 and a not in axes and a != data_axis]
  return (axes[0], units[0]) if axes and units else entry


def _box_names(spec: P, box, rules: Any, sizes: Mapping[str, int] | None = None,
               data_axis: str | None = None, own: bool = True) -> tuple:
  """Names for the box of a state leaf placed as ``spec`` whose parameter
  is boxed as ``box``: under the program's rules they must map back to
  ``spec``.

  The parameter's logical names are kept; on the shard dim the data axis
  goes in as a logical name the rules map to it alone (``'batch'`` under
  ``('batch', 'data')``), else as a tuple of mesh axes that rules pass
  through (:func:`_data_name`). The rules may not be known yet (a
  ``jax.eval_shape`` of the init outside ``nn.logical_axis_rules``, as in
  flax's lm1b): then the logical names with that tuple, which map right
  under any rules that map the param's names. A bare param among boxed
  ones (``own`` False) starts from the spec's mesh axes instead.
  Non-logical boxes, or when no name fits: the spec's mesh axes."""
  raw = tuple(e for e in spec)
  if not is_logical(box):
    return raw
  rules = getattr(box, "rules", None) or rules
  # A bare param among boxed ones (``own`` False): its mesh axes as names.
  names = list(box.names if own else raw)
  names += [None] * (len(raw) - len(names))
  if not rules:
    for d, e in enumerate(raw):
      if data_axis is not None and data_axis in _axes(e):
        names[d] = _data_name(e, sizes, data_axis)
    return tuple(names)
  to_mesh = sys.modules["flax.linen.spmd"].logical_to_mesh_axes
  for d, e in enumerate(raw):
    own = to_mesh((names[d],), rules)[0] if names[d] is not None else None
    if _same((e,), (own,), sizes):
      continue
    axes = _axes(e)
    if len(axes) > 1:
      names[d] = axes
      continue
    alias = [r for r, m in rules if _axes(m) == axes and isinstance(r, str)]
    names[d] = (alias[0] if alias else _data_name(e, sizes, data_axis)
                if data_axis in axes else e)
  names = tuple(names)
  return names if _same(to_mesh(names, rules), spec, sizes) else raw


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


_STATE_BOX: list = []


def state_box_class() -> type:
  """The box zero1 puts on a state leaf whose params carry none: a subclass
  of flax's ``nn.Partitioned`` (so flax reads its names as mesh axes), told
  apart from the boxes a program's own params carry
  (:func:`strip_state_boxes`). Made once flax is loaded."""
  if not _STATE_BOX:
    meta = sys.modules["flax.core.meta"]

    class Zero1Partitioned(meta.Partitioned):
      """zero1's placement of an optimizer-state leaf (mesh axes). Reads
      as its value does for ``shape``, ``dtype``, ``ndim``, ``size``."""
      shape = property(lambda self: self.value.shape)
      dtype = property(lambda self: self.value.dtype)
      ndim = property(lambda self: self.value.ndim)
      size = property(lambda self: self.value.size)

    Zero1Partitioned.__module__ = __name__
    _STATE_BOX.append(Zero1Partitioned)
  return _STATE_BOX[0]


def is_state_box(x) -> bool:
  """A box :func:`box_state` added to a state leaf of bare params."""
  return bool(_STATE_BOX) and isinstance(x, _STATE_BOX[0])


def strip_state_boxes(tree: Any) -> Any:
  """``tree`` without the boxes zero1 added (:func:`is_state_box`): the
  state as optax holds it for bare params; a program's own boxes stay."""
  return jax.tree.map(lambda x: x.value if is_state_box(x) else x, tree,
                      is_leaf=is_state_box)


def box_state(state: Any, specs: Any, like: Any, rules: Any = (),
              sizes: Mapping[str, int] | None = None,
              data_axis: str | None = None, bare: bool = False,
              mesh: Any = None) -> Any:
  """``state`` with each sharded leaf wrapped as ``like``'s params are
  wrapped, its metadata naming its spec in ``specs``. Each state leaf takes
  the wrapper of the parameter whose path its path ends with (optax states
  mirror the param tree), else the first one. Linen params: a box of the
  same class whose names map to the spec under ``rules``
  (:func:`_box_names`); nnx params: a Variable of the same type with
  ``out_sharding`` the spec (no ``sharding_rules`` or optimizer-sharding
  keys: the spec is in mesh axes). Leaves with a replicated spec stay bare.

  ``like`` without wrappers: ``state`` unchanged, unless ``bare`` (the
  mesh came from ``zero1(mesh=)``, outside ``jax.set_mesh``: how a program
  builds its state under ``jax.eval_shape`` before placing anything) and
  flax is loaded: then each sharded leaf is in a box naming its spec
  (:func:`state_box_class`, an ``nn.Partitioned``), since flax derives
  shardings from an abstract state only through boxes
  (``nn.get_sharding(jax.eval_shape(init), mesh)``; a bare leaf is ``P()``,
  replicated).

  ``mesh``: where no ``jax.set_mesh`` names one, the mesh the state is on,
  kept in nnx Variables' metadata (``mesh``): ``nnx.Optimizer`` wraps each
  state leaf in a Variable, and flax places a Variable created with an
  ``out_sharding`` only on the context's mesh or its own."""
  found = _param_boxes(like)
  if not found:
    if not bare or sys.modules.get("flax.core.meta") is None:
      return state
    box = state_box_class()
    return _map_sharded(state, specs, lambda x, spec: box(x, tuple(spec)))
  _say_optimizer_sharding(found)

  def wrap(x, spec, key):
    mine = [b for p, b in found if p and key.endswith(p)]
    template = mine[0] if mine else found[0][1]
    if is_box(template):
      return template.replace(value=x, names=_box_names(
          spec, template, rules, sizes, data_axis, own=bool(mine)))
    meta = {k: v for k, v in template.get_metadata().items()
            if k not in _DROP}
    # Mesh axes as 1-tuples: a program that reads every Variable's names
    # through linen's logical rules (MaxText) turns a name no rule maps into
    # None, and passes a tuple through; PartitionSpec folds it back.
    meta["out_sharding"] = tuple((e,) if isinstance(e, str) else e
                                 for e in spec)
    if mesh is not None and meta.get("mesh") is None:
      meta["mesh"] = mesh
    return type(template).from_metadata(x, meta)
  return _map_sharded(state, specs, wrap, with_key=True)


def _map_sharded(state: Any, specs: Any, wrap, with_key: bool = False) -> Any:
  """``state`` with ``wrap(leaf, spec[, keystr])`` at each leaf whose spec
  shards it (the others as they are)."""
  is_p = lambda s: isinstance(s, P)
  flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_p)
  leaves = treedef.flatten_up_to(state)
  out = []
  for (path, spec), x in zip(flat, leaves):
    if x is None or not any(e is not None for e in spec):
      out.append(x)
    elif with_key:
      out.append(wrap(x, spec, jax.tree_util.keystr(path)))
    else:
      out.append(wrap(x, spec))
  return treedef.unflatten(out)
