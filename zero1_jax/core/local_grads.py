"""This device's gradients inside ``z1.train_step``'s shard_map.

The batch arrives split into micro-batches (:func:`split_batch`); each
device differentiates the loss on its rows (:func:`local_grad_fn`: full,
unreduced gradients; stage 2: each leaf reduce-scattered in the backward,
:mod:`.zero2`) and sums them over the micro-batches in one loop
(:func:`local_grads`). :mod:`.step` wires them to ``tx.apply``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> x = split_batch({"x": jnp.ones((4, 3))}, 2, mesh, "data")["x"]
  >>> x.shape   # two micro-batches of two rows
  (2, 2, 3)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from zero1_jax.core import checks as chk
from zero1_jax.core import lookup
from zero1_jax.core import zero2
from zero1_jax.core.batch import batch_size


def split_batch(batch, accum: int, mesh, axis: str):
  """``(B, ...)`` -> ``(accum, B // accum, ...)`` sharded on dim 1, no row
  leaving its device: device d's block of the batch (its B / N rows, split
  over the data axis in device order) is cut into ``accum`` consecutive
  micro-batches, and micro-batch a holds the a-th of every device's, as
  DeepSpeed's ranks each accumulate their own rows. (Micro-batch a as the
  a-th consecutive block of all B rows moved (N - 1) / N of the batch
  between devices every step: an all-to-all and a collective-permute on 8
  GPUs.)"""
  n = mesh.shape[axis]
  b = batch_size(batch, accum, n)
  per = b // (accum * n)
  rows = NamedSharding(mesh, P(axis))
  sharding = NamedSharding(mesh, P(None, axis))

  def split(x):
    blocks, shape = (n, accum, per) + x.shape[1:], (accum, n * per) + x.shape[1:]
    if explicit(mesh):
      # Explicit axes: a reshape of a sharded dim must name its output sharding.
      # Host (unsharded) input comes out replicated: reshard slices locally.
      x = jax.lax.reshape(x, blocks, out_sharding=rows)
      x = jax.lax.reshape(jnp.swapaxes(x, 0, 1), shape, out_sharding=sharding)
      return jax.sharding.reshard(x, sharding)
    x = jnp.swapaxes(jax.lax.with_sharding_constraint(x.reshape(blocks), rows), 0, 1)
    return jax.lax.with_sharding_constraint(x.reshape(shape), sharding)

  return jax.tree.map(split, batch)


def explicit(mesh) -> bool:
  types = getattr(mesh, "axis_types", None) or ()
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def local_grad_fn(loss_fn: Callable, params: Any, axis: str,
                   tables: dict | None = None) -> Callable:
  """Stage 1: ``f(batch) -> (full local gradients, aux)``, unreduced. With
  ``tables`` ({leaf: this device's column block}, :mod:`.lookup`),
  ``loss_fn(params, tables, batch)`` and the gradients ``(of params, of
  tables)``: the tables' already summed over every device's tokens."""
  grad_fn = jax.grad(loss_fn, argnums=(0, 1) if tables else 0, has_aux=True,
                     allow_int=True)
  # Differentiate w.r.t. a varying view of the replicated params: the
  # gradients stay local and unreduced (under check_vma, the gradient of an
  # invariant input would be psum'd for us); zero1 reduces them itself.
  local = jax.tree.map(
      lambda x: jax.lax.pcast(x, axis, to="varying")
      if jnp.issubdtype(x.dtype, jnp.inexact) else x, params)

  def f(batch):
    if tables:
      (g, g_tables), aux = grad_fn(local, tables, batch)
    else:
      g, aux = grad_fn(local, batch)
    g = jax.tree.map(   # integer leaves: float0 -> zeros, never used
        lambda g, p: g if jnp.issubdtype(p.dtype, jnp.inexact)
        else jnp.zeros(p.shape, p.dtype), g, params)
    return ((g, g_tables) if tables else g), aux

  return f


def local_grads(s: Any, params, scale, batch, order=None, tables=None):
  """This device's gradients (stage 2: its reduced shards) summed over the
  micro-batches, with the loss and aux summed likewise; and the gradients of
  ``tables`` ({leaf: this device's column block whose row lookups it
  serves}, :mod:`.lookup`), summed over every device's tokens already."""
  accum = s.accum
  first = jax.tree.map(lambda x: x[0], batch)
  loss_of = (lookup.rewrite(s.loss_fn, params, first, leaves=tables,
                            axis=s.axis) if tables else s.loss_fn)

  def scaled_loss(*a):
    loss, aux = chk.split_loss(loss_of(*a), s.has_aux)
    return (loss * scale.astype(loss.dtype) / accum).astype(loss.dtype), (loss, aux)

  if s.hooks:
    # Each leaf's gradient is reduce-scattered as the backward produces
    # it: g holds this device's summed 1/N shards (None at static leaves).
    grad_fn = zero2.reduced_grad_fn(scaled_loss, params, s.tx.config, s.n,
                                    order, s.platform, tables)
  else:
    grad_fn = local_grad_fn(scaled_loss, params, s.axis, tables)

  def micro(carry, mb):
    g, (loss, aux) = grad_fn(mb)
    if carry is None:
      return g, loss, aux
    g0, l0, a0 = carry
    return (jax.tree.map(jnp.add, g0, g), l0 + loss,
            jax.tree.map(jnp.add, a0, aux))

  if accum == 1:
    carry = micro(None, first)
  else:
    # Every micro-batch in one loop, from zeros (0 + g is g: the same sums
    # as starting from the first). A first micro-batch outside the loop
    # left a loop of one at accum=2, which XLA inlines and then runs both
    # forwards before the backwards: 1.7x the activation memory (bert-tiny,
    # 45 vs 26 MB of temporaries), and two copies of the model to compile.
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                         jax.eval_shape(micro, None, first))
    carry, _ = jax.lax.scan(lambda c, mb: (micro(c, mb), None), zeros, batch)
  grads, loss, aux = carry
  grads, g_tables = grads if tables else (grads, {})
  metrics = {"loss": jax.lax.pmean(loss / accum, s.axis)}
  if s.has_aux and s.aux_reduce == "sum":
    metrics["aux"] = jax.lax.psum(aux, s.axis)
  elif s.has_aux:
    metrics["aux"] = jax.lax.pmean(jax.tree.map(lambda a: a / accum, aux),
                                   s.axis)
  return grads, g_tables, metrics
