"""``tx.init`` / ``tx.update`` outside shard_map: plain ``jax.jit`` under a mesh.

Inside a ``shard_map`` over the data axis (``z1.train_step``, a user's own
step), :func:`zero1_jax.zero1`'s ``init`` and ``update`` run per device on
local gradients. Called anywhere else (eagerly or under ``jax.jit``, as
flax's ``TrainState`` and ``nnx.Optimizer`` call them), they land here: the
mesh is taken from ``jax.set_mesh`` or from the arrays' ``NamedSharding``, and
the same per-device code runs inside a ``jax.shard_map`` that this module
builds. ``init`` returns the state sharded over the data axis exactly as
:func:`zero1_jax.init` does (:func:`zero1_jax.core.specs.state_specs`).

What ``update`` receives from ``jax.grad`` under jit decides the reduce:

* plain (replicated) params: the gradient of the global-mean loss, already
  reduced over the data axis by jit's partitioner (XLA:CPU: a full-size
  all-reduce, then each device slices its shard). Mode ``REDUCED``: each
  device takes its shard, no collective, no division by N.
* params placed by :func:`reduced_params` (``P(..., reduced={axis})``):
  ``jax.grad`` returns gradients typed *unreduced* over the axis, partial sums
  whose total is the gradient of the global-mean loss. Mode ``PARTIAL``: one
  ``psum_scatter`` per bucket sums them straight into each device's shard (no
  all-reduce anywhere), no division by N.

Example:
  >>> import jax, jax.numpy as jnp, optax, zero1_jax as z1
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> tx = z1.zero1(optax.sgd(0.5), axis_name="data")
  >>> with jax.set_mesh(mesh):
  ...   params = {"w": jnp.ones(3)}
  ...   state = tx.init(params)                  # no shard_map needed
  ...   grads = jax.grad(lambda p: jnp.sum(p["w"]))(params)
  ...   updates, state = jax.jit(tx.update)(grads, state, params)
  >>> [float(u) for u in updates["w"]]
  [-0.5, -0.5, -0.5]
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zero1_jax.core import boxes
from zero1_jax.core import collectives as col
from zero1_jax.core import elementwise as ew
from zero1_jax.core import empty_leaves
from zero1_jax.core import layout as lay
from zero1_jax.core import offload as ofl
from zero1_jax.core import one_device
from zero1_jax.core import param_axes as pax
from zero1_jax.core import placement
from zero1_jax.core import platform as platforms
from zero1_jax.core import specs as zspecs
from zero1_jax.core import sharded_grads
from zero1_jax.core.sharded_grads import ShardedGrads

LOCAL = "local"        # this device's own gradient inside shard_map: sum, then / N
PARTIAL = "partial"    # jit's unreduced pieces: they sum to the gradient
REDUCED = "reduced"    # jit's reduced gradient: already whole on every device
SHARDS = "shards"      # z1.value_and_grad's ShardedGrads: summed shards, then / N


def axis_bound(axis: str) -> bool:
  """Whether ``axis`` is bound here (we are inside shard_map over it)."""
  try:
    jax.lax.axis_size(axis)
    return True
  except NameError:
    return False


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
    "context, and nothing passed to it is placed on one (e.g. the optimizer "
    "is initialised before the model is sharded, as in Equinox's "
    "parallelism example). Pass the mesh to the optimizer: "
    "zero1(..., mesh=mesh), i.e. z1.zero1(opt, axis_name='{axis}', "
    "mesh=mesh). (Or call tx.init under `with jax.set_mesh(mesh):`, on "
    "params placed on the mesh, or inside shard_map over '{axis}' as "
    "z1.init does.)")


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


def _reduced_over(x, axis: str, field: str) -> bool:
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return axis in getattr(spec, field, ())


def _spec(x, axis: str, field: str | None) -> P:
  """``P()`` for ``x``'s rank, typed ``reduced`` / ``unreduced`` over ``axis``."""
  nones = [None] * jnp.ndim(x)
  return P(*nones, **({field: {axis}} if field else {}))


def grads_mode(grads: Any, layout: lay.Layout, axis: str) -> str:
  """:data:`PARTIAL` if the floating gradients are typed unreduced over
  ``axis``, :data:`REDUCED` if none is; ValueError if only some are."""
  leaves = jax.tree.leaves(grads)
  flags = {_reduced_over(g, axis, "unreduced")
           for g, s in zip(leaves, layout.leaves) if s.kind != lay.STATIC}
  if flags == {True, False}:
    raise ValueError(
        f"zero1: some gradients are unreduced over '{axis}' and some are not: "
        f"place every parameter with z1.reduced_params(params, mesh) (or none "
        f"of them).")
  return PARTIAL if flags == {True} else REDUCED


