"""One update on this device, stage by stage: ``tx.apply``.

Runs inside ``shard_map`` over the data axis (``z1.train_step``, a user's
shard_map, or the one :mod:`.jit_mode` builds around plain jit code):

0. plan (:mod:`.plan`): the layout of the params over the data axis and
   the buckets, after checking what it is handed (:mod:`.checks`);
1. reduce (:mod:`.grad_reduce`): the gradients -> this device's summed
   shards, in the master dtype;
2. norm (:mod:`.grad_norm`): the global norm from the shards (one scalar
   ``psum``); averaging over N, unscaling and clipping as one divisor; the
   overflow test;
3. inner update (:mod:`.inner_update`): the inner optimizer on the master
   shards and its sharded state, the old ones kept on overflow;
4. gather (:mod:`.gather`): the new master shards cast to the param dtype
   and all-gathered (or kept as shards), or optax's updates.

Example:
  >>> import jax, jax.numpy as jnp, optax, zero1_jax as z1
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> tx = z1.zero1(optax.sgd(0.5), axis_name="data")
  >>> params, state = z1.init(tx, {"w": jnp.ones(3)}, mesh)
  >>> P = jax.sharding.PartitionSpec
  >>> specs = z1.specs.state_specs(tx, params, 1)
  >>> step = jax.shard_map(lambda g, s, p: tx.apply(g, s, p)[0], mesh=mesh,
  ...                      in_specs=(P(), specs, P()), out_specs=P(),
  ...                      check_vma=False)
  >>> [float(w) for w in step({"w": jnp.ones(3)}, state, params)["w"]]
  [0.5, 0.5, 0.5]
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from zero1_jax.core import checks as chk
from zero1_jax.core import elementwise as ew
from zero1_jax.core import grad_norm
from zero1_jax.core import grad_reduce as reduce
from zero1_jax.core import inner_update
from zero1_jax.core import params_free
from zero1_jax.core import plan as plans
from zero1_jax.core import precision
from zero1_jax.core.gather import gather
from zero1_jax.core.grad_reduce import LOCAL, REDUCED, SHARDS
from zero1_jax.core.state import Zero1State
from zero1_jax.core.tx_config import StepInfo


def apply(tx: Any, grads: Any, state: Zero1State, params: Any,
          grads_are: str = LOCAL, *, pre_reduced: bool = False,
          param_axes: Any = None, extra_args: dict | None = None,
          as_updates: bool = False, order: Sequence[int] | None = None,
          platform: str | None = None, shards_in: dict | None = None,
          shard_out: Sequence[int] = (), reduced_extra: dict | None = None,
          gather_groups: Sequence | None = None, params_given: bool = True,
          across_hosts: bool = False) -> tuple[Any, Zero1State, StepInfo]:
  """``(new params, new state, StepInfo)`` from ``grads`` (what they are:
  ``grads_are``, :mod:`.grad_reduce`); ``as_updates``: optax's updates
  instead of the new params.

  ``pre_reduced``: summed shards (stage 2's backward); ``param_axes``: the
  params' sharding over other mesh axes (2-D meshes); ``extra_args``: the
  inner update's extra keyword arguments; ``order``: the leaves in the order
  the loss first reads them (:mod:`.order`; reduced in reverse, gathered in
  it); ``platform``: the mesh's ('gpu', 'cpu', ...) for
  ``inplace_bytes="auto"``; ``shards_in``: {leaf: this device's shard} of
  leaves stored sharded, read as their master where none is stored;
  ``shard_out``: leaves returned as this device's new shard (in the param
  dtype) instead of gathered; ``reduced_extra``: {leaf: a part of its
  gradient summed over every device already, this device's shard} added to
  the reduced sums (row lookups served from stored shards, :mod:`.lookup`);
  ``gather_groups``: the groups the backward reduce-scattered, gathered
  group by group (:func:`.plan.backward_buckets`); ``params_given`` False:
  ``params`` are the gradients standing in for them (optax's
  ``update(grads, state)``, :mod:`.params_free`), the inner optimizer is
  handed None; ``across_hosts``: the data axis spans several GPU hosts
  (:func:`.plan.buckets`).
  """
  if grads_are == SHARDS:   # z1.value_and_grad's: reduced in the backward
    grads_are, pre_reduced = LOCAL, True
  cfg = tx.config
  p_leaves = jax.tree.leaves(params)
  plan, g_leaves = _plan(tx, grads, params, p_leaves, grads_are, pre_reduced,
                         param_axes, extra_args, order, platform, shard_out,
                         gather_groups, across_hosts)
  layout = plan.layout
  scaler = precision.for_params(cfg.loss_scale, params)

  # 1. Reduce (unless the backward did: pre_reduced).
  sums, packed = reduce.reduce(g_leaves, layout, plan.reduce_buckets, cfg,
                               grads_are, pre_reduced,
                               in_order=platform not in (None, "cpu"))
  if reduced_extra:
    sums, packed = reduce.add_reduced(sums, packed, reduced_extra)
  # 2. Norm, clip, overflow: one divisor. jit's gradients are of the global
  # mean loss already: no 1/N there.
  scale = precision.scale_of(scaler, state.loss_scale)
  denom = (scale * (layout.num_shards if grads_are == LOCAL else 1)
           ).astype(jnp.float32)
  g = grad_norm.scale(sums, packed, layout, plan.param_axes, cfg, denom,
                      scaler.skips_on_overflow)
  # 3. The inner update on the master shards.
  pairs, new_state = inner_update.update(
      tx.inner, cfg, layout, state, g.grads, p_leaves, scaler, g.skipped,
      extra_args, shards_in, params_given)
  if not params_given:
    params_free.check_u(pairs, p_leaves, layout, cfg.master_dtype)
  # 4. Gather the new weights (or optax's updates) in the param dtypes; on
  # GPUs, optax's updates in the order the forward reads the leaves, each
  # group after the gradients of the one before it (gather.waits).
  ordered = (as_updates and gather_groups is None
             and platform not in (None, "cpu"))
  out = gather(pairs, p_leaves, layout, plan.gather_buckets, cfg.axis_name,
               cfg.master_dtype, as_updates,
               after_reduced=sums if ordered else None)
  return (layout.treedef.unflatten(out), new_state,
          StepInfo(g.norm, g.skipped, scale))


def _plan(tx: Any, grads: Any, params: Any, p_leaves: list, grads_are: str,
          pre_reduced: bool, param_axes: Any, extra_args: dict | None,
          order: Sequence[int] | None, platform: str | None,
          shard_out: Sequence[int], gather_groups: Sequence | None = None,
          across_hosts: bool = False) -> tuple[plans.StepPlan, list]:
  """Stage 0: the :class:`.plan.StepPlan` and the gradients' leaves, once
  what the update is handed has been checked against the layout (and, with
  extra arguments, the inner optimizer again with them)."""
  cfg = tx.config
  pa = plans.param_axes(cfg, params, param_axes)
  layout = plans.layout(params, cfg.axis_name, pa)
  if cfg.check_elementwise:   # with the extra arguments init could not know
    ew.check_update_args(tx.inner, params, layout.num_shards,
                         cfg.master_dtype, extra_args or {})
  g_leaves = (chk.check_shards(grads, layout) if pre_reduced
              else chk.check_tree("grads", grads, layout,
                                  blocks=grads_are == REDUCED))
  if grads_are == LOCAL and not pre_reduced:
    chk.check_local_grads(grads, cfg.axis_name)
  r_buckets, g_buckets = plans.buckets(cfg, layout, g_leaves, p_leaves,
                                       order, platform, shard_out,
                                       gather_groups,
                                       reduced_by_jit=grads_are == REDUCED,
                                       across_hosts=across_hosts)
  return plans.StepPlan(layout, pa, r_buckets, g_buckets), g_leaves
