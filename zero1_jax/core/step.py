"""``init`` and ``train_step``: the shard_map wiring around :func:`zero1`.

One step (:func:`train_step`) on each device, inside one ``shard_map`` over
the data axis: the stored param shards gathered (``shard_params``,
:mod:`.param_storage`), the loss's gradients on this device's rows summed
over the micro-batches (:mod:`.local_grads`; stage 2: each leaf
reduce-scattered in the backward, :mod:`.zero2`), then ``tx.apply``
(:mod:`.apply`: reduce, norm, inner update, gather). On a mesh with model
axes, two regions (:func:`_step_2d`). The returned function places its
arguments first (:mod:`.on_mesh`).

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

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from zero1_jax.core import aux as aux_
from zero1_jax.core import checks as chk
from zero1_jax.core import elementwise as ew
from zero1_jax.core import empty_leaves
from zero1_jax.core import layout as lay
from zero1_jax.core import local_grads as lg
from zero1_jax.core import lookup
from zero1_jax.core import narrow as narrowing
from zero1_jax.core import one_device
from zero1_jax.core import order as ordering
from zero1_jax.core import param_axes as pax
from zero1_jax.core import platform as platforms
from zero1_jax.core import precision
from zero1_jax.core import shardings as zsh
from zero1_jax.core import specs as zspecs
from zero1_jax.core.on_mesh import OnMesh
from zero1_jax.core.param_storage import Storage, stored_leaves, stored_specs
from zero1_jax.core.state import Zero1State
from zero1_jax.core.tx_config import Zero1Transformation


def _shard_map(f, mesh, in_specs, out_specs):
  # check_vma=False: every output here is replicated by construction (tiled
  # all_gather, psum/pmean) or sharded as `specs` says, so the varying-axes
  # typing adds no safety; and on jax 0.12 its rule for lax.polynomial (inside
  # erf, hence exact GELU) rejects a varying input with constant coefficients,
  # which would make ordinary models fail to trace.
  # empty_leaves: no zero-size input array (jaxlib 0.11.2 crashes on one).
  return empty_leaves.shard_map(f, mesh=mesh, in_specs=in_specs,
                                out_specs=out_specs, check_vma=False)


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
    or their own sharding over other mesh axes: :func:`.shardings.param_axes`),
    opt_state sharded over ``tx.config.axis_name`` as given by
    :func:`zero1_jax.state_shardings`.

  Raises:
    ValueError: the mesh lacks the axis, or the inner optimizer is not
      elementwise.
  """
  n = zsh.axis_size(tx, mesh, "z1.init")
  one_device.warn_if_one_device(n, tx.config.axis_name)
  pa = zsh.param_axes(tx, params, mesh)
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
  p_specs = zsh.replicated(params) if pa is None else pa.param_specs(params)
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