def local_shards(grads: list, layout: lay.Layout, axis: str) -> dict[int, Any]:
  """Mode :data:`REDUCED`: this device's shard of each whole gradient (no
  collective); scalar leaves as they are. Indexed like ``layout.leaves``."""
  out = {}
  for i, (g, s) in enumerate(zip(grads, layout.leaves)):
    if s.kind == lay.SHARD:
      out[i] = col.local_shard(g, s, axis)
    elif s.kind == lay.REPLICATE:
      out[i] = g
  return out


def _off_mesh(mesh: Any, trees: dict[str, Any]) -> str | None:
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


def _place_first(where: str, axis: str) -> str:
  return (f"zero1: {where} is committed to other devices than the "
          f"mesh's. "
          f"Place the params on it first, e.g. jax.device_put(params, "
          f"NamedSharding(mesh, P())) (or z1.reduced_params(params, mesh, "
          f"axis_name='{axis}')); a jax.jit step on them would be refused.")


def _param_axes(tx: Any, params: Any, mesh: Any) -> pax.ParamAxes | None:
  """The params' sharding over the mesh's other axes (2-D meshes), read from
  ``param_specs`` or the arrays / explicitly typed tracers. Under jit on Auto
  axes it cannot be read: then the sharding ``tx.init`` read from concrete
  arrays of the same shapes is used (flax's ``TrainState.create`` and
  ``nnx.Optimizer`` init eagerly); failing that, a warning says so and the
  params count as replicated over those axes."""
  axis = tx.config.axis_name
  rules = tx.config.logical_axis_rules or boxes.context_rules()
  if rules:
    tx.seen_rules = rules   # for a step traced outside the rules' context
  pa = pax.resolve(params, dict(mesh.shape), axis, tx.config.param_specs,
                   rules=rules or getattr(tx, "seen_rules", None))
  from_meta = any(map(boxes.is_box, jax.tree.leaves(params,
                                                    is_leaf=boxes.is_box)))
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
        stacklevel=4)
  return pa


def _in_specs(tree: Any, pa: pax.ParamAxes | None, axis: str,
              field_of: Callable[[Any], str | None], sizes=None) -> Any:
  """Per leaf: its sharding over the other axes (``pa``, and the size-1
  axes its type names: ``pax.with_unit_axes``), typed ``field_of(leaf)``
  (``reduced`` / ``unreduced`` / None) over ``axis``."""
  leaves, treedef = jax.tree.flatten(tree)
  out = []
  for i, x in enumerate(leaves):
    base = (tuple(pa.param_spec(i)) if pa is not None else ())
    base = base + (None,) * (jnp.ndim(x) - len(base))
    if sizes:
      base = pax.with_unit_axes(x, base, sizes)
    field = field_of(x)
    out.append(P(*base, **({field: {axis}} if field else {})))
  return treedef.unflatten(out)


def _typed(axis: str, field: str) -> Callable[[Any], str | None]:
  return lambda x: field if _reduced_over(x, axis, field) else None


# Stage 2's gradient sharding is a hook in z1.train_step's backward pass;
# plain jax.jit code takes jax.grad's gradients as they come.
STAGE2_AS_STAGE1 = (
    "z1.zero2 in plain jax.jit or eager code (TrainState, nnx.Optimizer) "
    "trains as z1.zero1 on gradients from jax.grad: they were reduced after "
    "the backward, not sharded inside it. For stage 2 here, take the "
    "gradients from z1.value_and_grad(loss, tx) (reduce-scattered leaf by "
    "leaf in the backward), or use z1.train_step; with jax.grad, use "
    "z1.zero1 to say so.")


FP16_NEEDS_SCALE = (
    "zero1: float16 params ({where}) in plain jax.jit / eager code need an "
    "explicit loss-scale choice. zero1's default for fp16 is a dynamic scale "
    "(2^16 at first) that z1.train_step multiplies into the loss itself; "
    "here you compute the gradients, so the update would divide gradients "
    "that were never scaled by it. Choose one: zero1(..., loss_scale="
    "z1.DynamicLossScale()) and multiply your loss by "
    "z1.loss_scale(opt_state) before jax.grad (DeepSpeed's fp16 training), "
    "or zero1(..., loss_scale=z1.NoLossScale()) for unscaled fp16 gradients "
    "(they may underflow).")


