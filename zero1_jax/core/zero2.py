"""``zero2()``: ZeRO Stage 2, gradients reduce-scattered inside the backward pass.

Stage 2 is stage 1's optimizer (same state, same update math) fed by a
different gradient path. :func:`zero1_jax.train_step` with a stage-2
transformation differentiates the loss through one identity *hook* per
parameter leaf, or group of small leaves (:func:`reduce_hook`). The hook's forward returns the full
parameter; its backward rule receives that leaf's complete cotangent, the
moment the backward pass has produced it, and reduce-scatters it at once
(on GPUs in its own shape, XLA combining a group's; elsewhere a group's
rank-major views, :func:`zero1_jax.core.collectives.rank_major`, packed
into one collective): each device
keeps only its 1/N shard, handed as the cotangent of a shard-shaped zero
*slot* that is what ``jax.grad`` differentiates. The parameter's own
cotangent is never asked for, so no full gradient tree is alive at once:
XLA frees each leaf's gradient as soon as its reduce-scatter has consumed it.

With accumulation the scan's carry holds the 1/N shards (each micro-batch's
gradients are reduce-scattered in its own backward, as DeepSpeed's stage 2
does). On GPUs the hooks run with accumulation only: with one micro-batch
no gradient outlives the backward, and ``train_step`` reduce-scatters as
stage 1 does, each leaf in place in the backward's order, for the same
peak and a faster step across hosts (core/step.py, docs/gpu.md). The update then starts from those summed shards
(``tx.apply(..., pre_reduced=True)``): the same divide by N x loss scale,
norm, clipping, skip, inner update and all-gather as stage 1.

Leaf kinds: SHARD leaves are reduce-scattered (or all-reduced and sliced on
the ``reduce="all_reduce"`` path), REPLICATE (scalar) leaves are all-reduced,
STATIC leaves (integers, zero-size) are not differentiated (None).

Example:
  >>> import optax, zero1_jax as z1
  >>> tx = z1.zero2(optax.adam(1e-3), axis_name="data", max_grad_norm=1.0)
  >>> tx.config.stage, tx.config.max_grad_norm
  (2, 1.0)
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from zero1_jax.core import chain as chaining
from zero1_jax.core import collectives as col
from zero1_jax.core import layout as lay
from zero1_jax.core import order as ordering
from zero1_jax.core.transform import Zero1Config, Zero1Transformation, zero1


def zero2(inner: optax.GradientTransformation, *, axis_name: str,
          **kwargs: Any) -> Zero1Transformation:
  """ZeRO Stage 2: :func:`zero1_jax.zero1`'s sharded optimizer, with
  gradients reduce-scattered while the backward pass produces them.

  Takes exactly :func:`zero1_jax.zero1`'s keywords (its signature is this
  function's ``__signature__``) and means the same by them. In
  :func:`zero1_jax.train_step`, a leaf of at least ``inplace_bytes`` is
  reduce-scattered alone as soon as the backward has produced its gradient;
  smaller leaves share one collective per group of at most ``bucket_bytes``
  (:func:`hook_groups`). On GPUs that is with ``grad_accum_steps`` > 1:
  with one micro-batch ``train_step`` reduces as stage 1 does there (no
  gradient outlives the backward; the same peak, a faster step). ``tx.update`` inside a user's own shard_map is
  stage 1's (it is handed whole local gradients, nothing is left to shard).

  Returns:
    A :class:`zero1_jax.Zero1Transformation` with ``config.stage == 2``; use
    it with :func:`zero1_jax.init` and :func:`zero1_jax.train_step`.

  Raises:
    TypeError: a keyword :func:`zero1_jax.zero1` does not take.
    ValueError: as :func:`zero1_jax.zero1`.
  """
  tx = zero1(inner, axis_name=axis_name, **kwargs)
  # The update's math does not depend on the stage (only on how the
  # gradients reach it, which train_step reads from config.stage).
  tx.config = dataclasses.replace(tx.config, stage=2)
  return tx


zero2.__signature__ = inspect.signature(zero1)


def comm_dtype(spec: lay.LeafSpec, cfg: Zero1Config) -> jnp.dtype:
  """The dtype a leaf's gradient is reduced (and accumulated) in: as stage 1,
  ``reduce_dtype`` for sharded leaves, the parameter's dtype for scalars."""
  if spec.kind == lay.SHARD and cfg.reduce_dtype is not None:
    return jnp.dtype(cfg.reduce_dtype)
  return jnp.dtype(spec.dtype)


