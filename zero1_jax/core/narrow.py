"""Leaves the loss reads only in a narrower dtype, gathered in that dtype.

A model that keeps fp32 params and computes in bf16 (flax's
``Dense(dtype=jnp.bfloat16)``, lm1b, nanodo) casts each kernel to bf16
before it reads it: the cast is the param's only read. Gathering such a
leaf's stored shards (:meth:`zero1_jax.core.param_storage.Storage.gather`)
in bf16 and widening the whole leaf back to fp32 then hands the loss the
same bf16 values it would have made itself (bf16 -> fp32 -> bf16 is
exact), for half the gather's bytes: the step's results are bitwise those
of the fp32 gather. A leaf read any other way (a LayerNorm scale read in
fp32, a cast to a wider dtype, a read inside a loop, a custom derivative or
a shard_map, a leaf the loss returns) is gathered in its own dtype.

:func:`narrow_reads` finds them from the loss's jaxpr, following jitted
calls, ``jax.checkpoint`` and ops that only move values (slices, reshapes,
transposes, broadcasts, row lookups); a row lookup served from the stored
shard (:mod:`.lookup`; not inside ``jax.checkpoint``, which its rewrite
leaves as it is) is no read of the whole leaf.

Example:
  >>> import jax.numpy as jnp
  >>> loss = lambda p, x: jnp.sum(x.astype(jnp.bfloat16) @ p["w"].astype(
  ...     jnp.bfloat16)) + jnp.sum(p["b"])
  >>> p = {"b": jnp.zeros(3), "w": jnp.zeros((4, 3))}
  >>> narrow_reads(loss, p, jnp.ones((2, 4)))   # b is read in fp32
  {1: dtype(bfloat16)}
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zero1_jax.core import lookup

# Calls whose body runs once on the operands as given: followed. Anything
# else that takes a leaf (scan, while, cond, custom_jvp/vjp, shard_map) is a
# read in the leaf's own dtype: a custom rule or a loop body may read it
# unrounded.
_CALLS = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat",
          "remat2")
# Ops that move the leaf's values without arithmetic: a cast after them
# reads the same values as the cast before them (GPT-2's position table is
# sliced to the sequence, then cast). Followed, the leaf their first operand.
_MOVES = ("slice", "reshape", "transpose", "squeeze", "expand_dims",
          "broadcast_in_dim", "rev", "dynamic_slice", "gather", "copy",
          "copy_p")


def _body(eqn):
  sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  return getattr(sub, "jaxpr", sub)


def _reads(jaxpr, var, dtype: np.dtype, lookup_leaf: bool) -> set | None:
  """The dtypes ``var`` (a ``dtype`` leaf) is read as in ``jaxpr``: a set of
  narrower floating dtypes, or None where some read is not a cast to one."""
  if any(v is var for v in jaxpr.outvars):
    return None
  found: set = set()
  for eqn in jaxpr.eqns:
    for k, v in enumerate(eqn.invars):
      if v is not var:
        continue
      name = eqn.primitive.name
      if name == "convert_element_type":
        to = np.dtype(eqn.params["new_dtype"])
        if not (jnp.issubdtype(to, jnp.floating) and to.itemsize < dtype.itemsize):
          return None
        found.add(to)
      elif lookup_leaf and k == 0 and lookup.is_row_lookup(eqn):
        continue   # served from the stored shard, in its own dtype
      elif name in _MOVES and k == 0:
        inner = _reads(jaxpr, eqn.outvars[0], dtype, False)
        if inner is None:
          return None
        found |= inner
      elif name in _CALLS and _body(eqn) is not None and len(
          _body(eqn).invars) == len(eqn.invars):
        # lookup.rewrite serves row lookups inside the calls it follows
        # (not jax.checkpoint's): elsewhere they read the whole leaf.
        inner = _reads(_body(eqn), _body(eqn).invars[k], dtype,
                       lookup_leaf and name in lookup.CALLS)
        if inner is None:
          return None
        found |= inner
      else:
        return None
  return found


def narrow_reads(fn: Callable, params: Any, *args: Any,
                 candidates: Any = None,
                 lookups: frozenset = frozenset()) -> dict[int, np.dtype]:
  """``{leaf index: dtype}`` for the floating leaves of ``params``
  (``jax.tree.leaves`` order; among ``candidates`` if given) that
  ``fn(params, *args)`` reads only through casts to one narrower floating
  ``dtype``. ``params`` and ``args`` may be abstract. ``lookups``: leaves
  whose row lookups read their stored shard (:mod:`.lookup`)."""
  leaves, treedef = jax.tree.flatten(params)
  closed = jax.make_jaxpr(lambda p, *a: fn(treedef.unflatten(p), *a))(
      leaves, *args)
  out = {}
  for i, var in enumerate(closed.jaxpr.invars[:len(leaves)]):
    if candidates is not None and i not in candidates:
      continue
    dtype = np.dtype(jnp.result_type(leaves[i]))
    if not jnp.issubdtype(dtype, jnp.floating):
      continue
    found = _reads(closed.jaxpr, var, dtype, i in lookups)
    if found is not None and len(found) == 1:
      out[i] = found.pop()
  return out
