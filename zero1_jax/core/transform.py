"""``zero1()``: ZeRO Stage 1 as an optax ``GradientTransformation``.

The wrapped (*inner*) optimizer runs on this device's shard of the master
weights; its moments therefore live on the same shards, so a device holds 1/N
of every moment. Weights and gradients stay whole on every device.

Master weights: a parameter already in the master dtype (fp32 params, fp32
master) *is* its own master: every device holds it whole and bitwise equal to
the last update, so its master shard is sliced from the parameter at each
step and nothing is stored (``Zero1State.master`` is None there; Adam: 8
bytes per parameter / N). Only parameters in another dtype (bf16, fp16) keep
a sharded master copy in the master dtype (12 bytes / N with Adam).

One ``update`` (inside ``shard_map`` over ``axis_name``):
  1. reduce the local gradients: ``psum_scatter`` (or ``psum`` and a slice on
     the all-reduce path), in place on each large leaf and bucketed for small
     ones (:func:`zero1_jax.core.layout.plan_buckets`);
  2. global grad norm from the shards (one scalar ``psum``): clipping and
     overflow detection both use it; averaging over N, unscaling and clipping
     fold into one scalar divisor of the sums, fused into the update;
  3. the inner optimizer updates the master shard (the stored one, or the
     parameter's own shard); an overflowing step keeps the old master and
     inner state on every device;
  4. the new master shard is cast to the parameter dtype and all-gathered.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zero1_jax.core import boxes
from zero1_jax.core import checks as chk
from zero1_jax.core import collectives as col
from zero1_jax.core import elementwise as ew
from zero1_jax.core import explicit_consts
from zero1_jax.core import fresh_state
from zero1_jax.core import jit_mode as jm
from zero1_jax.core import layout as lay
from zero1_jax.core import offload as ofl
from zero1_jax.core import optax_protocol as proto
from zero1_jax.core import precision
from zero1_jax.core import param_axes as pax
from zero1_jax.core import updates as upd
from zero1_jax.core.state import Zero1State, master_tree
from zero1_jax.core.tx_config import (MULTISTEPS_CLIP, StepInfo, Zero1Config,
                                      Zero1Transformation)


def _loss_scaler(cfg: Zero1Config, params) -> precision.LossScale:
  if cfg.loss_scale is not None:
    return cfg.loss_scale
  fp16 = any(jnp.dtype(x.dtype) == jnp.float16 for x in jax.tree.leaves(params))
  return precision.DynamicLossScale() if fp16 else precision.NoLossScale()


NEEDS_PARAMS = (
    "zero1: update needs params: tx.update(grads, state, params). A "
    "parameter already in its master dtype (float32 params) is its own "
    "master, so the state keeps no copy of it; each step slices this "
    "device's shard from params.")


def _arrays(tree: Any) -> Any:
  """Python scalar leaves (float, int, complex, bool) as jnp arrays, as
  optax's init and update make them; other leaves as they are."""
  return jax.tree.map(lambda x: jnp.asarray(x) if isinstance(
      x, (bool, int, float, complex)) else x, tree)


def _sum_sq(v) -> jax.Array:
  """Sum of ``|v|^2`` in float32 (complex: re^2 + im^2, as optax's norms)."""
  if jnp.iscomplexobj(v):
    v = v.astype(jnp.complex64)
    return jnp.sum(jnp.square(jnp.real(v)) + jnp.square(jnp.imag(v)))
  return jnp.sum(jnp.square(v.astype(jnp.float32)))


def _masters_to_host(values: list, layout: lay.Layout) -> list:
  """Offload: the sharded leaves' master values moved to host memory
  (those not stored are dropped by ``master_tree`` anyway)."""
  return [ofl.to_host(v) if v is not None and ofl.on_host(layout, i) else v
          for i, v in enumerate(values)]


def _axis_size(axis_name: str) -> int:
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"zero1: axis '{axis_name}' is not bound. tx.init / tx.update must run "
        f"inside shard_map over a mesh with axis '{axis_name}' (use "
        f"z1.init(tx, params, mesh) and z1.train_step, or pass "
        f"axis_name=<your data axis> to zero1).") from e