def reduce_hook(specs: Sequence[lay.LeafSpec], n: int, axis_name: str,
                dtype: Any, all_reduce: bool = False,
                key: str | None = None, waits: bool | None = None,
                per_leaf: bool = False) -> Callable:
  """``hook(params, slots) -> params`` whose backward reduces the cotangents.

  ``params`` and ``slots`` are tuples, one entry per leaf of ``specs`` (all
  SHARD or all REPLICATE). ``slots[k]`` is a zero of ``specs[k].shard_shape``
  (scalars: shape ()) in ``dtype``; its cotangent is this device's shard of
  the sum over ``axis_name`` of ``params[k]``'s cotangent, all of the group's
  leaves in one collective (their rank-major views side by side). The params
  get no cotangent (None: a zero that is never built). ``key``: the XLA
  ``combiner_key`` the collective carries (:func:`zero1_jax.core.order.tagged`).

  ``per_leaf`` (GPUs, whose XLA combines collectives by their key; measured
  there only): each SHARD leaf reduce-scattered in its own shape along its
  shard dim, XLA combining the group's into one, with no packed copy of the
  gradients. The same sums. On 8 to 64 H100s (XLA's cost model, BERT-base
  and GPT-2) plain jit's step with ``z1.value_and_grad`` is up to 6.3%
  shorter than packed (0.5% longer for BERT-base fp32 on 8, whose peak is
  then 1,836.5 MiB instead of 1,842.5), zero2's within 0.5% (GPT-2 bf16
  across hosts 2.5-3.0% shorter): ``experiments/results/gpu_aot.md``.

  ``waits`` not None: ``hook(params, slots, token) -> (params, token)``, the
  token's cotangent standing for the reduce-scatters of the hooks before
  this one in the backward; with ``waits`` this one's starts after them
  (:func:`reduced_grad_fn`'s ``chain``).
  """

  # fp16 travels divided by N (collectives.predivides); the update restores
  # the sums in float32 (tx.apply(..., pre_reduced=True)).
  pre = col.predivides(dtype, all_reduce)

  def reduce(cts):
    cts = [c.astype(dtype) for c in cts]
    if pre:
      cts = [col.predivide(c, n) for c in cts]
    if specs[0].kind == lay.REPLICATE:
      with ordering.tagged(key):
        total = jax.lax.psum(jnp.stack(cts), axis_name)
      return tuple(total[k] for k in range(len(cts)))
    if per_leaf and not all_reduce:
      with ordering.tagged(key):
        return tuple(col.reduce_leaf(c, s, axis_name, False)
                     for c, s in zip(cts, specs))
    views = [col.rank_major(c, s, n) for c, s in zip(cts, specs)]
    m = views[0] if len(views) == 1 else jnp.concatenate(views, axis=1)
    with ordering.tagged(key):
      if all_reduce:   # DeepSpeed's reduce_scatter: false
        mine = jax.lax.dynamic_index_in_dim(
            jax.lax.psum(m, axis_name), jax.lax.axis_index(axis_name), 0,
            keepdims=False)
      else:
        mine = jax.lax.psum_scatter(m, axis_name, scatter_dimension=0,
                                    tiled=True)
    mine, out, at = mine.reshape(-1), [], 0
    for s in specs:
      out.append(mine[at:at + s.shard_size].reshape(s.shard_shape))
      at += s.shard_size
    return tuple(out)

  if waits is not None:
    return chaining.chained(reduce, waits)

  return chaining.first_through(lambda _, cts: (None, reduce(cts)))


def hook_groups(layout: lay.Layout, cfg: Zero1Config,
                order: Sequence[int] | None = None,
                platform: str | None = None,
                across_hosts: bool = False) -> list[list[int]]:
  """Leaf indices reduced together, in the order the backward completes
  them (the reverse of ``order``, the loss's first reads: tree order by
  default): each SHARD leaf of at least ``cfg.inplace_bytes`` (all N pieces)
  alone, as the backward produces it; smaller ones packed per comm dtype
  into groups of at most ``cfg.bucket_bytes`` (one collective each, once
  the whole group's gradients exist); the scalar (REPLICATE) leaves one
  group per dtype. ``inplace_bytes=None``: every SHARD leaf packed, as in
  stage 1. ``platform``: as :meth:`Zero1Config.inplace_threshold`'s.

  ``across_hosts``: the data axis spans several hosts (plain jit's hooks:
  ``"auto"`` packs stage 1's leaves there, as
  :meth:`Zero1Config.inplace_threshold` says). Every leaf packed there, the
  buckets are filled from the backward's end, so the one left part-full is
  the first: the same groups in number, the first collective started
  sooner over the network (what PyTorch DDP's small first bucket is for).
  GPT-2 fp32, plain jit on 32 H100s (XLA's cost model): 19,532 µs against
  20,540 packed from the start; DDP 20,531 (docs/gpu.md has every case).
  ``tx.update`` gathers the same groups there (:func:`backward_groups`),
  so a group's bytes are the larger of what its reduce-scatter and its
  gather move (:func:`_itemsize`)."""
  n = layout.num_shards
  from_end = _gathered_too(cfg, n, platform, across_hosts)
  small = None if from_end else cfg.inplace_threshold(
      n, platform, "hooks" if across_hosts else None)
  groups, open_, scalars = [], {}, {}
  back = tuple(range(len(layout.leaves)) if order is None else order)
  for i in (back if from_end else reversed(back)):
    spec = layout.leaves[i]
    dt = comm_dtype(spec, cfg)
    if spec.kind == lay.REPLICATE:
      scalars.setdefault(dt, []).append(i)
      continue
    if spec.kind != lay.SHARD:
      continue
    size = n * spec.shard_size * _itemsize(spec, cfg, from_end)
    if small is not None and size >= int(small):
      groups.append([i])
      continue
    g = open_.get(dt)
    if g is None or g[1] + size > int(cfg.bucket_bytes):
      g = open_[dt] = [[], 0]
      groups.append(g[0])
    g[0].append(i)
    g[1] += size
  if from_end:
    groups = [g[::-1] for g in groups[::-1]]
    scalars = {dt: g[::-1] for dt, g in scalars.items()}
  return groups + list(scalars.values())