def train_step(loss_fn: Callable, tx: Zero1Transformation,
               mesh: jax.sharding.Mesh, *, grad_accum_steps: int = 1,
               has_aux: bool = False, donate: bool = True,
               shard_params: bool | str = "auto",
               shard_lookups: bool | str = "auto",
               aux_reduce: str = aux_.MEAN) -> Callable:
  """A jitted ZeRO-1 (or ZeRO-2) step: ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` mean loss over the batch it
      is given (or ``(loss, aux)`` with ``has_aux``).
    tx: from :func:`zero1_jax.zero1` or :func:`zero1_jax.zero2`.
    mesh: a mesh with ``tx.config.axis_name``.
    grad_accum_steps: the batch's leading axis is split evenly over the data
      axis in device order, and each device's rows into this many
      consecutive micro-batches (as DeepSpeed's ranks accumulate their own
      rows; no row leaves its device). Stage 1: local gradients are summed over micro-batches
      and reduced once; stage 2 (:func:`zero1_jax.zero2`): each micro-batch's
      gradients are reduce-scattered in its backward pass and the 1/N shards
      summed.
    has_aux: ``aux`` is reduced over micro-batches and devices by
      ``aux_reduce`` and returned as ``metrics["aux"]``; a leaf with one
      row per example is refused (:mod:`.aux`).
    donate: donate params and opt_state (the update happens in place).
    shard_params: True: keep the params between steps as each device's
      updated shard (:func:`.param_storage.stored_specs`: the same values,
      1/N of them per device) and gather them at the start of the next step, where the
      gathers run under the forward pass; False: gather them at the end of
      each step and return them replicated (the gathers then run under
      nothing). A stored leaf the loss reads only cast to a narrower
      dtype (fp32 params computing in bf16) is gathered in that dtype and
      widened back (:mod:`.narrow`): the values the loss's cast makes, for
      half the bytes. ``"auto"``: True where collectives run beside compute (GPU,
      TPU), False on CPU, which runs them in turn (nothing to gain, and the
      CPU programs stay those the tests pin). On a mesh with model axes the
      params are returned as they came.
    shard_lookups: with ``shard_params``, a 2-D leaf stored split on its
      columns that the loss reads by rows (an embedding, ``table[ids]``)
      serves those lookups from each device's block (:mod:`.lookup`): its
      gather is then needed only by other reads (a tied output layer), and
      the lookups' gradient arrives reduced, with no reduce-scatter at the
      end of the backward. The same rows; that gradient's sum in another
      order. ``"auto"``: as ``shard_params`` resolves, where the mesh's
      devices are on one host (across hosts the rows' all-to-all crosses
      the network to every peer).
    aux_reduce: ``"mean"`` (a mean over the batch, as the loss) or
      ``"sum"`` (a sum or a count over the batch).

  Returns:
    The ``jax.jit`` function (``.lower(...).compile()`` works), behind a thin
    wrapper that first moves batch arrays committed to devices outside the
    mesh (e.g. a single device) onto it, and params to where the step keeps
    them. ``metrics``:
    ``loss`` (mean over the global batch), ``grad_norm`` (global, before
    clipping), ``skipped`` (overflow: nothing changed), ``loss_scale``.
  """
  s = _settings(loss_fn, tx, mesh, grad_accum_steps, has_aux, shard_params,
                shard_lookups, aux_reduce)
  storage = Storage(tx, mesh, s.n, s.shard_params)

  def step(params, opt_state, batch, pa):
    if s.has_aux:
      aux_.check_step(lambda p, b: chk.split_loss(s.loss_fn(p, b), True)[1],
                      params, batch, s.n * s.accum, s.aux_reduce)
    if pa is None:
      return _step_1d(s, storage, params, opt_state, batch)
    return _step_2d(s, params, opt_state, batch, pa)

  def axes_of(params):
    if storage.holds(params):   # a previous step's output: sharded as kept
      return None
    pa = zsh.param_axes(tx, params, mesh)
    if pa is not None and s.stage2:
      raise ValueError(_NO_STAGE2_2D)
    return pa

  return OnMesh(jax.jit(step, donate_argnums=(0, 1) if donate else (),
                        static_argnums=3),
                NamedSharding(mesh, P(s.axis)), s.accum, s.n, axes_of,
                storage.where)


class _Settings(NamedTuple):
  """One :func:`train_step`'s settings, checked (:func:`_settings`)."""

  loss_fn: Callable
  tx: Zero1Transformation
  mesh: jax.sharding.Mesh
  n: int               # devices on the data axis
  axis: str            # the data axis
  accum: int           # micro-batches a step
  has_aux: bool
  platform: str        # the mesh's devices' ('cpu', 'gpu', 'tpu')
  stage2: bool         # a stage-2 transformation (zero2)
  hooks: bool          # the backward's hooks reduce-scatter the gradients
  shard_params: bool   # params kept as shards between steps
  lookups: bool        # row lookups of stored tables read their blocks
  across_hosts: bool   # the data axis spans several GPU hosts
  aux_reduce: str      # 'mean' or 'sum' over micro-batches and devices


