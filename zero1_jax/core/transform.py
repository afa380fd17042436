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

``zero1()`` reads in three parts: the configuration (:class:`Zero1Config`),
``tx.init`` / ``tx.update`` as optax calls them (:class:`_Calls`: per device
inside ``shard_map`` over ``axis_name``, else through :mod:`.jit_mode`), and
what they run on each device: the state (:mod:`.state_init`) and one update
(:mod:`.apply`), in stages:
  0. plan (:mod:`.plan`): the params' layout over the data axis and buckets;
  1. reduce (:mod:`.grad_reduce`): ``psum_scatter`` (or ``psum`` and a slice
     on the all-reduce path), in place on each large leaf and bucketed for
     small ones (:func:`zero1_jax.core.layout.plan_buckets`);
  2. norm (:mod:`.grad_norm`): the global grad norm from the shards (one
     scalar ``psum``): clipping and overflow detection both use it;
     averaging over N, unscaling and clipping fold into one scalar divisor
     of the sums, fused into the update;
  3. inner update (:mod:`.inner_update`): the inner optimizer updates the
     master shard (the stored one, or the parameter's own shard); an
     overflowing step keeps the old master and inner state on every device;
  4. gather (:mod:`.gather`): the new master shard is cast to the parameter
     dtype and all-gathered (``tx.update``: optax's updates from it).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zero1_jax.core import apply
from zero1_jax.core import boxes
from zero1_jax.core import collectives as col
from zero1_jax.core import copied_state
from zero1_jax.core import explicit_consts
from zero1_jax.core import fresh_state
from zero1_jax.core import jit_mode as jm
from zero1_jax.core import offload as ofl
from zero1_jax.core import optax_protocol as proto
from zero1_jax.core import param_axes as pax
from zero1_jax.core import params_free
from zero1_jax.core import precision
from zero1_jax.core import state_init
from zero1_jax.core import refusal
from zero1_jax.core.grad_reduce import LOCAL
from zero1_jax.core.state import Zero1State
# StepInfo, Zero1Config, Zero1State: z1's names, resolved here (__init__.py).
from zero1_jax.core.tx_config import (MULTISTEPS_CLIP, StepInfo, Zero1Config,
                                      Zero1Transformation)


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
    gather_bucket_bytes: the same for the all-gather (default: bucket_bytes;
      at least 256 MiB for gradients from ``jax.grad`` in plain jit across
      GPU hosts, :func:`zero1_jax.core.plan.gather_bytes`).
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
      and for stage 2, None for stage 1 on CPU and for stage 1's hooks in
      plain jit (``z1.value_and_grad``) over several GPU hosts
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
  # 1. Configuration: every setting checked once (Zero1Config).
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
  # 2. The transformation: tx.init / tx.update (_Calls) where they are
  # called, the per-device init (core/state_init.py) and update
  # (core/apply.py) they run.
  calls = _Calls()
  tx = calls.tx = Zero1Transformation(calls.init_fn, calls.update_fn)
  tx.config = cfg
  tx.inner = inner
  # jit mode: param tree -> the non-data sharding tx.init read from concrete
  # arrays, for updates traced on Auto axes (core/jit_mode.py).
  tx.seen_param_axes = {}
  tx.apply = functools.partial(apply.apply, tx)
  tx.init_from = functools.partial(state_init.init_from, tx)
  tx.loss_scaler = functools.partial(precision.for_params, cfg.loss_scale)
  return tx


class _Calls:
  """``tx.init`` and ``tx.update`` as optax calls them: inside a shard_map
  over the data axis they run per device (:func:`.state_init.init_from`,
  :func:`.apply.apply`); anywhere else (plain ``jax.jit``, eager, flax's
  ``TrainState``) through :mod:`.jit_mode`, which builds that shard_map.
  Methods, not closures over ``tx``: ``tx`` holds them (``self.tx``)."""

  tx: Zero1Transformation

  def init_fn(self, params) -> Zero1State:
    tx = self.tx
    if proto.is_placeholder(params):   # optax.tree_utils.tree_map_params
      return proto.placeholder_state(
          tx.inner, (tx.config.loss_scale or precision.NoLossScale()).init())
    refusal.check_params(params)
    like = params = proto.no_objects(params)
    # The state holds bare arrays; Python scalars become arrays, as optax's
    # init makes them (jnp.zeros_like(1.0) is a float32 scalar).
    params = proto.arrays(pax.strip_variables(params))
    if not col.axis_bound(tx.config.axis_name):   # plain jit / eager
      # Sharded leaves come back wrapped like the params (boxes, Variables)
      # with metadata naming zero1's placement (core/boxes.py).
      return jm.init(tx, params, like=like)
    return tx.init_from(params, params)

  def update_fn(self, updates=None, state=None, params=None, **extra_args):
    tx = self.tx
    grads, extra_args = proto.updates_arg(updates, extra_args)
    refusal.check_params(params)
    given = params is not None
    if given:   # a whole Equinox model: its non-float fields' grads are None
      params = proto.untrained(params, grads)
    if not given:   # optax's update(grads, state): the grads stand in
      params = params_free.stand_in(proto.arrays(pax.strip_variables(grads)),
                                    tx.config.master_dtype)
    # A stateless inner, as optax's tests update it (None, {}, EmptyState()).
    if state is None or proto.leafless(state):
      proto.check_none_state(tx.inner, pax.strip_variables(params),
                             tx.config.loss_scale)
      state = self.init_fn(params)
    if not given:
      params_free.check_state(boxes.strip(state), params)
    if fresh_state.owner_step(tx) is not None:   # a TrainState, an nnx.Optimizer
      fresh_state.warn_if_new(tx, boxes.strip)       # on the host, not in the step
      if col.axis_bound(tx.config.axis_name):        # pmap, shard_map: shards
        copied_state.warn_if_copied(tx, boxes.strip)
    like = params if given else grads
    grads = proto.arrays(pax.strip_variables(grads))
    params = proto.arrays(pax.strip_variables(params))
    if not col.axis_bound(tx.config.axis_name):   # plain jit / eager
      updates, new_state = jm.update(tx, grads, state, params, extra_args,
                                     params_given=given)
      new_state = boxes.rebox(state, new_state)
    else:   # inside shard_map or pmap: this device's shards
      updates, new_state, _ = tx.apply(grads, boxes.strip(state), params,
                                       LOCAL, extra_args=extra_args,
                                       as_updates=True, params_given=given)
      new_state = boxes.rebox(state, new_state)
    return boxes.rebox(like, updates), new_state


def loss_scale(state: Zero1State) -> jax.Array:
  """The factor to multiply the loss by before differentiating (fp16)."""
  return state.loss_scale.scale
