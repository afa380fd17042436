"""``init`` and ``train_step``: the shard_map wiring around :func:`zero1`.

Example:
  >>> import jax, jax.numpy as jnp, optax, zero1_jax as z1
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  >>> params, opt_state = z1.init(tx, {"w": jnp.ones(3)}, mesh)
  >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
  >>> step = z1.train_step(loss, tx, mesh)
  >>> batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros(4)}
  >>> params, opt_state, metrics = step(params, opt_state, batch)
  >>> sorted(metrics)
  ['grad_norm', 'loss', 'loss_scale', 'skipped']
  >>> float(metrics["loss"]), bool(metrics["skipped"])   # (3 - 0)^2
  (9.0, False)
  >>> [round(float(w), 4) for w in params["w"]]   # Adam's first step: -lr x sign(grad)
  [0.99, 0.99, 0.99]
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zero1_jax.core import checks as chk
from zero1_jax.core.batch import batch_size
from zero1_jax.core import collectives as col
from zero1_jax.core import elementwise as ew
from zero1_jax.core import empty_leaves
from zero1_jax.core import layout as lay
from zero1_jax.core import offload as ofl
from zero1_jax.core import inflight
from zero1_jax.core import one_device
from zero1_jax.core import order as ordering
from zero1_jax.core import param_axes as pax
from zero1_jax.core import platform as platforms
from zero1_jax.core import specs as zspecs
from zero1_jax.core import zero2
from zero1_jax.core.transform import Zero1State, Zero1Transformation


def data_size(tx: Zero1Transformation, mesh: jax.sharding.Mesh) -> int:
  """The size of ``tx``'s data axis on ``mesh``; ValueError naming the fix
  when the mesh lacks it."""
  return _axis_size(tx, mesh)


def require_zero1(tx: Any, where: str) -> None:
  """TypeError naming the fix unless ``tx`` came from :func:`zero1_jax.zero1`
  or :func:`zero1_jax.zero2` (a plain optax optimizer, or one wrapped around
  the zero1 transform, has no sharded state to build or step)."""
  if isinstance(tx, Zero1Transformation):
    return
  if isinstance(tx, optax.MultiSteps):
    fix = ("Accumulate inside instead: z1.zero1(optax.MultiSteps(opt, k), "
           "axis_name='data'), or z1.train_step(..., grad_accum_steps=k).")
    got = "optax.MultiSteps"
  else:
    fix = ("Wrap the optimizer: z1.zero1(opt, axis_name='data'); to chain "
           "more transformations, put them inside: "
           "z1.zero1(optax.chain(opt, ...), axis_name='data').")
    got = ("a plain optax GradientTransformation"
           if isinstance(tx, optax.GradientTransformation)
           else type(tx).__qualname__)
  raise TypeError(f"{where}: tx must be the transformation z1.zero1(...) or "
                  f"z1.zero2(...) returns, got {got}. {fix}")


def _axis_size(tx: Zero1Transformation, mesh: jax.sharding.Mesh,
               where: str = "zero1") -> int:
  require_zero1(tx, where)
  axis = tx.config.axis_name
  if axis not in mesh.axis_names:
    names = tuple(mesh.axis_names)
    if len(names) == 1:
      fix = (f"Build the mesh with that axis, e.g. jax.make_mesh(("
             f"{jax.device_count()},), ('{axis}',)), or pass zero1(..., "
             f"axis_name='{names[0]}')")
    else:   # 2-D: keep the other axes; name the data-parallel one
      fix = (f"Pass zero1(..., axis_name=<the data-parallel one of {names}>), "
             f"or name that axis '{axis}' when building the mesh (params "
             f"sharded over the other axes stay as they are)")
    raise ValueError(
        f"zero1: mesh has axes {names} but the optimizer shards over "
        f"'{axis}'. {fix}.")
  return mesh.shape[axis]


def _shard_map(f, mesh, in_specs, out_specs):
  # check_vma=False: every output here is replicated by construction (tiled
  # all_gather, psum/pmean) or sharded as `specs` says, so the varying-axes
  # typing adds no safety; and on jax 0.12 its rule for lax.polynomial (inside
  # erf, hence exact GELU) rejects a varying input with constant coefficients,
  # which would make ordinary models fail to trace.
  # empty_leaves: no zero-size input array (jaxlib 0.11.2 crashes on one).
  return empty_leaves.shard_map(f, mesh=mesh, in_specs=in_specs,
                                out_specs=out_specs, check_vma=False)


def _replicated(mesh, tree):
  return jax.tree.map(lambda _: P(), tree)


def param_axes(tx: Zero1Transformation, params: Any,
               mesh: jax.sharding.Mesh) -> pax.ParamAxes | None:
  """How ``params`` are sharded over ``mesh``'s axes other than the data axis
  (``tx.config.param_specs``, else the arrays' ``NamedSharding`` or Flax
  ``nn.Partitioned`` names); None when they are not."""
  _axis_size(tx, mesh)
  return pax.resolve(params, dict(mesh.shape), tx.config.axis_name,
                     tx.config.param_specs)


def param_shardings(tx: Zero1Transformation, params: Any,
                    mesh: jax.sharding.Mesh) -> Any:
  """``NamedSharding``s the params train with: replicated over the data
  axis, and as :func:`param_axes` says over the others."""
  pa = param_axes(tx, params, mesh)
  specs = (_replicated(mesh, pax.unbox(params)) if pa is None
           else pa.param_specs(pax.unbox(params)))
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def state_shardings(tx: Zero1Transformation, params: Any,
                    mesh: jax.sharding.Mesh) -> Zero1State:
  """``NamedSharding``s of ``tx``'s state for ``params`` on ``mesh`` (with
  ``offload``, the sharded leaves' memory kind is ``pinned_host``)."""
  require_zero1(tx, "z1.state_shardings")
  pa = param_axes(tx, params, mesh)
  specs = zspecs.state_specs(tx, pax.unbox(params),
                             _axis_size(tx, mesh, "z1.state_shardings"), pa)
  # With offload, the leaves sharded over the data axis in host memory.
  return ofl.state_shardings(mesh, specs, tx.config.axis_name,
                             tx.config.offload)