def check_fp16_scale(tx: Any, params: Any) -> None:
  """ValueError (:data:`FP16_NEEDS_SCALE`) for float16 params when
  ``tx`` was built without ``loss_scale=``: plain jit code makes the
  gradients, so whether they carry the scale is the user's choice."""
  if tx.config.loss_scale is not None:
    return
  fp16 = [jax.tree_util.keystr(k) for k, x in
          jax.tree_util.tree_flatten_with_path(params)[0]
          if lay.leaf_dtype(x) == jnp.float16]
  if fp16:
    where = ", ".join(fp16[:3]) + (f" +{len(fp16) - 3} more"
                                   if len(fp16) > 3 else "")
    raise ValueError(FP16_NEEDS_SCALE.format(where=where))


def init(tx: Any, init_in: Callable, params: Any, like: Any = None) -> Any:
  """``tx.init(params)`` outside shard_map: ``init_in(params, param_axes)``
  (the per-device init) inside a shard_map over the found mesh; the state
  comes out sharded over the data axis exactly as :func:`zero1_jax.init`
  makes it (:func:`zero1_jax.core.specs.state_specs`), its sharded leaves
  wrapped as ``like``'s params are (linen boxes, nnx Variables) with
  metadata naming that placement (:func:`zero1_jax.core.boxes.box_state`).
  Refuses a non-elementwise inner optimizer like :func:`zero1_jax.init`, and
  float16 params without an explicit ``loss_scale`` (:func:`check_fp16_scale`)."""
  axis = tx.config.axis_name
  check_fp16_scale(tx, boxes.strip(params))
  mesh, where = find_mesh(axis, params, fallback=tx.config.mesh, at_init=True)
  n = where.shape[axis]
  one_device.warn_if_one_device(n, axis, stacklevel=3)   # the caller of tx.init
  off = _off_mesh(mesh, {"params": params})
  if off:
    warnings.warn(_place_first(off, axis), stacklevel=3)
  pa = _param_axes(tx, params, where)
  like = params if like is None else like
  params = boxes.strip(params)
  sizes = dict(where.shape)
  shapes = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), lay.leaf_dtype(x)), params)
  local = shapes if pa is None else pa.local_tree(shapes)
  if tx.config.check_elementwise:
    ew.check_elementwise(tx.inner, local, n, tx.config.master_dtype)
  specs = zspecs.state_specs(tx, shapes, n, pa)
  f = empty_leaves.shard_map(lambda p: init_in(p, pa), mesh=mesh,
                    in_specs=(_in_specs(params, pa, axis,
                                        _typed(axis, "reduced"), sizes),),
                    out_specs=specs, check_vma=False)
  state = jax.jit(f)(params)   # eager shard_map would dispatch op by op
  rules = (tx.config.logical_axis_rules or boxes.context_rules()
           or getattr(tx, "seen_rules", ()))
  # zero1(mesh=) outside jax.set_mesh: a program placing what it derives
  # from the (abstract) state's metadata, e.g. nn.get_sharding.
  bare = tx.config.mesh is not None and jax.sharding.get_abstract_mesh().empty
  return boxes.box_state(state, specs, like, rules, sizes, axis, bare=bare)


SHARDED_2D = (
    "zero1: z1.value_and_grad's gradients on params sharded over other mesh "
    "axes (a 2-D mesh) are not supported yet: use jax.value_and_grad there "
    "(tx.update reduces its gradients).")


