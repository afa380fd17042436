"""``tx.init`` on one device: the master shards, the inner optimizer's state
on them and the loss scale (:class:`.state.Zero1State`).

Runs inside ``shard_map`` over the data axis (``z1.init``, a user's
shard_map, or the one :mod:`.jit_mode` builds): each device keeps only its
1/N shard of every master and moment. A param already in its master dtype
(fp32) is its own master: nothing is stored for it.

Example:
  >>> import jax, jax.numpy as jnp, optax, zero1_jax as z1
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
  >>> f = jax.shard_map(lambda p: init_from(tx, p, p), mesh=mesh,
  ...                   in_specs=jax.sharding.PartitionSpec(),
  ...                   out_specs=z1.specs.state_specs(tx, params, 1))
  >>> f(params).master["w"].dtype   # bf16 params keep an fp32 master
  dtype('float32')
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from zero1_jax.core import checks as chk
from zero1_jax.core import collectives as col
from zero1_jax.core import layout as lay
from zero1_jax.core import offload as ofl
from zero1_jax.core import plan as plans
from zero1_jax.core import precision
from zero1_jax.core.state import Zero1State, master_tree


def init_from(tx: Any, params: Any, values: Any,
              param_axes: Any = None) -> Zero1State:
  """The state for training ``params`` (their dtypes decide which leaves
  keep a master), with the master shards taken from ``values`` (e.g. fp32
  weights before their cast to bf16). ``param_axes``: the params' sharding
  over other mesh axes, where the caller read it."""
  cfg, inner = tx.config, tx.inner
  layout = plans.layout(params, cfg.axis_name,
                        plans.param_axes(cfg, params, param_axes))
  shards = []
  for x, spec in zip(chk.check_tree("values", values, layout), layout.leaves):
    if spec.kind == lay.SHARD:
      x = col.local_shard(x, spec, cfg.axis_name)
    shards.append(None if spec.kind == lay.STATIC else jnp.asarray(x).astype(
        lay.master_dtype(spec.dtype, cfg.master_dtype)))
  inner_state = inner.init(layout.inner_tree(shards))
  if cfg.offload:   # what is sharded over the data axis, to host memory
    inner_state = ofl.place_state(
        inner_state, ofl.owners(inner, layout, cfg.master_dtype), layout)
    shards = ofl.masters_to_host(shards, layout)
  return Zero1State(master_tree(layout, cfg.master_dtype, shards),
                    inner_state,
                    precision.for_params(cfg.loss_scale, params).init())