def stored_leaves(layout: lay.Layout) -> frozenset[int]:
  """The leaves :func:`train_step` keeps sharded between steps: those split
  over the data axis without padding (a ``jax.Array`` must divide evenly).
  The others (scalars, integers, leaves padded to split) stay replicated."""
  return frozenset(i for i, s in enumerate(layout.leaves)
                   if s.kind == lay.SHARD and s.padded_shape == s.shape)


def stored_specs(tx: Zero1Transformation, params: Any, n: int) -> Any:
  """PartitionSpecs :func:`train_step` keeps ``params`` in between steps
  (1-D meshes): each leaf of :func:`stored_leaves` over the data axis on its
  shard dim, as its optimizer state; the others replicated."""
  layout = lay.plan(params, n)
  keep = stored_leaves(layout)
  return layout.treedef.unflatten([
      zspecs.leaf_spec(s, tx.config.axis_name) if i in keep
      else P(*[None] * len(s.shape)) for i, s in enumerate(layout.leaves)])


def init(tx: Zero1Transformation, params: Any, mesh: jax.sharding.Mesh, *,
         param_dtype: Any = None) -> tuple[Any, Zero1State]:
  """Replicates ``params`` over ``mesh`` and builds the sharded state.

  No device ever holds more than its 1/N of the master copy or moments.

  Args:
    param_dtype: cast floating params to this dtype (e.g. bf16 training from
      fp32 weights) after taking the master shards from the params as given,
      so the master loses nothing to the cast. None: train them as given.

  Returns:
    ``(params, opt_state)``: params replicated over the data axis (``P()``,
    or their own sharding over other mesh axes: :func:`param_axes`),
    opt_state sharded over ``tx.config.axis_name`` as given by
    :func:`state_shardings`.

  Raises:
    ValueError: the mesh lacks the axis, or the inner optimizer is not
      elementwise.
  """
  n = _axis_size(tx, mesh, "z1.init")
  one_device.warn_if_one_device(n, tx.config.axis_name)
  pa = param_axes(tx, params, mesh)
  if pa is not None and tx.config.stage == 2:   # before anything is allocated
    raise ValueError(_NO_STAGE2_2D)
  params = pax.unbox(params)

  def cast(t):
    if param_dtype is None:
      return t
    return jax.tree.map(lambda x: x.astype(param_dtype)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, t)

  train = jax.eval_shape(cast, params)
  specs = zspecs.state_specs(tx, train, n, pa)
  local = train if pa is None else pa.local_tree(train)
  if tx.config.check_elementwise:
    ew.check_elementwise(tx.inner, local, n, tx.config.master_dtype)
  p_specs = _replicated(mesh, params) if pa is None else pa.param_specs(params)
  placed = jax.tree.map(lambda s: NamedSharding(mesh, s), p_specs,
                        is_leaf=lambda x: isinstance(x, P))
  # A fresh copy: the step donates params, and the caller keeps theirs.
  values = jax.jit(lambda t: jax.tree.map(jnp.copy, t),
                   out_shardings=placed)(params)
  make = jax.jit(_shard_map(lambda t: tx.init_from(local, t, param_axes=pa),
                            mesh, (p_specs,), specs))
  opt_state = make(values)
  if param_dtype is None:
    return values, opt_state
  return jax.jit(cast, out_shardings=placed, donate_argnums=0)(values), opt_state


