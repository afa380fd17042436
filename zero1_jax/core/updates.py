"""What :func:`zero1_jax.zero1`'s ``update`` returns as ``updates``, per leaf.

optax's ``update`` returns the inner optimizer's ``u``; loops log its norm,
its ratio to the params, or reuse it. zero1 gathers, for each leaf, one
param-dtype array of its 1/N shards (never both, so the gather moves the
bytes a parameter has):

* a parameter that is its own master (its dtype is its master dtype: fp32
  params, float64, complex; :func:`.state.stores_master` false): the inner
  optimizer's ``u`` itself (:func:`gathers_u`), bitwise what optax's update
  computes from the same gradients and state where the arithmetic is the
  same. ``optax.apply_updates(p, u)`` rounds ``p + u`` once, as optax does
  with a ``u`` it has in hand. (``tx.apply``, :func:`zero1_jax.train_step`'s
  path, adds ``u`` inside the update's own program, where XLA may contract
  its last multiply and the add into one fused multiply-add, as it does in
  an optax step jitted whole; those weights can differ by one rounding of
  the weight. Measured on XLA:CPU: 0.7% of the elements of
  ``p + (-0.01) * x``.)
* a parameter with a stored master (bf16/fp16): the new weights (the new
  master cast to the param dtype), returned as ``new - p`` in the param
  dtype (:func:`difference`). The inner ``u`` is an fp32 step of the master
  that the 16-bit param cannot represent; ``apply_updates(p, new - p)``
  gives the cast master exactly wherever a step at most doubles or halves a
  weight (Sterbenz), else within one rounding of the update.

Example:
  >>> import jax.numpy as jnp
  >>> from zero1_jax.core import layout as lay
  >>> w = lay.plan({"w": jnp.zeros((4, 3))}, 2).leaves[0]
  >>> gathers_u(w, jnp.float32, jnp.float32, jnp.float32)
  True
  >>> h = lay.plan({"h": jnp.zeros((4, 3), jnp.bfloat16)}, 2).leaves[0]
  >>> gathers_u(h, jnp.bfloat16, jnp.float32, jnp.float32)
  False
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zero1_jax.core import layout as lay
from zero1_jax.core.state import stores_master


def gathers_u(spec: lay.LeafSpec, param_dtype: Any, u_dtype: Any,
              master_dtype: Any) -> bool:
  """Whether ``update`` returns the inner ``u`` at this leaf: trainable, its
  own master, and ``u`` no wider than the param (a wider ``u``, float64 in
  x64 mode on fp32 params, would round twice through the param dtype; the
  new weights are gathered there instead)."""
  return (spec.kind != lay.STATIC and not stores_master(spec, master_dtype)
          and jnp.promote_types(param_dtype, u_dtype) == jnp.dtype(param_dtype))


def difference(new: Any, p: Any) -> jax.Array:
  """``new - p`` in ``p``'s dtype (zeros for integer params); computed in at
  least float32, so for 16-bit params it is exact where a step at most
  doubles or halves the weight. The master never reads the params back, so
  nothing accumulates."""
  p = jnp.asarray(p)
  if not lay.trainable(p.dtype):
    return jnp.zeros_like(p)
  wide = jnp.promote_types(p.dtype, jnp.float32)
  return (new.astype(wide) - p.astype(wide)).astype(p.dtype)


def zero_where(skipped: jax.Array, u: Any) -> Any:
  """``u`` with every leaf zero where the step was skipped (an overflow):
  what optax's ``apply_if_finite`` returns for a skipped step."""
  return jax.tree.map(lambda x: jnp.where(skipped, jnp.zeros_like(x), x), u)
