"""``zero2()``: ZeRO Stage 2, gradients reduce-scattered inside the backward pass.

Stage 2 is stage 1's optimizer (same state, same update math) fed by a
different gradient path. :func:`zero1_jax.train_step` with a stage-2
transformation differentiates the loss through one identity *hook* per
parameter leaf (:func:`reduce_hook`). The hook's forward returns the full
parameter; its backward rule receives that leaf's complete cotangent, the
moment the backward pass has produced it, and reduce-scatters it at once
(rank-major view, :func:`zero1_jax.core.collectives.rank_major`): each device
keeps only its 1/N shard, handed as the cotangent of a shard-shaped zero
*slot* that is what ``jax.grad`` differentiates. The parameter's own
cotangent is never asked for, so no full gradient tree is alive at once:
XLA frees each leaf's gradient as soon as its reduce-scatter has consumed it.

With accumulation the scan's carry holds the 1/N shards (each micro-batch's
gradients are reduce-scattered in its own backward, as DeepSpeed's stage 2
does). The update then starts from those summed shards
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
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from zero1_jax.core import collectives as col
from zero1_jax.core import layout as lay
from zero1_jax.core.transform import Zero1Config, Zero1Transformation, zero1


def zero2(inner: optax.GradientTransformation, *, axis_name: str,
          **kwargs: Any) -> Zero1Transformation:
  """ZeRO Stage 2: :func:`zero1_jax.zero1`'s sharded optimizer, with
  gradients reduce-scattered while the backward pass produces them.

  Takes exactly :func:`zero1_jax.zero1`'s keywords (its signature is this
  function's ``__signature__``) and means the same by them, except
  ``bucket_bytes``: :func:`zero1_jax.train_step` reduces each leaf on its own
  as its gradient appears (one collective a leaf; GPU backends combine them),
  so it applies only to ``tx.update`` called directly. ``tx.update`` inside
  a user's own shard_map is stage 1's (it is handed whole local gradients,
  so there is nothing left to shard).

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


def reduce_hook(spec: lay.LeafSpec, n: int, axis_name: str, dtype: Any,
                all_reduce: bool = False) -> Callable:
  """``hook(param, slot) -> param`` whose backward reduces the cotangent.

  ``slot`` is a zero of ``spec.shard_shape`` (scalar leaves: of shape ())
  in ``dtype``; its cotangent is this device's shard of the sum over
  ``axis_name`` of the parameter's cotangent. The parameter gets no
  cotangent (None: a zero that is never built).
  """

  def reduce(ct):
    ct = ct.astype(dtype)
    if spec.kind == lay.REPLICATE:
      return jax.lax.psum(ct, axis_name)
    m = col.rank_major(ct, spec, n)
    if all_reduce:   # DeepSpeed's reduce_scatter: false
      mine = jax.lax.dynamic_index_in_dim(
          jax.lax.psum(m, axis_name), jax.lax.axis_index(axis_name), 0,
          keepdims=False)
    else:
      mine = jax.lax.psum_scatter(m, axis_name, scatter_dimension=0,
                                  tiled=True)
    return mine.reshape(spec.shard_shape)

  @jax.custom_vjp
  def hook(p, slot):
    del slot
    return p

  def fwd(p, slot):
    del slot
    return p, None

  def bwd(_, ct):
    return None, reduce(ct)

  hook.defvjp(fwd, bwd)
  return hook


def reduced_grad_fn(loss_fn: Callable, params: Any, cfg: Zero1Config,
                    n: int) -> Callable:
  """``f(batch) -> (grads, aux)`` for ``jax.grad(loss_fn, has_aux=True)``
  with every leaf's gradient reduced in the backward pass.

  ``grads`` has ``params``' structure: this device's shard (``shard_shape``)
  of the gradient summed over the axis at SHARD leaves, the summed scalar at
  REPLICATE leaves, None at STATIC leaves. Runs inside shard_map.
  """
  layout = lay.plan(params, n)
  p_leaves = jax.tree.leaves(params)
  hooks, slots = [], []
  for spec in layout.leaves:
    if spec.kind == lay.STATIC:
      hooks.append(None)
      slots.append(None)
      continue
    dt = comm_dtype(spec, cfg)
    hooks.append(reduce_hook(spec, n, cfg.axis_name, dt,
                             cfg.reduce == "all_reduce"))
    slots.append(jnp.zeros(spec.shard_shape, dt))

  def through_hooks(slots, batch):
    hooked = [p if h is None else h(p, s)
              for h, p, s in zip(hooks, p_leaves, slots)]
    return loss_fn(layout.treedef.unflatten(hooked), batch)

  grad = jax.grad(through_hooks, has_aux=True)

  def f(batch):
    g, aux = grad(slots, batch)
    return layout.treedef.unflatten(g), aux

  return f
