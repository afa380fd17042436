"""Parameters sharded over mesh axes other than the data axis (2-D meshes).

On a mesh such as ``("data", "model")`` with the weights tensor-parallel on
``"model"`` (``NamedSharding(mesh, P(None, "model"))``), each device holds a
*block* of every such parameter. ZeRO-1 then works on blocks: each device's
master and optimizer state is 1/N_data of its own block (Megatron-Core's
distributed optimizer shards state over the data-parallel ranks inside each
tensor-parallel group), gradients are reduced over the data axis only, and
the parameters keep their sharding.

:class:`ParamAxes` records, per parameter leaf and dim, the mesh axes that
shard it. :func:`resolve` reads them from ``param_specs``, from the arrays'
``NamedSharding`` or from Flax partitioning metadata (``nn.Partitioned``).
The split over the data axis avoids the dims those axes already shard
(:func:`zero1_jax.core.layout.choose_shard_dim`), so a state leaf's global
view is the parameter zero-padded at the end of one dim, as on a 1-D mesh:
checkpoints move between mesh shapes unchanged.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> params = {"b": jnp.zeros(8), "w": jnp.zeros((6, 8))}
  >>> pa = resolve(params, {"data": 4, "model": 2}, "data",
  ...              {"b": P("model"), "w": P(None, "model")})
  >>> pa.taken, [pa.local_shape(i, x.shape) for i, x in
  ...            enumerate(jax.tree.leaves(params))]
  (((0,), (1,)), [(4,), (6, 4)])
  >>> from zero1_jax.core import layout as lay
  >>> L = lay.plan(pa.local_tree(params), 4, pa.taken)
  >>> [(s.kind, s.dim, s.shard_shape) for s in L.leaves]  # w avoids dim 1
  [('shard', 0, (1,)), ('shard', 0, (2, 4))]
  >>> [tuple(pa.state_spec(i, s)) for i, s in enumerate(L.leaves)]
  [(('model', 'data'),), ('data', 'model')]
"""

from __future__ import annotations

import math
import sys
from typing import Any, Mapping, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zero1_jax.core import boxes
from zero1_jax.core import layout as lay

Axes = tuple[str, ...]


class ParamAxes(NamedTuple):
  """How each parameter leaf is sharded over the mesh's non-data axes."""

  data_axis: str
  leaves: tuple[tuple[Axes, ...], ...]   # per leaf, per dim: the axes on it
  sizes: tuple[tuple[str, int], ...]     # (mesh axis, size)

  def size(self, axes: Axes) -> int:
    sizes = dict(self.sizes)
    return math.prod(sizes[a] for a in axes)

  @property
  def taken(self) -> tuple[tuple[int, ...], ...]:
    """Per leaf, the dims already sharded (for :func:`layout.plan`)."""
    return tuple(tuple(d for d, a in enumerate(dims) if a)
                 for dims in self.leaves)

  def local_shape(self, i: int, shape) -> tuple[int, ...]:
    return tuple(int(s) // self.size(a) for s, a in zip(shape, self.leaves[i]))

  def local_tree(self, params: Any) -> Any:
    """``ShapeDtypeStruct``s of each device's block of ``params``."""
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([
        jax.ShapeDtypeStruct(self.local_shape(i, np.shape(x)), x.dtype)
        for i, x in enumerate(leaves)])

  def param_spec(self, i: int) -> P:
    return P(*(_entry(a) for a in self.leaves[i]))

  def param_specs(self, params: Any) -> Any:
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([self.param_spec(i) for i in range(len(leaves))])

  def state_spec(self, i: int, spec: lay.LeafSpec) -> P:
    """Spec of leaf ``i``'s master / moment: its parameter's, with the data
    axis added (minor) on the shard dim."""
    dims = list(self.leaves[i])
    if spec.kind == lay.SHARD:
      dims[spec.dim] = dims[spec.dim] + (self.data_axis,)
    return P(*(_entry(a) for a in dims))

  def global_shape(self, i: int, local) -> tuple[int, ...]:
    """The global shape of a state leaf whose per-device piece, gathered
    over the data axis, is ``local`` (a block-shaped, padded shape)."""
    return tuple(int(s) * self.size(a) for s, a in zip(local, self.leaves[i]))

  def norm_axes(self, i: int, spec: lay.LeafSpec) -> Axes:
    """Axes to sum leaf ``i``'s squared norm over: each block once."""
    axes = tuple(a for dims in self.leaves[i] for a in dims)
    return axes + ((self.data_axis,) if spec.kind == lay.SHARD else ())


def _entry(axes: Axes):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _boxed(x) -> bool:
  """A Flax partitioning box (``nn.Partitioned``): has names and unbox()."""
  return hasattr(x, "names") and callable(getattr(x, "unbox", None))


def _variable(x) -> bool:
  """A Flax ``nnx.Variable`` (what ``nnx.state(model)`` holds)."""
  nnx = sys.modules.get("flax.nnx")    # not imported: there are none
  return nnx is not None and isinstance(x, nnx.Variable)


def unbox(params: Any) -> Any:
  """``params`` with Flax partitioning boxes replaced by their values."""
  return jax.tree.map(lambda x: x.unbox() if _boxed(x) else x, params,
                      is_leaf=_boxed)


def values(tree: Any) -> Any:
  """``tree`` with Flax partitioning boxes and nnx ``Variable`` wrappers
  replaced by the values they hold, no sharding constraint applied (a box's
  ``unbox()`` applies its own, which an Explicit mesh takes as an assert)."""
  return jax.tree.map(lambda x: x.value if _boxed(x) else x,
                      strip_variables(tree), is_leaf=_boxed)


def strip_variables(tree: Any) -> Any:
  """``tree`` with nnx ``Variable`` wrappers replaced by their values (Linen
  boxes stay). ``tx.init`` builds the state from the bare arrays: state
  leaves wrapped like the params carry the params' sharding metadata, which
  ``nnx.Optimizer`` applies to them (on a 2-D mesh: every moment replicated
  over the data axis until the first update)."""
  return jax.tree.map(lambda x: x.get_value() if _variable(x) else x, tree,
                      is_leaf=_variable)


def rewrap_variables(like: Any, tree: Any) -> Any:
  """``tree``, as :func:`strip_variables` left ``like``, back in ``like``'s
  ``Variable`` wrappers (same leaves, in order)."""
  if not any(map(_variable, jax.tree.leaves(like, is_leaf=_variable))):
    return tree
  return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(tree))


