"""The chain that orders the backward hooks' collectives, and what it carries.

On GPUs the hooks' reduce-scatters (:func:`zero1_jax.core.zero2.reduce_hook`)
are chained group after group: a scalar *token* passes the hooks in the
forward's order, so its cotangent passes them in the backward's, and each
hook's backward lets its collective start only after the group before it
has arrived (:func:`chained`). XLA otherwise queues them all at the
backward's end.

Across hosts the chain is kept whole to the step's end, and its token's
cotangent carries the loss summed over the devices (:func:`carry_sum`):
that all-reduce runs as the backward starts, where the network is idle,
instead of after the last gather (a lone scalar over the network: 170 µs
of XLA's cost model on 2 hosts of H100s; each of BERT-base's and GPT-2's
steps at 16 to 64 GPUs 33-530 µs shorter, docs/gpu.md). The sum is the same as
``jax.lax.psum`` of the loss: the barriers it passes are identities.

Example:
  >>> import jax, jax.numpy as jnp
  >>> f = lambda x, tok: carry_sum("i")(jnp.sum(x ** 2), tok)
  >>> g = jax.vmap(jax.grad(f, argnums=1), in_axes=(0, None), axis_name="i")
  >>> g(jnp.arange(4.0).reshape(2, 2), jnp.zeros(()))   # 0+1 and 4+9, summed
  Array([14., 14.], dtype=float32)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def chained(reduce: Callable, waits: bool) -> Callable:
  """A hook ``hook(params, slots, token) -> (params, token)`` whose backward
  reduces the params' cotangents with ``reduce`` (the slots get the result):
  the token's cotangent arrives with the earlier hooks' reduced shards behind
  it and leaves with this one's too; with ``waits`` this one's collective
  starts only after them."""

  @jax.custom_vjp
  def hook(ps, slots, tok):
    del slots
    return ps, tok

  def fwd(ps, slots, tok):
    del slots
    return (ps, tok), None

  def bwd(_, cts):
    cts, done = cts
    if waits:
      cts, done = jax.lax.optimization_barrier((cts, done))
    # The shards leave through the barrier: their users, and the next
    # group's collective, then wait for this one's.
    done, out = jax.lax.optimization_barrier((done, reduce(cts)))
    return None, out, done

  hook.defvjp(fwd, bwd)
  return hook


def token() -> jax.Array:
  """The chain's token, a zero: float32, or float64 where jax has it on
  (every float loss's dtype converts to it and back exactly)."""
  return jnp.zeros((), jax.dtypes.canonicalize_dtype(jnp.float64))


def first_through(bwd: Callable, keep_first: bool = False) -> Callable:
  """``f(a, b) -> a``, whose backward is ``bwd(a or None, ct) -> (a's
  cotangent, b's)``: ``a`` is kept for it with ``keep_first``. The shape of
  every hook here: the forward passes one input through, the backward hands
  the other one what it computed (reduced shards, a sum)."""

  @jax.custom_vjp
  def f(a, b):
    del b
    return a

  def fwd(a, b):
    del b
    return a, (a if keep_first else None)

  f.defvjp(fwd, bwd)
  return f


def carry_sum(axis_name: str) -> Callable:
  """``f(loss, tok) -> loss`` whose backward gives ``tok`` the cotangent
  ``psum(loss)`` (in the token's dtype; the loss's own in the sum): the
  first thing the backward does, so the chain after it carries the sum."""
  return first_through(
      lambda loss, ct: (ct, jax.lax.psum(loss, axis_name).astype(token().dtype)),
      keep_first=True)


def tie(aux: Any, done: jax.Array) -> Any:
  """``aux`` with ``0 * done`` added to its first floating leaf (its value
  unchanged: ``done`` is the chain's token, a zero), so that the chain's
  last link has a user."""
  leaves, treedef = jax.tree.flatten(aux)
  for k, x in enumerate(leaves):
    if jnp.issubdtype(jnp.result_type(x), jnp.floating):
      leaves[k] = x + (0 * done).astype(jnp.result_type(x))
      return treedef.unflatten(leaves)
  raise ValueError("the chain's token needs a floating leaf in aux "
                   "(z1.value_and_grad's loss)")