def _split_batch(batch, accum: int, mesh, axis: str):
  """``(B, ...)`` -> ``(accum, B // accum, ...)`` sharded on dim 1."""
  b = batch_size(batch, accum, mesh.shape[axis])
  sharding = NamedSharding(mesh, P(None, axis))

  def split(x):
    shape = (accum, b // accum) + x.shape[1:]
    if _explicit(mesh):
      # Explicit axes: a reshape of a sharded dim must name its output sharding.
      # Host (unsharded) input comes out replicated: reshard slices locally.
      x = jax.lax.reshape(x, shape, out_sharding=sharding)
      return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x.reshape(shape), sharding)

  return jax.tree.map(split, batch)


def _explicit(mesh) -> bool:
  types = getattr(mesh, "axis_types", None) or ()
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def _local_grad_fn(loss_fn: Callable, params: Any, axis: str) -> Callable:
  """Stage 1: ``f(batch) -> (full local gradients, aux)``, unreduced."""
  grad_fn = jax.grad(loss_fn, has_aux=True, allow_int=True)
  # Differentiate w.r.t. a varying view of the replicated params: the
  # gradients stay local and unreduced (under check_vma, the gradient of an
  # invariant input would be psum'd for us); zero1 reduces them itself.
  local = jax.tree.map(
      lambda x: jax.lax.pcast(x, axis, to="varying")
      if jnp.issubdtype(x.dtype, jnp.inexact) else x, params)

  def f(batch):
    g, aux = grad_fn(local, batch)
    g = jax.tree.map(   # integer leaves: float0 -> zeros, never used
        lambda g, p: g if jnp.issubdtype(p.dtype, jnp.inexact)
        else jnp.zeros(p.shape, p.dtype), g, params)
    return g, aux

  return f