def _spec_of(x, sizes, rules, where, data_axis=None) -> Any:
  if _boxed(x):
    return boxes.mesh_axes(x, sizes, rules, where, data_axis)
  if _variable(x):   # nnx: its metadata, else its value's placement
    spec = boxes.variable_axes(x, sizes, rules, where, data_axis)
    return spec if spec is not None else _spec_of(x.get_value(), sizes,
                                                  rules, where, data_axis)
  if isinstance(x, jax.core.Tracer):
    sharding = getattr(jax.typeof(x), "sharding", None)
  else:
    sharding = getattr(x, "sharding", None)
  return sharding.spec if isinstance(sharding, NamedSharding) else None


def _dims(spec, ndim: int, where: str) -> tuple[Axes, ...]:
  # .partitions: iterating a spec typed reduced/unreduced is refused (jax 0.12).
  parts = (() if spec is None else
           tuple(spec.partitions) if hasattr(spec, "partitions") else tuple(spec))
  if len(parts) > ndim:
    raise ValueError(f"zero1: param_specs{where} {spec} has more entries than "
                     f"the parameter's {ndim} dims.")
  out = []
  for a in parts + (None,) * (ndim - len(parts)):
    out.append(() if a is None else (a,) if isinstance(a, str) else tuple(a))
  return tuple(out)


# Params sharded over the data axis (FSDP: nanodo's default, MaxText's fsdp)
# stay refused rather than passed through: their optax state already
# follows their sharding, 1/N per device, and FSDP shards the weights too.
# Measured (nanodo, D 32, 1 layer, 8 CPU devices): optax on its FSDP params
# 17,296 B of optimizer state per device, zero1 on its data-parallel params
# 16,304, optax data-parallel 130,192 (docs/flax_programs.md).
FSDP_REFUSED = (
    "zero1: parameter {path} is sharded over the data axis '{axis}' "
    "({spec}): FSDP. zero1 shards the optimizer state over '{axis}' and "
    "keeps the weights whole there. With FSDP params optax's own state "
    "already follows their sharding, 1/N per device (and the weights are "
    "1/N too): keep the plain optax optimizer for FSDP. For zero1, place "
    "the params replicated over '{axis}' (other axes are kept), e.g. "
    "without the FSDP annotations. Params computed from z1.value_and_grad's "
    "gradients, which are sharded over '{axis}' (a wrapper's step such as "
    "optax.contrib.sam's, or params - lr * grads), come out so sharded: "
    "bring them back whole with jax.sharding.reshard(p, P()) "
    "(jax.lax.with_sharding_constraint on Auto axes).")