def _settings(loss_fn, tx, mesh, grad_accum_steps, has_aux,
              shard_params, shard_lookups="auto", aux_reduce=aux_.MEAN) -> _Settings:
  n = zsh.axis_size(tx, mesh, "z1.train_step")
  accum = int(grad_accum_steps)
  if accum < 1:
    raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
  platform = platforms.resolve(mesh)
  if shard_params == "auto":
    shard_params = platform != "cpu"
  elif shard_params not in (True, False):
    raise ValueError(f"shard_params must be True, False or 'auto', got "
                     f"{shard_params!r}")
  stage2 = tx.config.stage == 2
  if shard_lookups == "auto":
    # Across hosts the lookup's all-to-all reaches every peer over the
    # network: on 64 H100s (8 hosts, XLA's cost model) it left 4.4 ms
    # exposed in BERT-base's step, more than the gather it saves.
    shard_lookups = shard_params and platforms.one_host(mesh)
  elif shard_lookups not in (True, False):
    raise ValueError(f"shard_lookups must be True, False or 'auto', got "
                     f"{shard_lookups!r}")
  elif shard_lookups and not shard_params:
    raise ValueError("shard_lookups=True reads row lookups from the params' "
                     "stored shards: it needs shard_params=True")
  # zero2's hooks where a gradient outlives its backward (the micro-batches'
  # sum), and off GPUs (what follows is measured there only). With one
  # micro-batch on GPUs no gradient does, and stage 1 reduce-scatters each
  # leaf in place in the backward's order. BERT-base and GPT-2 on 8 to 64
  # H100s (XLA's compile): the peak at most 3.5 MiB higher than the hooks',
  # in 7 of 24 cases 2-23 MiB lower; XLA ran the hooks' reduce-scatters
  # late, and across hosts zero2 was up to 1.04 x DDP's step (its cost
  # model, fp32 params computing in bf16), with stage 1's plan 0.85-0.93
  # (docs/gpu.md).
  hooks = stage2 and (accum > 1 or platform != "gpu")
  return _Settings(loss_fn, tx, mesh, n, tx.config.axis_name, accum, has_aux,
                   platform, stage2, hooks, shard_params, shard_lookups,
                   platform == "gpu" and not platforms.one_host(mesh),
                   aux_.check_reduce(aux_reduce, functions=False))


def _with_info(s: _Settings, metrics, info):
  return {"loss": metrics["loss"], "grad_norm": info.grad_norm,
          "skipped": info.skipped, "loss_scale": info.loss_scale,
          **({"aux": metrics["aux"]} if s.has_aux else {})}