def _gathered_too(cfg: Zero1Config, n: int, platform: str | None,
                  across_hosts: bool) -> bool:
  """Plain jit's hooks across hosts (``across_hosts``), every leaf packed:
  ``tx.update`` gathers the new weights in the hooks' groups."""
  return across_hosts and cfg.inplace_threshold(n, platform, "hooks") is None


def _itemsize(spec: lay.LeafSpec, cfg: Zero1Config, gathered: bool) -> int:
  """Bytes an element of a leaf counts for in its group: its gradient's
  (:func:`comm_dtype`); where the group is gathered too (``gathered``), the
  larger of that and its param's. fp32 params reduced in bf16 gather fp32
  updates: counted by the reduce's bytes, a 64 MiB group gathered 128 MiB
  after the backward (GPT-2 and BERT-base computing in bf16, plain jit on 16
  H100s, XLA's cost model: 16,611 and 10,635 µs, 1.05 x DDP's step; by the
  gather's, 15,160 and 9,610)."""
  size = comm_dtype(spec, cfg).itemsize
  return max(size, jnp.dtype(spec.dtype).itemsize) if gathered else size


def tag_ids(groups: list[list[int]], layout: lay.Layout, cfg: Zero1Config,
            gathered: bool = False) -> list[int]:
  """Each hook group's combiner group (its XLA combiner_key,
  :data:`zero1_jax.core.collectives.REDUCE_KEY`): consecutive groups of at
  most ``cfg.bucket_bytes`` in all share one, smaller towards the end of the
  backward, which nothing hides (:func:`zero1_jax.core.layout.group_ids`);
  ``gathered``: the groups are gathered too, counted as
  :func:`hook_groups` counts them."""
  n = layout.num_shards
  sizes = [sum(n * layout.leaves[i].shard_size
               * _itemsize(layout.leaves[i], cfg, gathered) for i in idx)
           for idx in groups]
  return lay.group_ids(sizes, min(int(cfg.bucket_bytes), lay.GROUP_BYTES),
                       "last")


def _tags(groups: list[list[int]], layout: lay.Layout, cfg: Zero1Config,
          gathered: bool = False) -> list[str]:
  return [col.REDUCE_KEY.format(g)
          for g in tag_ids(groups, layout, cfg, gathered)]


def backward_groups(layout: lay.Layout, cfg: Zero1Config,
                    order: Sequence[int] | None = None,
                    platform: str | None = None,
                    across_hosts: bool = False
                    ) -> list[tuple[list[int], int]]:
  """``(leaf indices, combiner group)`` of each SHARD group
  :func:`reduced_grad_fn` reduce-scatters, in the backward's order: what
  ``tx.update`` gathers group by group (:func:`.plan.backward_buckets`)."""
  groups = hook_groups(layout, cfg, order, platform, across_hosts)
  gathered = _gathered_too(cfg, layout.num_shards, platform, across_hosts)
  return [(idx, tag) for idx, tag
          in zip(groups, tag_ids(groups, layout, cfg, gathered))
          if layout.leaves[idx[0]].kind == lay.SHARD]


