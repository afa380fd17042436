"""The gradients ``z1.value_and_grad`` returns, and how ``tx.update`` knows them.

Per parameter leaf, the backward leaves each device the gradient summed over
the data axis on its shard (zero1's layout: the parameter padded on its
shard dim to a multiple of N). :func:`publish` hands the program a tree of
the params' structure whose leaves hold jax.value_and_grad's values: each
leaf those shards divided by N (the mean loss's gradient), cut back to the
parameter's shape, and left sharded over the data axis (no collective). So
code that tree-maps over gradients (global norms, means, accumulation,
``jax.tree.map(f, grads, params)``) sees what it sees with
``jax.value_and_grad``, and a global norm is right: the padding is cut off,
not summed.

``tx.update`` takes them back without reducing anything: :func:`lookup`
finds, for the very leaves :func:`publish` returned, the summed shards they
were made from (the mean arrays are then unused and XLA drops them).
Gradients built from them (``jax.tree.map(lambda g: g / k, grads)``) are
new arrays: ``tx.update`` takes those as jax.grad's, so the numbers are
right and the update gathers them first. Integer params get zeros.

:class:`ShardedGrads` (the summed shards, wrapped) is still accepted by
``tx.update``.

Example:
  >>> import jax.numpy as jnp
  >>> g = ShardedGrads({"w": jnp.ones(4)})
  >>> import jax; jax.tree.leaves(g)
  [Array([1., 1., 1., 1.], dtype=float32)]
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class ShardedGrads:
  """A tree of reduced (summed) gradient shards, for ``tx.update``."""

  def __init__(self, tree: Any):
    self.tree = tree

  def tree_flatten(self):
    return (self.tree,), None

  @classmethod
  def tree_unflatten(cls, _, children):
    return cls(children[0])

  # Key lookups as on the gradient dict, so code that inspects its grads
  # (TrainState.apply_gradients looks for flax's overwrite-with-gradient
  # collection) works; a sub-tree is still ShardedGrads.
  def __contains__(self, key) -> bool:
    return isinstance(self.tree, Mapping) and key in self.tree

  def __getitem__(self, key) -> "ShardedGrads":
    return ShardedGrads(self.tree[key])

  def __repr__(self) -> str:
    return f"ShardedGrads({self.tree!r})"


# id(published leaf) -> (weakref to it, the summed shard it came from,
# the backward's groups)
_SHARDS: dict[int, tuple[Any, Any, Any]] = {}


def _remember(leaf, shard, groups) -> None:
  key = id(leaf)
  _SHARDS[key] = (weakref.ref(leaf, lambda _, key=key: _SHARDS.pop(key, None)),
                  shard, groups)


def cut(g, shape) -> Any:
  """``g`` without the padding past ``shape``. On an Explicit data axis JAX
  slices a sharded dim only to a multiple of the axis: such a leaf is made
  whole first (XLA drops it all if nothing but ``tx.update`` reads it)."""
  if tuple(g.shape) == tuple(shape):
    return g
  spec = getattr(getattr(jax.typeof(g), "sharding", None), "spec", None)
  parts = () if spec is None else (
      tuple(spec.partitions) if hasattr(spec, "partitions") else tuple(spec))
  if any(e is not None for e in parts):   # typed sharded: Explicit axes
    whole = jax.sharding.PartitionSpec()
    if jax.sharding.get_abstract_mesh().empty:   # no jax.set_mesh: the
      whole = jax.sharding.NamedSharding(jax.typeof(g).sharding.mesh, whole)
    g = jax.sharding.reshard(g, whole)            # mesh of g's type
  return g[tuple(slice(0, d) for d in shape)]


def explicit(x) -> bool:
  """Whether ``x``'s type carries its sharding: a traced value on a mesh
  with Explicit axes (``jax.make_mesh``'s default)."""
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  return any(t == jax.sharding.AxisType.Explicit
             for t in getattr(mesh, "axis_types", ()) or ())


class Published(NamedTuple):
  """What :func:`lookup` finds behind a tree :func:`publish` returned."""

  tree: Any               # the summed shards, None at zero leaves
  groups: Sequence | None  # (leaf indices, combiner group) per reduce-scatter,
                           # in the backward's order (None: not known)


def publish(shards: Any, params: Any, n: int,
            groups: Sequence | None = None) -> Any:
  """The program's gradients from ``shards`` (the backward's summed shards,
  a tree like ``params`` with None at integer / zero-size leaves): a tree
  like ``params`` of ``shard / n`` cut to each parameter's shape.
  ``groups``: how the backward reduce-scattered them
  (:func:`zero1_jax.core.zero2.backward_groups`), for ``tx.update`` to
  gather the new weights group by group."""
  p_leaves, treedef = jax.tree.flatten(params)
  s_leaves = treedef.flatten_up_to(shards)
  groups = None if groups is None else tuple(
      (tuple(idx), tag) for idx, tag in groups)
  out = []
  for p, s in zip(p_leaves, s_leaves):
    if s is None:
      z = jnp.zeros(jnp.shape(p), jnp.result_type(p))
      _remember(z, None, groups)
      out.append(z)
      continue
    g = cut((s / n).astype(s.dtype), jnp.shape(p))
    _remember(g, s, groups)
    out.append(g)
  return treedef.unflatten(out)


def lookup(grads: Any) -> Published | None:
  """The summed shards behind ``grads`` (a tree like :func:`publish`
  returned, None at its zero leaves) if every floating leaf is one
  :func:`publish` returned, else None; with the backward's groups when all
  those leaves came from one :func:`publish`."""
  leaves, treedef = jax.tree.flatten(grads)
  out, found, plans = [], False, {}
  for g in leaves:
    hit = _SHARDS.get(id(g))
    if hit is not None and hit[0]() is g:
      out.append(hit[1])
      found = found or hit[1] is not None
      plans[id(hit[2])] = hit[2]
    elif jnp.issubdtype(jnp.result_type(g), jnp.inexact):
      return None
    else:
      out.append(None)
  if not found:
    return None
  (groups,) = plans.values() if len(plans) == 1 else (None,)
  return Published(treedef.unflatten(out), groups)