def zero1(inner: optax.GradientTransformation, *, axis_name: str,
          reduce: str = "reduce_scatter", bucket_bytes: int = 1 << 26,
          gather_bucket_bytes: int | None = None,
          master_dtype: Any = jnp.float32, max_grad_norm: float | None = None,
          loss_scale: precision.LossScale | None = None,
          reduce_dtype: Any = None, check_elementwise: bool = True,
          clip_rule: str = "optax",
          inplace_bytes: int | None | str = "auto",
          param_specs: Any = None, mesh: Any = None,
          logical_axis_rules: Any = None,
          check_placement: bool = True,
          offload: bool | str | None = False) -> Zero1Transformation:
  """Shards ``inner``'s state and the master weights over ``axis_name``.

  Args:
    inner: an *elementwise* optax transformation (adam, adamw, lion, sgd,
      rmsprop, adagrad, chains with schedules, ``inject_hyperparams``).
      Transformations that need whole leaves or the whole tree (adafactor,
      lamb, ``clip_by_global_norm``) are refused by :func:`zero1_jax.init`.
    axis_name: the data-parallel mesh axis.
    reduce: ``"reduce_scatter"`` (each device receives only its shard) or
      ``"all_reduce"`` (``psum`` then slice; DeepSpeed's
      ``reduce_scatter: false``).
    bucket_bytes: most bytes one reduce collective moves (all N pieces).
    gather_bucket_bytes: the same for the all-gather (default: bucket_bytes).
    master_dtype: dtype of the master weights and of the gradient arithmetic
      (float32), never narrower than a parameter: float64 params keep a
      float64 master, complex ones a complex master of at least this
      precision (:func:`zero1_jax.core.layout.master_dtype`). Parameters in
      another dtype (bf16, fp16) keep a sharded master copy; parameters
      already in their master dtype are their own master (no copy).
    max_grad_norm: clip by the exact global norm (optax semantics), or None.
    loss_scale: a :mod:`zero1_jax.core.precision` policy. None: dynamic
      (DeepSpeed defaults) when any parameter is float16, otherwise none.
      With float16 params in plain ``jax.jit`` code, where you compute the
      gradients, ``tx.init`` requires it to be given (you multiply the loss
      by ``z1.loss_scale(opt_state)``, or pass ``z1.NoLossScale()``).
    reduce_dtype: dtype gradients travel in (default: their own dtype).
    check_elementwise: at init, refuse ``inner`` unless it is elementwise
      (:func:`zero1_jax.core.elementwise.check_elementwise`: its jaxpr, then a
      numeric probe on the real shard dims).
    clip_rule: how ``max_grad_norm`` clips: ``"optax"`` (as
      ``optax.clip_by_global_norm``: ``g * c / norm`` when ``norm >= c``) or
      ``"deepspeed"`` (ZeRO-1/2's ``g / max(1, (norm + 1e-6) / c)``).
    inplace_bytes: a leaf of at least this many bytes (all N pieces) is
      reduced and gathered in place, one collective on the leaf itself, with
      no bucket copy; smaller leaves are packed into buckets of
      ``bucket_bytes``. None: pack every leaf. ``"auto"``: 64 KiB on GPU/TPU
      and for stage 2, None for stage 1 on CPU
      (:meth:`Zero1Config.inplace_threshold` says why).
    param_specs: a tree of ``PartitionSpec`` like the params, naming the mesh
      axes other than ``axis_name`` each parameter is sharded over (tensor
      parallelism on a 2-D mesh, :mod:`zero1_jax.core.param_axes`). Only
      needed where the params do not say it themselves: :func:`zero1_jax.init`,
      :func:`zero1_jax.train_step` and plain ``jax.jit`` code read it from the
      arrays' ``NamedSharding``; your own ``shard_map`` over both axes needs it.
    mesh: plain-jit mode's mesh where no ``jax.set_mesh`` is active and no
      argument is placed on one (``jax.eval_shape(init)`` before the mesh is
      set).
    logical_axis_rules: the ``(logical name, mesh axes)`` rules for params
      boxed by ``nn.with_logical_partitioning`` (default: the box's own,
      then the ``nn.logical_axis_rules`` context ``tx.init`` runs under).
    check_placement: in plain-jit mode, warn when the state handed to
      ``update`` is placed other than zero1 planned (e.g. replicated by
      shardings derived from the params), with the bytes per device
      (:mod:`zero1_jax.core.placement`).
    offload: True: the state sharded over the data axis (master shards,
      moments) lives in pinned host memory between steps and is streamed
      through the device one group of ``bucket_bytes`` at a time for the
      update (DeepSpeed's ``offload_optimizer``; :mod:`zero1_jax.core.offload`).
      Weights are bitwise those of ``offload=False``.

  Returns:
    A :class:`Zero1Transformation` (an
    ``optax.GradientTransformationExtraArgs``: extra keyword arguments of
    ``update`` go to the inner optimizer where it takes them). Its
    ``update(grads, state, params)`` takes this device's local, unreduced
    gradients inside shard_map and returns full updates in the params'
    dtypes, as optax does (:mod:`zero1_jax.core.updates`): where a param is
    its own master (fp32 params, float64, complex) ``updates`` is the inner
    optimizer's ``u``, gathered from the shards, and
    ``optax.apply_updates(params, updates)`` rounds ``params + u`` once;
    for bf16/fp16 params (a stored fp32 master) ``updates`` is
    ``new - params`` in the param dtype, where ``new`` is the fp32 master
    after the step cast down, not the inner ``u`` (an fp32 step of the
    master, which a 16-bit param cannot hold), so ``apply_updates`` gives
    the cast master, exactly wherever a step at most doubles or halves a
    weight. (``tx.apply``, which :func:`zero1_jax.train_step` uses, adds
    ``u`` inside its own program, where XLA may fuse the last multiply and
    the add into one rounding: its fp32 weights can differ from
    ``apply_updates(params, updates)``'s by one rounding of the weight.)
    Outside shard_map (plain ``jax.jit`` or eager, under ``jax.set_mesh`` or
    on arrays placed on a mesh), ``init`` and ``update`` run through
    :mod:`zero1_jax.core.jit_mode` and take the gradients ``jax.grad``
    returns there.

  Example:
    >>> import optax, zero1_jax as z1
    >>> tx = z1.zero1(optax.adamw(1e-3), axis_name="data", reduce="all_reduce",
    ...               max_grad_norm=1.0)
    >>> tx.config.reduce, tx.config.max_grad_norm, tx.config.clip_rule
    ('all_reduce', 1.0, 'optax')
  """
  cfg = Zero1Config(axis_name, reduce, bucket_bytes, gather_bucket_bytes,
                    master_dtype, max_grad_norm, loss_scale, reduce_dtype,
                    check_elementwise, clip_rule, inplace_bytes,
                    param_specs=param_specs, mesh=mesh,
                    logical_axis_rules=logical_axis_rules,
                    check_placement=check_placement,
                    offload=ofl.resolve(offload))
  if max_grad_norm is not None and isinstance(inner, optax.MultiSteps):
    warnings.warn(MULTISTEPS_CLIP, UserWarning, stacklevel=2)
  # Arrays on an Explicit mesh, which shard_map cannot close over.
  inner = explicit_consts.movable(inner)
  axis = axis_name

  def axes_of(params, param_axes):
    """The params' non-data sharding inside shard_map: given by the caller
    (init / train_step / jit mode), else from ``param_specs``, else none."""
    if param_axes is not None or cfg.param_specs is None:
      return param_axes
    return pax.resolve(params, pax.bound_sizes(cfg.param_specs, axis), axis,
                       cfg.param_specs, blocks=True)

  def mdt(spec):   # this leaf's master dtype (layout.master_dtype)
    return lay.master_dtype(spec.dtype, cfg.master_dtype)

  def layout_of(params, param_axes):
    return lay.plan(params, _axis_size(axis),
                    None if param_axes is None else param_axes.taken)

  def init_from(params, values, param_axes=None) -> Zero1State:
    layout = layout_of(params, axes_of(params, param_axes))
    shards = []
    for x, spec in zip(chk.check_tree("values", values, layout), layout.leaves):
      if spec.kind == lay.SHARD:
        x = col.local_shard(x, spec, axis)
      shards.append(None if spec.kind == lay.STATIC
                    else jnp.asarray(x).astype(mdt(spec)))
    inner_state = inner.init(layout.inner_tree(shards))
    if cfg.offload:   # what is sharded over the data axis, to host memory
      inner_state = ofl.place_state(
          inner_state, ofl.owners(inner, layout, cfg.master_dtype), layout)
      shards = _masters_to_host(shards, layout)
    return Zero1State(master_tree(layout, cfg.master_dtype, shards),
                      inner_state, _loss_scaler(cfg, params).init())

  def init_fn(params) -> Zero1State:
    if proto.is_placeholder(params):   # optax.tree_utils.tree_map_params
      return proto.placeholder_state(
          inner, (cfg.loss_scale or precision.NoLossScale()).init())
    like = params
    # The state holds bare arrays; Python scalars become arrays, as optax's
    # init makes them (jnp.zeros_like(1.0) is a float32 scalar).
    params = _arrays(pax.strip_variables(params))
    if not jm.axis_bound(axis):   # plain jit / eager under a mesh
      # Sharded leaves come back wrapped like the params (boxes, Variables)
      # with metadata naming zero1's placement (core/boxes.py).
      return jm.init(tx, lambda p, pa: init_from(p, p, param_axes=pa), params,
                     like=like)
    return init_from(params, params)

  def apply_fn(grads, state: Zero1State, params, grads_are: str = jm.LOCAL,
               *, pre_reduced: bool = False, param_axes=None,
               extra_args: dict | None = None, as_updates: bool = False,
               order=None, platform: str | None = None, shards_in=None,
               shard_out=()):
    """``order``: the leaves in the order the loss first reads them
    (:mod:`zero1_jax.core.order`; reduced in reverse, gathered in it);
    ``platform``: the mesh's ('gpu', 'cpu', ...) for ``inplace_bytes="auto"``;
    ``shards_in``: {leaf: this device's shard} of leaves stored sharded, read
    as their master where none is stored; ``shard_out``: leaves returned as
    this device's new shard (in the param dtype) instead of gathered."""
    if grads_are == jm.SHARDS:   # z1.value_and_grad's: reduced in the backward
      grads_are, pre_reduced = jm.LOCAL, True
    pa = axes_of(params, param_axes)
    layout = layout_of(params, pa)
    n = layout.num_shards
    p_leaves = jax.tree.leaves(params)
    if cfg.check_elementwise:   # with the extra arguments init could not know
      ew.check_update_args(inner, params, n, cfg.master_dtype,
                           extra_args or {})
    g_leaves = (chk.check_shards(grads, layout) if pre_reduced
                else chk.check_tree("grads", grads, layout))
    if grads_are == jm.LOCAL and not pre_reduced:
      chk.check_local_grads(grads, axis)
    scaler = _loss_scaler(cfg, params)
    comm = [jnp.dtype(cfg.reduce_dtype or g.dtype) for g in g_leaves]
    # tx.config, not cfg: zero2() sets the stage after this closure was made.
    small = tx.config.inplace_threshold(n, platform)
    fwd = tuple(range(len(p_leaves))) if order is None else tuple(order)
    r_buckets = lay.plan_buckets(
        layout, tuple(comm), int(cfg.bucket_bytes), small,
        *((None, None) if order is None else (fwd[::-1], "last")))
    g_buckets = lay.plan_buckets(
        layout, tuple(jnp.dtype(p.dtype) for p in p_leaves),
        int(cfg.gather_bucket_bytes or cfg.bucket_bytes), small,
        tuple(i for i in fwd if i not in shard_out))

    # 1. Reduce (unless stage 2's backward did: pre_reduced); the sums stay
    # as they arrive (in the master dtype) and the average, unscale and clip
    # become one scalar divisor applied in step 3, where XLA fuses it into
    # the inner update. Norm and update both reading one divided tree would
    # make XLA write that tree out (it does not duplicate divides into two
    # consumers). A divide, not a multiply by the reciprocal: bitwise what
    # optax computes from pmean'd gradients.
    packed = []
    all_reduce = cfg.reduce == "all_reduce"
    if pre_reduced:   # stage 2: summed shards (zero2.py), still / N
      reduced = {i: g_leaves[i] for i in layout.indices(lay.SHARD)
                 + layout.indices(lay.REPLICATE)}
      # fp16 travelled divided by N (collectives.predivides): back to sums.
      reduced = {i: col.restore_sum(v, n) if col.predivides(v.dtype, all_reduce)
                 else v for i, v in reduced.items()}
    elif grads_are == jm.REDUCED:   # jit already summed them: no collective
      reduced = jm.local_shards(g_leaves, layout, axis)
    else:
      # fp16 device gradients travel divided by N (collectives.predivides);
      # jit's unreduced pieces (PARTIAL) sum to the mean already.
      pre = grads_are == jm.LOCAL
      reduced, packed = col.reduce_scatter(g_leaves, layout, r_buckets, axis,
                                           all_reduce=all_reduce,
                                           predivide_fp16=pre)
      reduced.update(col.psum_replicated(g_leaves, layout, axis,
                                         all_reduce=all_reduce,
                                         predivide_fp16=pre))
    r = {i: v.astype(mdt(layout.leaves[i])) for i, v in reduced.items()}
    scale = state.loss_scale.scale
    # jit's gradients are of the global mean loss already: no 1/N there.
    denom = (scale * (n if grads_are == jm.LOCAL else 1)).astype(jnp.float32)

    # 2. Global norm of the averaged gradient: shards are disjoint, replicated
    # leaves count once; on a 2-D mesh each block once (param_axes).
    # A packed bucket's sum of squares is read from the bucket in one pass
    # (its padding is zero); per leaf, XLA:CPU would first copy every leaf's
    # slice out of it (its reductions do not fuse a slice in).
    sq = _sum_sq
    groups: dict[tuple, Any] = {}
    done: set[int] = set()
    if pa is None:
      for buf, leaves in packed:
        groups[(axis,)] = groups.get((axis,), jnp.float32(0)) + sq(buf)
        done.update(leaves)
    for i in sorted(set(r) - done):
      v, spec = r[i], layout.leaves[i]
      over = (pa.norm_axes(i, spec) if pa is not None
              else (axis,) if spec.kind == lay.SHARD else ())
      groups[over] = groups.get(over, jnp.float32(0)) + sq(v)
    g_norm = jnp.sqrt(sum((jax.lax.psum(v, over) if over else v
                           for over, v in sorted(groups.items())),
                          jnp.float32(0))) / denom
    if cfg.max_grad_norm is not None and cfg.clip_rule == "deepspeed":
      # runtime/zero/stage_1_and_2.py: clip = max(1, (norm + 1e-6) / c); the
      # gradients are divided by clip x loss scale.
      coef = jnp.maximum(jnp.float32(1), (g_norm + jnp.float32(1e-6))
                         / jnp.float32(cfg.max_grad_norm))
      denom = denom * coef
    elif cfg.max_grad_norm is not None:
      # optax.clip_by_global_norm: g / norm * c once norm >= c.
      denom = jnp.where(g_norm < cfg.max_grad_norm, denom,
                        denom * (g_norm / jnp.float32(cfg.max_grad_norm)))
    g = {i: v / denom.astype(jnp.finfo(v.dtype).dtype) for i, v in r.items()}
    skipped = (~jnp.isfinite(g_norm) if scaler.skips_on_overflow
               else jnp.bool_(False))

    # 3. Inner update on the master shards: the stored ones, and for params
    # already in the master dtype their own shard (bitwise the master).
    stored = chk.check_master(state, layout, cfg.master_dtype)
    view = []
    for i, (m, p, spec) in enumerate(zip(stored, p_leaves, layout.leaves)):
      if m is None and spec.kind == lay.SHARD and shards_in and i in shards_in:
        m = shards_in[i]
      elif m is None and spec.kind == lay.SHARD:
        m = col.local_shard(p, spec, axis)
      elif m is None and spec.kind == lay.REPLICATE:
        m = p
      view.append(m)
    g_list = [g.get(i) for i in range(len(layout.leaves))]

    def inner_step(g_list, inner_state, view):
      view = layout.inner_tree(view)
      g_tree = layout.inner_tree(g_list)
      if extra_args:   # forwarded where the inner update takes them
        updates, new_inner = optax.with_extra_args_support(inner).update(
            g_tree, inner_state, view, **extra_args)
      else:
        updates, new_inner = inner.update(g_tree, inner_state, view)
      new_view = optax.apply_updates(view, updates)
      if scaler.skips_on_overflow:
        keep = lambda old, new: jax.tree.map(
            lambda a, b: jnp.where(skipped, a, b), old, new)
        new_view = keep(view, new_view)
        new_inner = keep(inner_state, new_inner)
        updates = upd.zero_where(skipped, updates)
      u = jax.tree.map(lambda _, x: x, view, updates)   # view's structure
      # (new master, u) per leaf: offload's streaming carries them as one.
      return list(zip(chk.leaves_with_none(new_view),
                      chk.leaves_with_none(u))), new_inner

    if cfg.offload:   # one group of host-resident state at a time
      pairs, new_inner = ofl.streamed(
          inner_step, layout, ofl.owners(inner, layout, cfg.master_dtype),
          g_list, state.inner, view, [m is not None for m in stored],
          int(cfg.bucket_bytes))
    else:
      pairs, new_inner = inner_step(g_list, state.inner, view)
    m_leaves = [m for m, _ in pairs]
    kept = _masters_to_host(m_leaves, layout) if cfg.offload else m_leaves
    new_state = Zero1State(master_tree(layout, cfg.master_dtype, kept),
                           new_inner, scaler.update(state.loss_scale, skipped))

    # 4. Gather the new weights in the parameter dtype; as_updates (tx.update):
    # optax's u instead where the param is its own master (core/updates.py).
    # One param-dtype array per leaf either way; those in shard_out stay this
    # device's shard (g_buckets leave them out: the next step gathers them).
    own_u = {i for i, ((_, u), p, spec) in enumerate(zip(pairs, p_leaves,
                                                        layout.leaves))
             if as_updates and u is not None
             and upd.gathers_u(spec, p.dtype, jnp.result_type(u),
                               cfg.master_dtype)}
    out = [(pairs[i][1] if i in own_u else m).astype(p.dtype)
           if spec.kind != lay.STATIC else p
           for i, (m, p, spec) in enumerate(zip(m_leaves, p_leaves,
                                                layout.leaves))]
    full = col.all_gather({i: out[i] for i in layout.indices(lay.SHARD)},
                          layout, g_buckets, axis)
    out = [full.get(i, v) for i, v in enumerate(out)]
    if as_updates:
      out = [v if i in own_u else upd.difference(v, p)
             for i, (v, p) in enumerate(zip(out, p_leaves))]
    return (layout.treedef.unflatten(out), new_state,
            StepInfo(g_norm, skipped, scale))

  def update_fn(updates=None, state=None, params=None, **extra_args):
    grads, extra_args = proto.updates_arg(updates, extra_args)
    if params is None:
      raise ValueError(NEEDS_PARAMS)
    if state is None:   # a stateless inner, as optax's tests update it
      proto.check_none_state(inner, pax.strip_variables(params),
                             cfg.loss_scale)
      state = init_fn(params)
    step = fresh_state.owner_step(tx)   # a TrainState's, an nnx.Optimizer's
    if step is not None:
      fresh_state.warn_if_new(boxes.strip(state), step)
    like = params
    grads = _arrays(pax.strip_variables(grads))
    params = _arrays(pax.strip_variables(params))
    if not jm.axis_bound(axis):   # plain jit / eager under a mesh
      updates, new_state = jm.update(tx, update_as, grads, state, params,
                                     extra_args)
      new_state = boxes.rebox(state, new_state)
    else:
      updates, new_state = update_as(grads, state, params, jm.LOCAL,
                                     extra_args=extra_args)
    return boxes.rebox(like, updates), new_state

  def update_as(grads, state, params, grads_are, param_axes=None,
                extra_args=None, platform=None):
    updates, new_state, _ = apply_fn(grads, state, params, grads_are,
                                     param_axes=param_axes,
                                     extra_args=extra_args, as_updates=True,
                                     platform=platform)
    return updates, new_state

  tx = Zero1Transformation(init_fn, update_fn)
  tx.config = cfg
  # jit mode: param tree -> the non-data sharding tx.init read from concrete
  # arrays, for updates traced on Auto axes (core/jit_mode.py).
  tx.seen_param_axes = {}
  tx.inner = inner
  tx.apply = apply_fn
  tx.init_from = init_from
  tx.loss_scaler = lambda params: _loss_scaler(cfg, params)
  return tx


def loss_scale(state: Zero1State) -> jax.Array:
  """The factor to multiply the loss by before differentiating (fp16)."""
  return state.loss_scale.scale