def train_step(loss_fn: Callable, tx: Zero1Transformation,
               mesh: jax.sharding.Mesh, *, grad_accum_steps: int = 1,
               has_aux: bool = False, donate: bool = True,
               shard_params: bool | str = "auto") -> Callable:
  """A jitted ZeRO-1 (or ZeRO-2) step: ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` mean loss over the batch it
      is given (or ``(loss, aux)`` with ``has_aux``).
    tx: from :func:`zero1_jax.zero1` or :func:`zero1_jax.zero2`.
    mesh: a mesh with ``tx.config.axis_name``.
    grad_accum_steps: the batch's leading axis is split into this many
      consecutive micro-batches, each split evenly over the data axis in
      device order. Stage 1: local gradients are summed over micro-batches
      and reduced once; stage 2 (:func:`zero1_jax.zero2`): each micro-batch's
      gradients are reduce-scattered in its backward pass and the 1/N shards
      summed.
    has_aux: ``aux`` is averaged over micro-batches and devices and returned
      as ``metrics["aux"]``.
    donate: donate params and opt_state (the update happens in place).
    shard_params: True: keep the params between steps as each device's
      updated shard (:func:`stored_specs`: the same values, 1/N of them per
      device) and gather them at the start of the next step, where the
      gathers run under the forward pass; False: gather them at the end of
      each step and return them replicated (the gathers then run under
      nothing). ``"auto"``: True where collectives run beside compute (GPU,
      TPU), False on CPU, which runs them in turn (nothing to gain, and the
      CPU programs stay those the tests pin). On a mesh with model axes the
      params are returned as they came.

  Returns:
    The ``jax.jit`` function (``.lower(...).compile()`` works), behind a thin
    wrapper that first moves batch arrays committed to devices outside the
    mesh (e.g. a single device) onto it, and params to where the step keeps
    them. ``metrics``:
    ``loss`` (mean over the global batch), ``grad_norm`` (global, before
    clipping), ``skipped`` (overflow: nothing changed), ``loss_scale``.
  """
  n = _axis_size(tx, mesh, "z1.train_step")
  axis = tx.config.axis_name
  accum = int(grad_accum_steps)
  if accum < 1:
    raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
  platform = platforms.resolve(mesh)
  stage2 = tx.config.stage == 2
  if shard_params == "auto":
    shard_params = platform != "cpu"
  elif shard_params not in (True, False):
    raise ValueError(f"shard_params must be True, False or 'auto', got "
                     f"{shard_params!r}")

  def local_grads(params, scale, batch, order=None):
    """This device's gradients (stage 2: its reduced shards) summed over the
    micro-batches, with the loss and aux summed likewise."""
    def scaled_loss(p, mb):
      loss, aux = chk.split_loss(loss_fn(p, mb), has_aux)
      return (loss * scale.astype(loss.dtype) / accum).astype(loss.dtype), (loss, aux)

    if stage2:
      # Each leaf's gradient is reduce-scattered as the backward produces
      # it: g holds this device's summed 1/N shards (None at static leaves).
      grad_fn = zero2.reduced_grad_fn(scaled_loss, params, tx.config, n,
                                      order, platform)
    else:
      grad_fn = _local_grad_fn(scaled_loss, params, axis)

    def micro(carry, mb):
      g, (loss, aux) = grad_fn(mb)
      if carry is None:
        return g, loss, aux
      g0, l0, a0 = carry
      return (jax.tree.map(jnp.add, g0, g), l0 + loss,
              jax.tree.map(jnp.add, a0, aux))

    first = jax.tree.map(lambda x: x[0], batch)
    if accum == 1:
      carry = micro(None, first)
    else:
      # Every micro-batch in one loop, from zeros (0 + g is g: the same sums
      # as starting from the first). A first micro-batch outside the loop
      # left a loop of one at accum=2, which XLA inlines and then runs both
      # forwards before the backwards: 1.7x the activation memory (bert-tiny,
      # 45 vs 26 MB of temporaries), and two copies of the model to compile.
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           jax.eval_shape(micro, None, first))
      carry, _ = jax.lax.scan(lambda c, mb: (micro(c, mb), None), zeros, batch)
    grads, loss, aux = carry
    metrics = {"loss": jax.lax.pmean(loss / accum, axis)}
    if has_aux:
      metrics["aux"] = jax.lax.pmean(jax.tree.map(lambda a: a / accum, aux), axis)
    return grads, metrics

  def with_info(metrics, info):
    return {"loss": metrics["loss"], "grad_norm": info.grad_norm,
            "skipped": info.skipped, "loss_scale": info.loss_scale,
            **({"aux": metrics["aux"]} if has_aux else {})}

  def read_order(params, batch):
    """The leaves in the order the loss first reads them (core/order.py);
    None (tree order) on CPU, which neither combines nor overlaps
    collectives: its programs (and their rounding, which the CPU tests pin
    bitwise) stay those of tree order."""
    if platform == "cpu":
      return None
    mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (x.shape[1] // n,) + x.shape[2:], x.dtype), batch)
    return ordering.first_reads(
        lambda p, b: chk.split_loss(loss_fn(p, b), has_aux)[0], params, mb)

  def per_device(params, opt_state: Zero1State, batch, full, order, keep):
    blocks = {}
    if keep:   # the stored shards, gathered in the order the forward reads them
      layout = lay.plan(full, n)
      leaves = jax.tree.leaves(params)
      blocks = {i: leaves[i] for i in keep}
      buckets = lay.plan_buckets(
          layout, tuple(jnp.dtype(x.dtype) for x in leaves),
          int(tx.config.gather_bucket_bytes or tx.config.bucket_bytes),
          tx.config.inplace_threshold(n, platform),
          tuple(i for i in (order or range(len(leaves))) if i in keep),
          None if order is None else "first")
      whole = col.all_gather(blocks, layout, buckets, axis)
      params = layout.treedef.unflatten(
          [whole[i] if i in keep else x for i, x in enumerate(leaves)])
    grads, metrics = local_grads(params, opt_state.loss_scale.scale, batch,
                                 order)
    new_params, new_state, info = tx.apply(
        grads, opt_state, params, pre_reduced=stage2, order=order,
        platform=platform, shards_in=blocks, shard_out=keep)
    return new_params, new_state, with_info(metrics, info)

  def step(params, opt_state, batch, pa):
    specs = zspecs.state_specs(tx, params, n, pa)
    batch = _split_batch(batch, accum, mesh, axis)
    b_specs = jax.tree.map(lambda _: P(None, axis), batch)
    rep = _replicated(mesh, params)
    if pa is None:
      full = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          params)
      keep = (stored_leaves(lay.plan(full, n)) if shard_params
              else frozenset())
      p_specs = stored_specs(tx, full, n) if keep else rep
      f = _shard_map(
          lambda p, s, b: per_device(p, s, b, full, read_order(full, batch),
                                     keep),
          mesh, (p_specs, specs, b_specs), (p_specs, specs, P()))
      return f(params, opt_state, batch)
    # Params sharded over other mesh axes too (tensor parallel): the loss
    # runs manual over the data axis only (the other axes stay with the
    # partitioner, as the model was written), each device's gradients leave
    # stacked over the data axis, and the update runs on blocks, manual over
    # every axis, so no collective over the other axes touches a block.
    grads, metrics = empty_leaves.shard_map(
        lambda p, sc, b: (lambda g, m: (
            jax.tree.map(lambda x: x[None], g), m))(*local_grads(p, sc, b)),
        mesh=mesh, in_specs=(rep, P(), b_specs), out_specs=(
            jax.tree.map(lambda _: P(axis), params), P()),
        axis_names={axis}, check_vma=False)(
            params, opt_state.loss_scale.scale, batch)
    p_specs = pa.param_specs(params)
    g_specs = jax.tree.map(lambda s: P(axis, *s), p_specs,
                           is_leaf=lambda x: isinstance(x, P))

    def update(g, s, p):
      g = jax.tree.map(lambda x: x[0], g)
      new_params, new_state, info = tx.apply(g, s, p, param_axes=pa,
                                             platform=platform)
      return new_params, new_state, with_info(metrics, info)

    f = _shard_map(update, mesh, (g_specs, specs, p_specs),
                   (p_specs, specs, P()))
    return f(grads, opt_state, params)

  def axes_of(params):
    if _stored(params):   # a previous step's output: sharded as it keeps them
      return None
    pa = param_axes(tx, params, mesh)
    if pa is not None and stage2:
      raise ValueError(_NO_STAGE2_2D)
    return pa

  def _stored(params) -> bool:
    if not shard_params:
      return False
    where = storage(params, None)
    return where is not None and any(
        s.spec != P() for s in jax.tree.leaves(where)) and all(
        _placed(x, s) for x, s in zip(jax.tree.leaves(params),
                                      jax.tree.leaves(where)))

  def storage(params, pa):
    """Where the step keeps ``params`` (NamedShardings), or None: as given."""
    if pa is not None or jax.tree.structure(
        pax.unbox(params)) != jax.tree.structure(params):   # boxed: as given
      return None
    # Replicated ones as the step returns them, P(None, ...): the same
    # program then serves the first step and the next (with P() a second
    # compile followed on an Explicit mesh).
    specs = (stored_specs(tx, params, n) if shard_params else jax.tree.map(
        lambda x: P(*[None] * jnp.ndim(x)), params))
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))

  return _OnMesh(jax.jit(step, donate_argnums=(0, 1) if donate else (),
                         static_argnums=3),
                 NamedSharding(mesh, P(axis)), accum, n, axes_of, storage)


