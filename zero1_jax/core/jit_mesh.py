"""Where plain-jit code runs: the mesh, and the params' sharding on it.

``tx.init`` / ``tx.update`` outside shard_map (:mod:`.jit_mode`) take the
mesh from ``jax.set_mesh``, else from the arrays' ``NamedSharding``, else
from ``zero1(mesh=)`` (:func:`find_mesh`); refuse or warn about arrays
committed to other devices (:func:`off_mesh`); and read the params'
sharding over the mesh's other axes (:func:`param_axes`), which under jit on
Auto axes only an earlier eager ``tx.init`` could see.

Example:
  >>> import jax, jax.numpy as jnp
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> with jax.set_mesh(mesh):
  ...   for_shard_map, found = find_mesh("data", {"w": jnp.ones(3)})
  >>> for_shard_map is None, found.axis_names   # shard_map reads the context
  (True, ('data',))
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from zero1_jax.core import boxes
from zero1_jax.core import param_axes as pax
from zero1_jax.core import placement


def _no_mesh(axis: str, why: str) -> ValueError:
  return ValueError(
      f"zero1: axis '{axis}' is not bound and {why}. tx.init / tx.update run "
      f"either inside shard_map over '{axis}' (z1.init / z1.train_step, or "
      f"your own jax.shard_map), or in plain jax.jit code under a mesh with "
      f"that axis: `with jax.set_mesh(jax.make_mesh((n,), ('{axis}',))):`, or "
      f"with params placed on one (jax.device_put(params, "
      f"NamedSharding(mesh, P()))), or with the mesh passed to "
      f"zero1(..., mesh=mesh) (e.g. for jax.eval_shape(init) before "
      f"jax.set_mesh).")


NO_MESH_AT_INIT = (
    "zero1: tx.init found no mesh with axis '{axis}': no jax.set_mesh "
    "context, and nothing passed to it is placed on one. Where your step "
    "runs decides the fix. Under jax.pmap(..., axis_name='{axis}') (flax's "
    "wmt and imagenet examples, which create the TrainState and then "
    "jax_utils.replicate it): create the state inside pmap, where each "
    "device makes its own 1/N shards: state = jax.pmap(lambda p: "
    "TrainState.create(apply_fn=..., params=p, tx=tx), axis_name='{axis}')"
    "(jax_utils.replicate(params)). Under jax.jit on a mesh (e.g. the "
    "optimizer initialised before the model is sharded, as in Equinox's "
    "parallelism example): pass the mesh to the optimizer, "
    "zero1(..., mesh=mesh), i.e. z1.zero1(opt, axis_name='{axis}', "
    "mesh=mesh), or call tx.init under `with jax.set_mesh(mesh):` or on "
    "params placed on the mesh. Or call tx.init inside shard_map over "
    "'{axis}', as z1.init does.")


def find_mesh(axis: str, *trees: Any, fallback: Any = None,
              at_init: bool = False) -> tuple[Any, Any]:
  """``(mesh for jax.shard_map, the mesh)``: the ``jax.set_mesh`` mesh
  (``None`` for shard_map: it reads the context), else the mesh of the first
  array in ``trees`` with a ``NamedSharding`` that has ``axis`` (params,
  then gradients, then the optimizer state: a state made under
  ``jax.set_mesh`` carries its mesh into a step jitted outside it), else
  ``fallback`` (``zero1(..., mesh=)``).

  Raises:
    ValueError: no such mesh, naming the fix (``jax.set_mesh`` or shard_map).
  """
  ctx = jax.sharding.get_abstract_mesh()
  if not ctx.empty:
    if axis not in ctx.axis_names:
      raise _no_mesh(axis, f"the jax.set_mesh mesh has axes "
                     f"{tuple(ctx.axis_names)}, not '{axis}'")
    return None, ctx
  others = []
  for x in jax.tree.leaves(boxes.strip(trees)):
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      sharding = x.sharding
    else:
      sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if isinstance(sharding, NamedSharding) and axis in mesh.axis_names:
      return mesh, mesh
    if isinstance(sharding, NamedSharding) and not mesh.empty:
      others.append(tuple(mesh.axis_names))
  if fallback is not None and axis in fallback.axis_names:
    return fallback, fallback
  if fallback is not None:
    raise _no_mesh(axis, f"the mesh passed to zero1(mesh=) has axes "
                   f"{tuple(fallback.axis_names)}, not '{axis}'")
  if others:
    raise _no_mesh(axis, f"the arguments' mesh has axes {others[0]}, not "
                   f"'{axis}' (pass zero1(..., axis_name=<one of them>))")
  if at_init:
    raise ValueError(NO_MESH_AT_INIT.format(axis=axis))
  raise _no_mesh(axis, "no mesh was found (no jax.set_mesh context, and no "
                 f"argument has a NamedSharding with axis '{axis}')")


def legacy_mesh() -> bool:
  """Whether a legacy ``with mesh:`` context is set (EasyLM, t5x: deprecated
  by jax, which sets the abstract mesh only inside a pjit there)."""
  try:   # private, 0.10.2 to 0.12
    from jax._src.mesh import thread_resources
    return not thread_resources.env.physical_mesh.empty
  except (ImportError, AttributeError):   # pragma: no cover - another jax
    return False


def off_mesh(mesh: Any, trees: dict[str, Any]) -> str | None:
  """A leaf committed to other devices than ``mesh``'s (e.g. one device),
  named with its devices; None if every committed array is on the mesh."""
  if mesh is None:   # the jax.set_mesh context: its concrete devices
    try:
      mesh = jax.sharding.get_mesh()
    except ValueError:   # under jax.jit: the arguments are tracers
      return None
  try:
    devices = set(mesh.devices.flat)
  except (AttributeError, ValueError):   # an abstract mesh: traced arguments
    return None
  for name, tree in trees.items():
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) \
          and x.committed and set(x.sharding.device_set) != devices:
        ids = sorted(d.id for d in x.sharding.device_set)
        return f"{name}{jax.tree_util.keystr(path)} (devices {ids})"
  return None


def place_first(where: str, axis: str) -> str:
  return (f"zero1: {where} is committed to other devices than the "
          f"mesh's. "
          f"Place the params on it first, e.g. jax.device_put(params, "
          f"NamedSharding(mesh, P())) (or z1.reduced_params(params, mesh, "
          f"axis_name='{axis}')); a jax.jit step on them would be refused.")


def param_axes(tx: Any, params: Any, mesh: Any) -> pax.ParamAxes | None:
  """The params' sharding over the mesh's other axes (2-D meshes), read from
  ``param_specs``, linen boxes, nnx Variables' ``with_partitioning``
  metadata, or the arrays / explicitly typed tracers. Under jit on Auto axes
  bare tracers carry none: then the sharding ``tx.init`` read (from concrete
  arrays, boxes or Variables of the same shapes: flax's ``TrainState.create``,
  ``nnx.Optimizer`` eagerly or inside a jitted create) is used; failing that,
  a warning says so and the params count as replicated over those axes."""
  axis = tx.config.axis_name
  rules = tx.config.logical_axis_rules or boxes.context_rules()
  if rules:
    tx.seen_rules = rules   # for a step traced outside the rules' context
  pa = pax.resolve(params, dict(mesh.shape), axis, tx.config.param_specs,
                   rules=rules or getattr(tx, "seen_rules", None))
  wrapped = lambda x: boxes.is_box(x) or boxes.is_variable(x)
  from_meta = any(boxes.is_box(x) or (boxes.is_variable(x) and boxes.variable_axes(
      x, dict(mesh.shape), rules, jax.tree_util.keystr(p)) is not None)
                  for p, x in jax.tree_util.tree_flatten_with_path(
                      params, is_leaf=wrapped)[0])
  params = boxes.strip(params)
  leaves = jax.tree.leaves(params)
  # Shapes and dtypes, not the treedef: nnx hands init and update the same
  # arrays in differently typed containers.
  key = tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)
  if from_meta or not any(isinstance(x, jax.core.Tracer) for x in leaves):
    tx.seen_param_axes[key] = pa   # what a later traced update falls back on
    return pa
  auto = [a for a, t in zip(mesh.axis_names, mesh.axis_types)
          if a != axis and mesh.shape[a] > 1
          and t != jax.sharding.AxisType.Explicit]
  if pa is None and auto and tx.config.param_specs is None:
    if key in tx.seen_param_axes:
      return tx.seen_param_axes[key]
    warnings.warn(
        f"zero1: under jax.jit the params' sharding over the Auto mesh axes "
        f"{auto} cannot be read, so they are treated as replicated over them. "
        f"If they are sharded there (tensor parallel), pass "
        f"zero1(..., param_specs=<tree of PartitionSpec>), make those axes "
        f"Explicit, or call tx.init on the placed arrays outside jit.",
        stacklevel=placement.user_stacklevel())
  return pa
