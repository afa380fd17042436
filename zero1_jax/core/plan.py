"""The plan of one update: how this device's params split over the data axis,
their sharding over the mesh's other axes, and the buckets the update's
reduce-scatter and all-gather move them in.

Pure Python over shapes and dtypes, made at trace time: the shards and
buckets come from :mod:`.layout`, the collectives over them are
:mod:`.collectives`'.

Example:
  >>> import jax.numpy as jnp
  >>> from zero1_jax.core import layout as lay
  >>> from zero1_jax.core.tx_config import Zero1Config
  >>> params = [jnp.zeros((5, 3)), jnp.zeros(3)]
  >>> r, g = buckets(Zero1Config("data"), lay.plan(params, 2), params, params,
  ...                platform="cpu")
  >>> len(r), len(g)   # every leaf packed into one bucket each way
  (1, 1)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax.numpy as jnp

from zero1_jax.core import collectives as col
from zero1_jax.core import layout as lay
from zero1_jax.core import param_axes as pax
from zero1_jax.core.tx_config import Zero1Config


class StepPlan(NamedTuple):
  """What one update runs over (:func:`zero1_jax.core.apply.apply`)."""

  layout: lay.Layout                      # this device's params, split over the data axis
  param_axes: pax.ParamAxes | None        # their sharding over other mesh axes (2-D)
  reduce_buckets: tuple[lay.Bucket, ...]  # the gradients' reduce collectives, in order
  gather_buckets: tuple[lay.Bucket, ...]  # the new weights' all-gathers, in order


def param_axes(cfg: Zero1Config, params: Any,
               given: pax.ParamAxes | None) -> pax.ParamAxes | None:
  """The params' sharding over the mesh's other axes inside shard_map:
  ``given`` by the caller (:func:`zero1_jax.init`, :func:`zero1_jax.train_step`,
  :mod:`.jit_mode`), else read from ``cfg.param_specs``, else none."""
  if given is not None or cfg.param_specs is None:
    return given
  axis = cfg.axis_name
  return pax.resolve(params, pax.bound_sizes(cfg.param_specs, axis), axis,
                     cfg.param_specs, blocks=True)


def layout(params: Any, axis_name: str,
           pa: pax.ParamAxes | None) -> lay.Layout:
  """``params`` (this device's blocks on a 2-D mesh) split over the bound
  data axis, avoiding the dims ``pa`` shards over other axes."""
  return lay.plan(params, col.axis_size(axis_name),
                  None if pa is None else pa.taken)


def buckets(cfg: Zero1Config, layout: lay.Layout, grads: Sequence,
            params: Sequence, order: Sequence[int] | None = None,
            platform: str | None = None, shard_out: Sequence[int] = ()
            ) -> tuple[tuple[lay.Bucket, ...], tuple[lay.Bucket, ...]]:
  """``(reduce buckets, gather buckets)`` for the leaves ``grads`` and
  ``params``: the gradients travel in ``cfg.reduce_dtype`` (default their
  own), the new weights in the params' dtypes; leaves of at least
  ``cfg.inplace_threshold`` bytes in place. ``order``: the leaves in the
  order the loss first reads them (:mod:`.order`): reduced in its reverse,
  the last group exposed; gathered in it. ``shard_out``: leaves not
  gathered (kept as this device's shard)."""
  small = cfg.inplace_threshold(layout.num_shards, platform)
  comm = tuple(jnp.dtype(cfg.reduce_dtype or g.dtype) for g in grads)
  fwd = tuple(range(len(params))) if order is None else tuple(order)
  reduce = lay.plan_buckets(
      layout, comm, int(cfg.bucket_bytes), small,
      *((None, None) if order is None else (fwd[::-1], "last")))
  gather = lay.plan_buckets(
      layout, tuple(jnp.dtype(p.dtype) for p in params),
      int(cfg.gather_bucket_bytes or cfg.bucket_bytes), small,
      tuple(i for i in fwd if i not in shard_out))
  return reduce, gather
