"""Stage 3 of an update: the inner optimizer on this device's master shards.

The master shard of a leaf is the stored one (bf16/fp16 params keep an fp32
copy, :func:`.state.stores_master`), or where a param is its own master
(fp32 params) its own shard, sliced from the replicated param, bitwise the
master (:func:`master_view`). The inner optax update runs on those shards
and the inner state (param-shaped trees of 1/N shards,
``Layout.inner_tree``); an overflowing step keeps the old master and state
on every device. With ``offload``, one group of host-resident leaves at a
time (:func:`.offload.streamed`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax

from zero1_jax.core import checks as chk
from zero1_jax.core import collectives as col
from zero1_jax.core import layout as lay
from zero1_jax.core import offload as ofl
from zero1_jax.core import precision
from zero1_jax.core import updates as upd
from zero1_jax.core.state import Zero1State, master_tree


def master_view(stored: Sequence, params: Sequence, layout: lay.Layout,
                axis_name: str, shards_in: dict | None = None) -> list:
  """Per leaf, the master the inner optimizer updates: the stored shard,
  else this device's shard of the param (``shards_in``' where the step
  keeps it sharded), the param itself where it is replicated, None where
  static."""
  view = []
  for i, (m, p, spec) in enumerate(zip(stored, params, layout.leaves)):
    if m is None and spec.kind == lay.SHARD and shards_in and i in shards_in:
      m = shards_in[i]
    elif m is None and spec.kind == lay.SHARD:
      m = col.local_shard(p, spec, axis_name)
    elif m is None and spec.kind == lay.REPLICATE:
      m = p
    view.append(m)
  return view


def inner_step(inner: optax.GradientTransformation, layout: lay.Layout,
               skipped: jax.Array | None, extra_args: dict | None,
               grads: list, inner_state: Any, view: list,
               params_given: bool = True) -> tuple[list, Any]:
  """``([(new master, u) per leaf], new inner state)``: one inner update
  (``extra_args`` forwarded where it takes them; params None unless
  ``params_given``); where ``skipped`` (None: the loss scale never skips) is
  true, the old master and state and a zero ``u``. Leaf lists indexed like
  ``layout.leaves`` (None where static)."""
  view = layout.inner_tree(view)
  g_tree = layout.inner_tree(grads)
  handed = view if params_given else None
  if extra_args:   # forwarded where the inner update takes them
    updates, new_inner = optax.with_extra_args_support(inner).update(
        g_tree, inner_state, handed, **extra_args)
  else:
    updates, new_inner = inner.update(g_tree, inner_state, handed)
  new_view = optax.apply_updates(view, updates)
  if skipped is not None:
    keep = lambda old, new: jax.tree.map(
        lambda a, b: jnp.where(skipped, a, b), old, new)
    new_view = keep(view, new_view)
    new_inner = keep(inner_state, new_inner)
    updates = upd.zero_where(skipped, updates)
  u = jax.tree.map(lambda _, x: x, view, updates)   # view's structure
  # (new master, u) per leaf: offload's streaming carries them as one. Up to
  # the params' leaves: a None of the program's own (Equinox's filtered-out
  # leaves) is no leaf, where a static leaf's None is one.
  return list(zip(layout.treedef.flatten_up_to(new_view),
                  layout.treedef.flatten_up_to(u))), new_inner


def update(inner: optax.GradientTransformation, cfg: Any, layout: lay.Layout,
           state: Zero1State, grads: dict[int, jax.Array], params: Sequence,
           scaler: precision.LossScale, skipped: jax.Array,
           extra_args: dict | None = None, shards_in: dict | None = None,
           params_given: bool = True) -> tuple[list, Zero1State]:
  """``([(new master, u) per leaf], new state)``: stage 3 on the scaled
  gradient shards ``grads`` (``{leaf: shard}``), the loss scale advanced
  past this step; the inner optimizer handed params None unless
  ``params_given`` (``params`` then stand-ins, :mod:`.params_free`)."""
  stored = chk.check_master(state, layout, cfg.master_dtype)
  view = master_view(stored, params, layout, cfg.axis_name, shards_in)
  chk.check_state_shapes(inner, layout, state, stored, view)   # not whole
  g_list = [grads.get(i) for i in range(len(layout.leaves))]

  def step(g_list, inner_state, view):
    return inner_step(inner, layout,
                      skipped if scaler.skips_on_overflow else None,
                      extra_args, g_list, inner_state, view, params_given)

  if cfg.offload:   # one group of host-resident state at a time
    pairs, new_inner = ofl.streamed(
        step, layout, ofl.owners(inner, layout, cfg.master_dtype),
        g_list, state.inner, view, [m is not None for m in stored],
        int(cfg.bucket_bytes))
  else:
    pairs, new_inner = step(g_list, state.inner, view)
  masters = [m for m, _ in pairs]
  kept = ofl.masters_to_host(masters, layout) if cfg.offload else masters
  return pairs, Zero1State(master_tree(layout, cfg.master_dtype, kept),
                           new_inner, scaler.update(state.loss_scale, skipped))