def resolve(params: Any, sizes: Mapping[str, int], data_axis: str,
            param_specs: Any = None, *, blocks: bool = False,
            rules: Any = None) -> ParamAxes | None:
  """The non-data sharding of ``params``, or None when there is none.

  Read from ``param_specs`` (a tree of ``PartitionSpec`` like ``params``,
  None for replicated leaves), else from each leaf: a Flax ``nn.Partitioned``
  box's names (an ``nn.LogicallyPartitioned`` box's through its own rules,
  else ``rules``, else the ``nn.logical_axis_rules`` context:
  :func:`zero1_jax.core.boxes.mesh_axes`), or the array's (or explicitly
  typed tracer's) ``NamedSharding``.
  ``blocks``: ``params`` are already each device's blocks (inside shard_map).

  Raises:
    ValueError: a spec names the data axis (params are not sharded over it:
      zero1 shards the optimizer state there) or an axis the mesh lacks, or
      a sharded dim is not divisible by its axes' size, or logical names
      have no rules to map them.
  """
  wrapped = lambda x: _boxed(x) or _variable(x)
  leaves, treedef = jax.tree.flatten(params, is_leaf=wrapped)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(params, is_leaf=wrapped)[0]]
  if param_specs is not None:
    try:
      specs = treedef.flatten_up_to(param_specs)
    except (ValueError, TypeError) as e:
      raise ValueError(f"zero1: param_specs does not match the parameter tree "
                       f"({e}).") from None
  else:
    rules = rules or boxes.context_rules()
    specs = [_spec_of(x, sizes, rules, path, data_axis)
             for x, path in zip(leaves, paths)]
  out = []
  for path, x, spec in zip(paths, leaves, specs):
    shape = np.shape(x.value if _boxed(x) else
                     x.get_value() if _variable(x) else x)
    # Axes of size 1 split nothing: such a leaf is whole on every device.
    dims = tuple(tuple(a for a in axes if sizes.get(a, 0) != 1)
                 for axes in _dims(spec, len(shape), path))
    for d, axes in enumerate(dims):
      for a in axes:
        if a == data_axis:
          raise ValueError(FSDP_REFUSED.format(path=path, axis=data_axis,
                                               spec=spec))
        if a not in sizes:
          raise ValueError(
              f"zero1: parameter {path} is sharded over '{a}', which the mesh "
              f"{dict(sizes)} lacks. If '{a}' is a logical axis name, pass "
              f"the rules mapping it to mesh axes: zero1(..., "
              f"logical_axis_rules=rules) or `with nn.logical_axis_rules("
              f"rules):` around tx.init.")
      m = math.prod(sizes[a] for a in axes)
      if shape[d] % m and not blocks:
        raise ValueError(
            f"zero1: parameter {path} has dim {d} of size {shape[d]}, not "
            f"divisible by its mesh axes {axes} (size {m}): pad that dim to a "
            f"multiple of {m}, or shard another dim or none (P() in its "
            f"spec) of this parameter.")
    out.append(dims)
  if not any(a for dims in out for a in dims):
    return None
  used = sorted({a for dims in out for axes in dims for a in axes})
  return ParamAxes(data_axis, tuple(out),
                   tuple((a, int(sizes[a])) for a in used))


def bound_sizes(param_specs: Any, data_axis: str) -> dict[str, int]:
  """Sizes of the axes named in ``param_specs`` and the data axis, read
  inside shard_map (``jax.lax.axis_size``)."""
  names = {data_axis}
  for spec in jax.tree.leaves(param_specs,
                              is_leaf=lambda s: isinstance(s, P)):
    for a in spec if isinstance(spec, P) else ():
      names.update(() if a is None else (a,) if isinstance(a, str) else a)
  return {a: jax.lax.axis_size(a) for a in names}


def global_layout(params: Any, n: int, pa: ParamAxes | None) -> lay.Layout:
  """``params``' split over the data axis in global terms: each leaf's
  ``padded_shape`` is its state leaf's global shape (the parameter padded at
  the end of its shard dim), ``shard_shape`` one device's piece."""
  if pa is None:
    return lay.plan(params, n)
  local = lay.plan(pa.local_tree(params), n, pa.taken)
  leaves = [s._replace(shape=tuple(np.shape(x)),
                       padded_shape=pa.global_shape(i, s.padded_shape))
            for i, (s, x) in enumerate(zip(local.leaves,
                                           jax.tree.leaves(params)))]
  return lay.Layout(local.treedef, tuple(leaves), n)


def with_unit_axes(x, base: tuple, sizes: Mapping[str, int]) -> tuple:
  """``base`` (a spec's entries) with the size-1 mesh axes ``x``'s type
  names added on their dims. A size-1 axis splits nothing, so the plan
  ignores it (:func:`resolve`), but on an Explicit mesh an array is typed
  with it (``f32[16@tensor, 4]``) and a ``shard_map`` over that array must
  name it in ``in_specs``."""
  try:
    spec = jax.typeof(x).sharding.spec
  except (AttributeError, TypeError):
    return base
  parts = tuple(spec.partitions) if hasattr(spec, "partitions") else tuple(spec)
  out = list(base) + [None] * (len(parts) - len(base))
  for d, e in enumerate(parts):
    axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
    if not any(sizes.get(a) == 1 for a in axes):
      continue
    have = _dims(P(out[d]), 1, "")[0]
    out[d] = _entry(tuple(a for a in axes if a in have or sizes.get(a) == 1))
  return tuple(out)