def update(tx: Any, update_in: Callable, grads: Any, state: Any, params: Any,
           extra_args: dict | None = None) -> tuple[Any, Any]:
  """``tx.update(grads, state, params)`` outside shard_map, on the gradients
  ``jax.grad`` returns under jit. ``update_in(grads, state, params, mode,
  param_axes, extra_args)`` is the per-device update; ``extra_args``' arrays
  (a ``value=`` loss, traced under jit) enter the shard_map replicated (it
  cannot close over them), the rest is closed over. Updates come out typed and
  sharded like ``params`` (replicated or ``reduced`` over the axis, and
  their own sharding over other axes), so ``optax.apply_updates`` keeps the
  params' placement."""
  axis = tx.config.axis_name
  mesh, where = find_mesh(axis, params, grads, state,
                          fallback=tx.config.mesh)
  n = where.shape[axis]
  sizes = dict(where.shape)
  off = _off_mesh(mesh, {"params": params, "grads": grads})
  if off:
    raise ValueError(_place_first(off, axis))
  pa = _param_axes(tx, params, where)
  grads, state, params = boxes.strip((grads, state, params))
  layout = lay.plan(params if pa is None else pa.local_tree(params), n,
                    None if pa is None else pa.taken)
  shards = sharded_grads.lookup(grads)   # z1.value_and_grad's, as returned
  if shards is not None:
    grads = ShardedGrads(shards)
  if isinstance(grads, ShardedGrads):   # z1.value_and_grad: reduced already
    if pa is not None:
      raise ValueError(SHARDED_2D)
    mode, grads = SHARDS, grads.tree
    g_specs = layout.treedef.unflatten(
        [None if s.kind == lay.STATIC else zspecs.leaf_spec(s, axis)
         for s in layout.leaves])
  else:
    if tx.config.stage == 2:   # jax.grad's gradients: reduced after the backward
      warnings.warn(STAGE2_AS_STAGE1, UserWarning, stacklevel=4)
    mode = grads_mode(grads, layout, axis)
    g_field = "unreduced" if mode == PARTIAL else None
    g_specs = _in_specs(grads, pa, axis, lambda _: g_field, sizes)
  p_specs = _in_specs(params, pa, axis, _typed(axis, "reduced"), sizes)
  s_specs = zspecs.state_specs(tx, params, n, pa)
  if tx.config.check_placement:
    state = placement.check(state, s_specs, sizes, axis)
    if tx.config.offload:
      ofl.check_placed(state, s_specs, axis)
  leaves, treedef = jax.tree.flatten(extra_args or {})
  is_array = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]
  arrays = [x for x, a in zip(leaves, is_array) if a]

  def extra(arrs):
    it = iter(arrs)
    return treedef.unflatten([next(it) if a else x
                              for x, a in zip(leaves, is_array)])

  f = empty_leaves.shard_map(
      lambda g, s, p, a: update_in(g, s, p, mode, pa, extra_args=extra(a),
                                   platform=platforms.resolve(where)),
      mesh=mesh, in_specs=(g_specs, s_specs, p_specs, [P()] * len(arrays)),
      out_specs=(p_specs, s_specs), check_vma=False)
  return jax.jit(f)(grads, state, params, arrays)


def reduced_params(params: Any, mesh: jax.sharding.Mesh | None = None, *,
                   axis_name: str = "data") -> Any:
  """Places ``params`` replicated and typed ``reduced`` over ``axis_name``.

  Under ``jax.jit`` such params make ``jax.grad`` return gradients typed
  *unreduced* over the axis, and :func:`zero1_jax.zero1`'s ``update`` then
  reduce-scatters them directly (one collective per bucket, no all-reduce).
  The updates it returns are typed the same way, so the params stay so
  through ``optax.apply_updates`` / ``TrainState.apply_gradients``.

  The model must accept reduced-typed params: matmuls do; adding a reduced
  bias to activations sharded over the axis is refused by JAX
  (``ShardingTypeError``) unless the bias is broadcast with an explicit
  ``out_sharding`` (see the README). Floating scalars and arrays are placed
  reduced; other leaves plainly replicated.

  Args:
    params: a tree of arrays.
    mesh: a mesh whose ``axis_name`` is ``Explicit`` (``jax.make_mesh``'s
      default); default: the ``jax.set_mesh`` mesh.
    axis_name: the data axis.

  Returns:
    ``params`` on the mesh.

  Raises:
    ValueError: no mesh, the mesh lacks the axis or the axis is not Explicit.
  """
  if mesh is None:
    mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
      raise ValueError("zero1: reduced_params needs a mesh: pass mesh= or call "
                       "it under `with jax.set_mesh(mesh):`.")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"zero1: mesh has axes {tuple(mesh.axis_names)}, not "
                     f"'{axis_name}'; pass axis_name=<the data axis>.")
  kind = dict(zip(mesh.axis_names, mesh.axis_types))[axis_name]
  if kind != jax.sharding.AxisType.Explicit:
    raise ValueError(
        f"zero1: axis '{axis_name}' is {kind}; reduced params need an Explicit "
        f"axis: jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Explicit,"
        f" ...)).")

  def place(x):
    floating = lay.trainable(jnp.result_type(x))
    return jax.device_put(x, NamedSharding(
        mesh, _spec(x, axis_name, "reduced" if floating else None)))
  return jax.tree.map(place, params)