def _read_order(s: _Settings, params, batch, lookups=frozenset()):
  """The leaves in the order the loss first reads them (core/order.py);
  None (tree order) on CPU, which neither combines nor overlaps
  collectives: its programs (and their rounding, which the CPU tests pin
  bitwise) stay those of tree order."""
  if s.platform == "cpu":
    return None
  mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (x.shape[1] // s.n,) + x.shape[2:], x.dtype), batch)
  return ordering.first_reads(
      lambda p, b: chk.split_loss(s.loss_fn(p, b), s.has_aux)[0], params, mb,
      lookups=lookups)


def _lookups(s: _Settings, params, batch, keep) -> frozenset[int]:
  """The stored leaves whose row lookups read their blocks (:mod:`.lookup`):
  2-D, split on the columns, not fp16 (whose sums travel pre-divided)."""
  if not s.lookups:
    return frozenset()
  layout = lay.plan(params, s.n)
  candidates = [i for i in keep if layout.leaves[i].dim == 1
                and len(layout.leaves[i].shape) == 2
                and layout.leaves[i].dtype != jnp.float16]
  if not candidates:
    return frozenset()
  mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (x.shape[1] // s.n,) + x.shape[2:], x.dtype), batch)
  return lookup.find(lambda p, b: chk.split_loss(s.loss_fn(p, b),
                                                 s.has_aux)[0],
                     params, mb, candidates=candidates)


def _narrow(s: _Settings, params, batch, keep, lookups) -> dict:
  """{stored leaf: dtype} the loss reads only cast to that narrower dtype
  (:mod:`.narrow`): their gathers travel in it."""
  if not keep:
    return {}
  mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (x.shape[1] // s.n,) + x.shape[2:], x.dtype), batch)
  return narrowing.narrow_reads(
      lambda p, b: chk.split_loss(s.loss_fn(p, b), s.has_aux)[0], params, mb,
      candidates=keep, lookups=lookups)


def _per_device(s: _Settings, storage: Storage, params,
                opt_state: Zero1State, batch, full, keep, lookups, order,
                narrow=None):
  """One step on one device (1-D mesh): stored shards gathered (``narrow``
  ones in the dtype the loss reads them in), local gradients (row lookups
  of stored tables from their blocks), ``tx.apply`` (the ``keep`` leaves
  returned as shards)."""
  blocks = {}
  if keep:   # the stored shards, gathered in the order the forward reads them
    params, blocks = storage.gather(params, full, order, keep, s.platform,
                                    s.across_hosts, narrow)
  scale = precision.loss_factor(s.tx.loss_scaler(params),
                                opt_state.loss_scale)
  grads, g_tables, metrics = lg.local_grads(
      s, params, scale, batch, order,
      {i: blocks[i] for i in lookups})
  new_params, new_state, info = s.tx.apply(
      grads, opt_state, params, pre_reduced=s.hooks, order=order,
      platform=s.platform, shards_in=blocks, shard_out=keep,
      reduced_extra=g_tables)
  return new_params, new_state, _with_info(s, metrics, info)


def _step_1d(s: _Settings, storage: Storage, params, opt_state, batch):
  """The step on a mesh whose only sharding of the params is over the data
  axis: one shard_map over it, params kept as ``storage`` says."""
  specs = zspecs.state_specs(s.tx, params, s.n, None)
  batch = lg.split_batch(batch, s.accum, s.mesh, s.axis)
  b_specs = jax.tree.map(lambda _: P(None, s.axis), batch)
  rep = zsh.replicated(params)
  full = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                      params)
  keep = (stored_leaves(lay.plan(full, s.n)) if s.shard_params
          else frozenset())
  p_specs = stored_specs(s.tx, full, s.n) if keep else rep
  lookups = _lookups(s, full, batch, keep)
  order = _read_order(s, full, batch, lookups)
  narrow = _narrow(s, full, batch, keep, lookups)
  f = _shard_map(
      lambda p, st, b: _per_device(s, storage, p, st, b, full, keep, lookups,
                                   order, narrow),
      s.mesh, (p_specs, specs, b_specs), (p_specs, specs, P()))
  return f(params, opt_state, batch)


def _step_2d(s: _Settings, params, opt_state, batch, pa):
  """Params sharded over other mesh axes too (tensor parallel): the loss
  runs manual over the data axis only (the other axes stay with the
  partitioner, as the model was written), each device's gradients leave
  stacked over the data axis, and the update runs on blocks, manual over
  every axis, so no collective over the other axes touches a block."""
  axis, mesh = s.axis, s.mesh
  specs = zspecs.state_specs(s.tx, params, s.n, pa)
  batch = lg.split_batch(batch, s.accum, mesh, axis)
  b_specs = jax.tree.map(lambda _: P(None, axis), batch)
  rep = zsh.replicated(params)
  grads, metrics = empty_leaves.shard_map(
      lambda p, sc, b: (lambda g, _, m: (
          jax.tree.map(lambda x: x[None], g), m))(*lg.local_grads(s, p, sc, b)),
      mesh=mesh, in_specs=(rep, P(), b_specs), out_specs=(
          jax.tree.map(lambda _: P(axis), params), P()),
      axis_names={axis}, check_vma=False)(
          params, precision.loss_factor(s.tx.loss_scaler(params),
                                        opt_state.loss_scale), batch)
  p_specs = pa.param_specs(params)
  g_specs = jax.tree.map(lambda sp: P(axis, *sp), p_specs,
                         is_leaf=lambda x: isinstance(x, P))

  def update(g, st, p):
    g = jax.tree.map(lambda x: x[0], g)
    new_params, new_state, info = s.tx.apply(g, st, p, param_axes=pa,
                                             platform=s.platform)
    return new_params, new_state, _with_info(s, metrics, info)

  f = _shard_map(update, mesh, (g_specs, specs, p_specs),
                 (p_specs, specs, P()))
  return f(grads, opt_state, params)


_NO_STAGE2_2D = (
    "zero1: ZeRO-2 (zero2 / DeepSpeed stage 2) does not yet support params "
    "sharded over mesh axes other than the data axis: use zero1 (stage 1) on "
    "such a mesh, or replicate the params over the other axes.")