def _placed(x, where: NamedSharding) -> bool:
  """Whether ``x`` is placed as ``where`` says: the same devices and the same
  spec (trailing Nones aside). Equivalence is not enough: on an Explicit
  mesh the spec is part of the array's type, and P() and P('data') are
  equivalent on one device."""
  s = getattr(x, "sharding", None)
  if not isinstance(s, NamedSharding) or s.mesh != where.mesh:
    return False
  strip = lambda spec: tuple(spec)[:max([i + 1 for i, a in enumerate(spec)
                                         if a is not None], default=0)]
  return strip(s.spec) == strip(where.spec)


_NO_STAGE2_2D = (
    "zero1: ZeRO-2 (zero2 / DeepSpeed stage 2) does not yet support params "
    "sharded over mesh axes other than the data axis: use zero1 (stage 1) on "
    "such a mesh, or replicate the params over the other axes.")


class _OnMesh:
  """The jitted step, first moving batch arrays that live on devices outside
  the mesh (e.g. committed to one device) onto it, split over the data axis.
  Host arrays and arrays already on the mesh pass straight through.
  ``lower``/``trace``/``eval_shape`` and the rest are the jitted function's."""

  def __init__(self, jitted, batch_sharding: NamedSharding, accum: int,
               n: int, axes_of: Callable, storage: Callable):
    self._jitted = jitted
    self._storage = storage
    self._bounded = inflight.Bounded(jitted)
    self._sharding = batch_sharding
    self._devices = set(batch_sharding.mesh.devices.flat)
    self._accum = accum
    self._n = n
    self._axes_of = axes_of

  def _place(self, batch):
    batch_size(batch, self._accum, self._n)

    def one(x):
      sharding = getattr(x, "sharding", None)
      if sharding is None or set(sharding.device_set) <= self._devices and \
          len(sharding.device_set) == len(self._devices):
        return x
      return jax.device_put(x, self._sharding)
    return jax.tree.map(one, batch)

  def _store(self, params, pa):
    """``params`` placed where the step keeps them (a local slice of
    replicated arrays: no communication), so that one compiled program
    serves the first step and the next; ShapeDtypeStructs given that
    sharding."""
    where = self._storage(params, pa)
    if where is None:
      return params

    def one(x, s):
      if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
      # Equal, spec and all: jit compiles again for P() where it returned
      # P(None,) (the same placement, another type on an Explicit mesh).
      return x if getattr(x, "sharding", None) == s else jax.device_put(x, s)
    return jax.tree.map(one, params, where)

  def __call__(self, params, opt_state, batch):
    # At most inflight.STEPS_IN_FLIGHT steps outstanding on CPU devices:
    # more deadlock XLA's CPU client (core/inflight.py).
    pa = self._axes_of(params)
    return self._bounded(self._store(params, pa), opt_state,
                         self._place(batch), pa)

  def lower(self, params, opt_state, batch):
    pa = self._axes_of(params)
    return self._jitted.lower(self._store(params, pa), opt_state,
                              self._place(batch), pa)

  def __getattr__(self, name):
    return getattr(self._jitted, name)
