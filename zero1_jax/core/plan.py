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
            platform: str | None = None, shard_out: Sequence[int] = (),
            gather_groups: Sequence[tuple[Sequence[int], int]] | None = None,
            reduced_by_jit: bool = False, across_hosts: bool = False
            ) -> tuple[tuple[lay.Bucket, ...], tuple[lay.Bucket, ...]]:
  """``(reduce buckets, gather buckets)`` for the leaves ``grads`` and
  ``params``: the gradients travel in ``cfg.reduce_dtype`` (default their
  own), the new weights in the params' dtypes; leaves of at least
  ``cfg.inplace_threshold`` bytes in place. ``order``: the leaves in the
  order the loss first reads them (:mod:`.order`): reduced in its reverse,
  the last group exposed; gathered in it. ``shard_out``: leaves not
  gathered (kept as this device's shard). ``gather_groups``: the groups the
  backward reduce-scattered (:func:`backward_buckets`), gathered the same.
  ``reduced_by_jit``: ``grads`` were reduced by jit's partitioner
  (:meth:`~zero1_jax.core.tx_config.Zero1Config.inplace_threshold`); with
  no ``order`` and not ``across_hosts`` (the data axis over several GPU
  hosts), the leaves split on a later dim are gathered first
  (:func:`split_on_later_dims_first`)."""
  small = cfg.inplace_threshold(layout.num_shards, platform,
                                reduced_by_jit=reduced_by_jit)
  comm = tuple(jnp.dtype(cfg.reduce_dtype or g.dtype) for g in grads)
  fwd = tuple(range(len(params))) if order is None else tuple(order)
  reduce = lay.plan_buckets(
      layout, comm, int(cfg.bucket_bytes), small,
      *((None, None) if order is None else (fwd[::-1], "last")))
  if gather_groups is not None:
    gather = backward_buckets(layout, [p.dtype for p in params], gather_groups,
                              shard_out)
    if gather is not None:
      return reduce, gather
  if reduced_by_jit and order is None and not across_hosts:
    fwd = split_on_later_dims_first(layout, fwd)
  gather = lay.plan_buckets(
      layout, tuple(jnp.dtype(p.dtype) for p in params),
      gather_bytes(cfg, reduced_by_jit and order is None and across_hosts),
      small, tuple(i for i in fwd if i not in shard_out))
  return reduce, gather


# The gathers after jit's reduce, across hosts: see gather_bytes.
JIT_GATHER_BYTES_ACROSS_HOSTS = 1 << 28


def gather_bytes(cfg: Zero1Config, after_jit_across_hosts: bool = False
                 ) -> int:
  """The most bytes one all-gather moves: ``cfg.gather_bucket_bytes``, by
  default ``cfg.bucket_bytes``; for the gathers of an update handed
  gradients jit's partitioner reduced, where the data axis spans several
  GPU hosts (``after_jit_across_hosts``), by default at least
  :data:`JIT_GATHER_BYTES_ACROSS_HOSTS` (256 MiB). There every gather waits
  for XLA's combined reduce-scatters at the backward's end, and then runs
  with nothing left to compute beside it: a few large gathers over the
  network finish sooner than many of 64 MiB. 16 to 64 H100s (XLA's cost
  model), ``jax.grad`` in plain jit: faster in all 18 cases (BERT-base and
  GPT-2 small; fp32, bf16 and fp32 params computing in bf16), by 0.1-9.0%
  (GPT-2 fp32 on 16 GPUs 22,594 µs against 22,608; BERT-base fp32 on 64
  17,878 against 19,350), the peaks within 0.1 MiB; 128 MiB was between
  the two, one gather of every leaf (1 GiB) within 0.8% of 256 MiB."""
  if cfg.gather_bucket_bytes:
    return int(cfg.gather_bucket_bytes)
  if after_jit_across_hosts:
    return max(int(cfg.bucket_bytes), JIT_GATHER_BYTES_ACROSS_HOSTS)
  return int(cfg.bucket_bytes)


def split_on_later_dims_first(layout: lay.Layout, leaves: Sequence[int]
                              ) -> tuple[int, ...]:
  """``leaves`` with those split on a dim after their first gathered first
  (each part in its given order). The add after the last gather
  (``optax.apply_updates`` on the gathered updates) has no compute left to
  hide under, and a leaf split on a later dim is reassembled there by a
  strided read: BERT-base bf16's column-split embedding, last in tree
  order, took 148 µs after its gather on 8 H100s (XLA's cost model); with
  it gathered first, 7,870 µs a step against 7,980 (GSPMD 7,922). Not
  across hosts: there GPT-2 fp32 took 1.4-6.4% longer with it (16-64
  H100s, 64 MiB gathers: 22,934 / 24,415 / 27,022 µs against 22,608 /
  23,684 / 25,394).

  Example:
    >>> import numpy as np
    >>> l = lay.plan([np.zeros((8, 2)), np.zeros((3, 8))], 8)
    >>> split_on_later_dims_first(l, (0, 1))
    (1, 0)
  """
  return tuple(sorted(leaves, key=lambda i: layout.leaves[i].dim <= 0))


def backward_buckets(layout: lay.Layout, dtypes: Sequence,
                     groups: Sequence[tuple[Sequence[int], int]],
                     shard_out: Sequence[int] = ()
                     ) -> tuple[lay.Bucket, ...] | None:
  """The gathers of leaves the backward reduce-scattered in ``groups``
  (``(leaf indices, combiner group)`` in the order their reduce-scatters
  ran, :func:`zero1_jax.core.zero2.backward_groups`): one packed bucket per
  combiner group (what XLA combines into one reduce-scatter) and param
  dtype, in that order, carrying the same group. Each gather then waits for
  exactly one reduce-scatter, and XLA can run it under the rest of the
  backward. (Per-leaf gathers in place are not combined back by XLA: for
  BERT-base on 8 H100s, 17 gathers behind 9 reduce-scatters, an estimated
  11,330 µs a step against 11,029 packed.) None if the groups do not cover
  every SHARD leaf not in ``shard_out`` exactly once."""
  skip = set(shard_out)
  want = {i for i in layout.indices(lay.SHARD) if i not in skip}
  seen: list[int] = []
  out: list[lay.Bucket] = []
  merged: dict[int, list[int]] = {}
  for idx, tag in groups:
    merged.setdefault(tag, []).extend(idx)
  for tag, idx in merged.items():
    packed: dict[Any, list[lay.Segment]] = {}
    for i in idx:
      if i in want:
        seen.append(i)
        packed.setdefault(jnp.dtype(dtypes[i]), []).append(
            lay.Segment(i, 0, layout.leaves[i].shard_size))
    out += [lay.Bucket(dt, tuple(segs), tag) for dt, segs in packed.items()]
  if len(seen) != len(want) or set(seen) != want:
    return None
  return tuple(out)
