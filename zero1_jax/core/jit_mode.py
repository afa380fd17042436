"""``tx.init`` / ``tx.update`` outside shard_map: plain ``jax.jit`` under a mesh.

Inside a ``shard_map`` over the data axis (``z1.train_step``, a user's own
step), :func:`zero1_jax.zero1`'s ``init`` and ``update`` run per device on
local gradients. Called anywhere else (eagerly or under ``jax.jit``, as
flax's ``TrainState`` and ``nnx.Optimizer`` call them), they land here: the
mesh with ``tx.config.axis_name`` is found (:mod:`.jit_mesh`: from
``jax.set_mesh``, the arrays' ``NamedSharding`` or ``zero1(mesh=)``), and
the same per-device code (``tx.init_from``, ``tx.apply``) runs inside a
``jax.shard_map`` over it that this module builds, which binds the axis.
``init`` returns the state sharded over the data axis exactly as
:func:`zero1_jax.init` does (:func:`zero1_jax.core.specs.state_specs`).

What ``update`` receives from ``jax.grad`` under jit decides the reduce
(:mod:`.grad_reduce`'s modes; :func:`.reduced.grads_mode` tells them apart):

* plain (replicated) params: the gradient of the global-mean loss, already
  reduced over the data axis by jit's partitioner. Mode ``REDUCED``: each
  sharded leaf that needs no padding enters the shard_map as the device's
  block (:func:`_as_blocks`; on GPU XLA sums it straight into the blocks, a
  reduce-scatter; XLA:CPU all-reduces it and slices), the others whole for
  each device to slice its shard; no division by N.
* params placed by :func:`.reduced.reduced_params` (``P(..., reduced={axis})``):
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
from jax.sharding import PartitionSpec as P

from zero1_jax.core import boxes
from zero1_jax.core import elementwise as ew
from zero1_jax.core import empty_leaves
from zero1_jax.core import jit_args
from zero1_jax.core import jit_mesh
from zero1_jax.core import layout as lay
from zero1_jax.core import offload as ofl
from zero1_jax.core import one_device
from zero1_jax.core import param_axes as pax
from zero1_jax.core import placement
from zero1_jax.core import platform as platforms
from zero1_jax.core import reduced
from zero1_jax.core import sharded_grads
from zero1_jax.core import specs as zspecs
from zero1_jax.core.grad_reduce import PARTIAL, REDUCED, SHARDS
from zero1_jax.core.sharded_grads import ShardedGrads


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
  return lambda x: field if reduced.reduced_over(x, axis, field) else None


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


def _dicts_only(params: Any) -> bool:
  """Params held in dicts and sequences only, as flax's are: the trees
  flax's readers (``nn.get_sharding``) walk, where a bare leaf reads as
  replicated. In other containers (Equinox modules, haliax's ``NamedArray``)
  a box would sit where the program expects an array: haliax places it by
  the ``NamedArray``'s axes all the same, and levanter's checkpoint skips
  it (the moments would not be saved)."""
  plain = (jax.tree_util.DictKey, jax.tree_util.SequenceKey)
  return all(isinstance(k, plain) for path, _ in
             jax.tree_util.tree_flatten_with_path(params)[0] for k in path)


def init(tx: Any, params: Any, like: Any = None) -> Any:
  """``tx.init(params)`` outside shard_map: ``tx.init_from`` (the
  per-device init) inside a shard_map over the found mesh; the state
  comes out sharded over the data axis exactly as :func:`zero1_jax.init`
  makes it (:func:`zero1_jax.core.specs.state_specs`), its sharded leaves
  wrapped as ``like``'s params are (linen boxes, nnx Variables) with
  metadata naming that placement (:func:`zero1_jax.core.boxes.box_state`).
  Refuses a non-elementwise inner optimizer like :func:`zero1_jax.init`, and
  float16 params without an explicit ``loss_scale`` (:func:`check_fp16_scale`)."""
  axis = tx.config.axis_name
  check_fp16_scale(tx, boxes.strip(params))
  mesh, where = jit_mesh.find_mesh(axis, params, fallback=tx.config.mesh,
                                   at_init=True)
  n = where.shape[axis]
  one_device.warn_if_one_device(n, axis, stacklevel=3)   # the caller of tx.init
  off = jit_mesh.off_mesh(mesh, {"params": params})
  if off:
    warnings.warn(jit_mesh.place_first(off, axis), stacklevel=3)
  like = params if like is None else like
  # ``like``: the params as given, nnx Variables included: under jit on Auto
  # axes their metadata (``out_sharding``) is what names their sharding.
  pa = jit_mesh.param_axes(tx, like, where)
  params = boxes.strip(params)
  sizes = dict(where.shape)
  shapes = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), lay.leaf_dtype(x)), params)
  local = shapes if pa is None else pa.local_tree(shapes)
  if tx.config.check_elementwise:
    ew.check_elementwise(tx.inner, local, n, tx.config.master_dtype)
  specs = zspecs.state_specs(tx, shapes, n, pa)

  # The state reads the params' shapes, not their values. Under jit without
  # jax.set_mesh the shard_map's mesh is the arguments' abstract one, and
  # XLA:CPU (jax 0.10.2-0.12) cannot compile such a shard_map that reads no
  # input ("No registered implementation for untyped custom call to
  # xla.sdy.LocalToGlobalShape"): there the state is tied to the params.
  # (Elsewhere it is not: params committed to other devices still init.)
  tie = isinstance(mesh, jax.sharding.AbstractMesh)

  def per_device(p):
    state = tx.init_from(p, p, param_axes=pa)
    return jax.lax.optimization_barrier((state, p))[0] if tie else state

  f = empty_leaves.shard_map(
      per_device, mesh=mesh,
      in_specs=(_in_specs(params, pa, axis, _typed(axis, "reduced"), sizes),),
      out_specs=specs, check_vma=False)
  state = jax.jit(f)(params)   # eager shard_map would dispatch op by op
  rules = (tx.config.logical_axis_rules or boxes.context_rules()
           or getattr(tx, "seen_rules", ()))
  # zero1(mesh=) outside jax.set_mesh: a program placing what it derives
  # from the (abstract) state's metadata, e.g. nn.get_sharding. Inside the
  # legacy `with mesh:` as well: a pjit there sets the abstract mesh, and
  # EasyLM's jax.eval_shape of the init outside it must give the state the
  # structure its pjit inside gives (its regex specs walk into the boxes).
  no_context = jax.sharding.get_abstract_mesh().empty or jit_mesh.legacy_mesh()
  bare = tx.config.mesh is not None and no_context and _dicts_only(like)
  own = mesh if no_context and isinstance(mesh, jax.sharding.Mesh) else None
  return boxes.box_state(state, specs, like, rules, sizes, axis, bare=bare,
                         mesh=own)


STATE_TREE = (
    "zero1: opt_state does not fit the params given to tx.update ({error}): "
    "tx.init made it for another params tree ({have} leaves there, {want} "
    "here). Pass tx.update the tree tx.init was given, the same leaves in "
    "the same structure (a frozen part: give init and update only the "
    "trained params, or keep it in both and mask it, e.g. "
    "optax.set_to_zero() through optax.multi_transform).")


def _check_state_tree(state: Any, specs: Any, params: Any) -> None:
  """ValueError (:data:`STATE_TREE`) where ``state`` is not the structure
  ``tx.init`` gives ``params`` (``specs``: its specs); JAX's own error
  there ("Tuple arity mismatch") named neither."""
  is_p = lambda s: isinstance(s, P)
  try:
    jax.tree.structure(specs, is_leaf=is_p).flatten_up_to(state)
  except (ValueError, TypeError) as e:
    master = getattr(state, "master", None)
    have = "?" if master is None else len(jax.tree.leaves(
        master, is_leaf=lambda x: x is None))
    want = len(jax.tree.leaves(params, is_leaf=lambda x: x is None))
    raise ValueError(STATE_TREE.format(error=str(e).split(";")[0], have=have,
                                       want=want)) from None


def _as_blocks(grads: Any, g_specs: Any, layout: lay.Layout, mesh: Any,
               where: Any, axis: str) -> tuple[Any, Any]:
  """jax.grad's reduced gradients entering ``tx.update``'s shard_map as
  each device's block, at every sharded leaf that needs no padding (the
  data axis on its shard dim, as its state has it): ``(g_specs, grads)``.
  jit's partitioner can then sum the gradient straight into the blocks, a
  reduce-scatter on GPU, where it all-reduced it whole for each device to
  slice its block (BERT-base fp32 on 8 H100s, XLA's cost model, the
  gathers in place: 11,432 µs, against 13,003 all-reduced; DDP 11,144). XLA:CPU still all-reduces and slices: the same
  sums. On an Explicit axis the leaves are resharded to their blocks."""
  specs = layout.treedef.flatten_up_to(g_specs)
  g_leaves = layout.treedef.flatten_up_to(grads)
  explicit = dict(zip(where.axis_names, where.axis_types)).get(
      axis) == jax.sharding.AxisType.Explicit
  for i, s in enumerate(layout.leaves):
    if s.kind != lay.SHARD or s.padded_shape != s.shape:
      continue
    specs[i] = zspecs.leaf_spec(s, axis)
    if explicit:
      g_leaves[i] = jax.sharding.reshard(
          g_leaves[i], specs[i] if mesh is None
          else jax.sharding.NamedSharding(mesh, specs[i]))
  return (layout.treedef.unflatten(specs),
          layout.treedef.unflatten(g_leaves))


SHARDED_2D = (
    "zero1: z1.value_and_grad's gradients on params sharded over other mesh "
    "axes (a 2-D mesh) are not supported yet: use jax.value_and_grad there "
    "(tx.update reduces its gradients).")


def update(tx: Any, grads: Any, state: Any, params: Any,
           extra_args: dict | None = None, params_given: bool = True
           ) -> tuple[Any, Any]:
  """``tx.update(grads, state, params)`` outside shard_map, on the gradients
  ``jax.grad`` returns under jit: ``tx.apply`` (the per-device update) on
  them as :mod:`.grad_reduce` says they are; ``extra_args``' arrays
  (a ``value=`` loss, traced under jit) enter the shard_map replicated (it
  cannot close over them), the rest is closed over. Updates come out typed and
  sharded like ``params`` (replicated or ``reduced`` over the axis, and
  their own sharding over other axes), so ``optax.apply_updates`` keeps the
  params' placement. ``params_given`` False: ``params`` are the gradients
  standing in for them (:mod:`.params_free`)."""
  jit_args.check()   # in_shardings giving the state P(): zero1 speaks first
  axis = tx.config.axis_name
  mesh, where = jit_mesh.find_mesh(axis, params, grads, state,
                                   fallback=tx.config.mesh)
  n = where.shape[axis]
  sizes = dict(where.shape)
  off = jit_mesh.off_mesh(mesh, {"params": params, "grads": grads})
  if off:
    raise ValueError(jit_mesh.place_first(off, axis))
  pa = jit_mesh.param_axes(tx, params, where)
  grads, state, params = boxes.strip((grads, state, params))
  layout = lay.plan(params if pa is None else pa.local_tree(params), n,
                    None if pa is None else pa.taken)
  found = sharded_grads.lookup(grads)   # z1.value_and_grad's, as returned
  groups = None
  if found is not None:
    grads, groups = ShardedGrads(found.tree), found.groups
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
    mode = reduced.grads_mode(grads, layout, axis)
    g_field = "unreduced" if mode == PARTIAL else None
    g_specs = _in_specs(grads, pa, axis, lambda _: g_field, sizes)
    if mode == REDUCED and pa is None:
      g_specs, grads = _as_blocks(grads, g_specs, layout, mesh, where, axis)
  p_specs = _in_specs(params, pa, axis, _typed(axis, "reduced"), sizes)
  s_specs = zspecs.state_specs(tx, params, n, pa)
  _check_state_tree(state, s_specs, params)
  if tx.config.check_placement:
    state = placement.check(state, s_specs, sizes, axis)
    if tx.config.offload:
      ofl.check_placed(state, s_specs, axis)
  apart = (platforms.resolve(where) == "gpu"
           and not platforms.one_host(where, tx.config.mesh))
  leaves, treedef = jax.tree.flatten(extra_args or {})
  is_array = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]
  arrays = [x for x, a in zip(leaves, is_array) if a]

  def extra(arrs):
    it = iter(arrs)
    return treedef.unflatten([next(it) if a else x
                              for x, a in zip(leaves, is_array)])

  f = empty_leaves.shard_map(
      lambda g, s, p, a: tx.apply(g, s, p, mode, param_axes=pa,
                                  extra_args=extra(a), as_updates=True,
                                  platform=platforms.resolve(where),
                                  gather_groups=groups,
                                  params_given=params_given,
                                  across_hosts=apart)[:2],
      mesh=mesh, in_specs=(g_specs, s_specs, p_specs, [P()] * len(arrays)),
      out_specs=(p_specs, s_specs), check_vma=False)
  return jax.jit(f)(grads, state, params, arrays)