def reduced_grad_fn(loss_fn: Callable, params: Any, cfg: Zero1Config,
                    n: int, order: Sequence[int] | None = None,
                    platform: str | None = None,
                    tables: dict | None = None, chain: bool = False,
                    across_hosts: bool = False,
                    total: bool = False) -> Callable:
  """``f(batch) -> (grads, aux)`` for ``jax.grad(loss_fn, has_aux=True)``
  with every leaf's gradient reduced in the backward pass
  (:func:`hook_groups` says which leaves share a collective).

  ``grads`` has ``params``' structure: this device's shard (``shard_shape``)
  of the gradient summed over the axis at SHARD leaves, the summed scalar at
  REPLICATE leaves, None at STATIC leaves. Runs inside shard_map.
  ``order`` / ``platform``: as :func:`hook_groups`'s. With ``tables``
  ({leaf: this device's column block}, :mod:`.lookup`): ``loss_fn(params,
  tables, batch)``, and ``grads`` is ``(grads, tables' gradients)``.
  ``chain``: each combiner group's reduce-scatter starts after the group
  before it in the backward has arrived (plain jit, where XLA's scheduler
  otherwise queues them all at the backward's end: GPT-2 fp32 on 8 H100s
  with its lookups gathered, 1,164 µs of collectives exposed instead of
  1,538).

  ``across_hosts``: :func:`hook_groups`' groups for several hosts, and with
  ``chain`` the chain kept whole (:mod:`.chain`): the token's last
  cotangent is the loss's sum with ``total``, else added, times 0, to
  ``aux``'s first floating leaf. Left unused, XLA cut the chain
  after its first 4-5 groups (GPT-2 fp32, 8 and 16 H100s). Kept whole it
  is ahead across hosts only: GPT-2 fp32 on 16 H100s (2 hosts, XLA's cost
  model, buckets filled from the start) 20,150 µs against 20,878 with it
  cut; on 8 H100s (in
  place) 16,208 against 15,672.

  ``total``: ``f(batch) -> (grads, aux, loss summed over the axis)``, the
  sum ``jax.lax.psum`` gives; with the chain kept whole its all-reduce runs
  as the backward starts and the chain carries it (:func:`.chain.carry_sum`).
  """
  layout = lay.plan(params, n)
  p_leaves = jax.tree.leaves(params)
  groups = hook_groups(layout, cfg, order, platform, across_hosts)
  hooks, slots = [], []
  tags = _tags(groups, layout, cfg,
               _gathered_too(cfg, n, platform, across_hosts))
  for k, (idx, key) in enumerate(zip(groups, tags)):
    specs = [layout.leaves[i] for i in idx]
    dt = comm_dtype(specs[0], cfg)
    waits = (k > 0 and key != tags[k - 1]) if chain else None
    hooks.append(reduce_hook(specs, n, cfg.axis_name, dt,
                             cfg.reduce == "all_reduce", key, waits,
                             per_leaf=platform == "gpu"))
    slots.append(tuple(jnp.zeros(s.shard_shape, dt) for s in specs))

  def through_hooks(slots, tok, *args):
    hooked = list(p_leaves)
    if not chain:
      for idx, h, s in zip(groups, hooks, slots):
        for i, p in zip(idx, h(tuple(p_leaves[i] for i in idx), s)):
          hooked[i] = p
      return loss_fn(layout.treedef.unflatten(hooked), *args)
    # The token passes the hooks in the forward's order, so that its
    # cotangent passes them in the backward's; the loss takes it times 0.
    for idx, h, s in reversed(list(zip(groups, hooks, slots))):
      ps, tok = h(tuple(p_leaves[i] for i in idx), s, tok)
      for i, p in zip(idx, ps):
        hooked[i] = p
    loss, aux = loss_fn(layout.treedef.unflatten(hooked), *args)
    if keep and total:
      return chaining.carry_sum(cfg.axis_name)(loss, tok), aux
    return loss + (0 * tok).astype(jnp.result_type(loss)), aux

  keep = chain and across_hosts
  argnums = (0,) + ((1,) if keep else ()) + ((2,) if tables else ())
  grad = jax.value_and_grad(through_hooks, argnums=argnums, has_aux=True)

  def f(batch):
    (loss, aux), found = grad(slots, chaining.token(),
                              *((tables,) if tables else ()), batch)
    found = dict(zip(argnums, found))
    g_slots, g_tables = found[0], found.get(2)
    summed = None
    if keep and total:
      summed = found[1].astype(loss.dtype)
    elif keep:
      aux = chaining.tie(aux, found[1])
    elif total:
      summed = jax.lax.psum(loss, cfg.axis_name)
    g = [None] * len(p_leaves)
    for idx, gs in zip(groups, g_slots):
      for i, x in zip(idx, gs):
        g[i] = x
    g = layout.treedef.unflatten(g)
    out = ((g, g_tables) if tables else g), aux
    return out + (summed,) if total else out

  return f
