"""``tx.update(grads, state)`` without params, as optax's ``update`` takes it
for optimizers that never read them (``optax.adam``, ``sgd``; Equinox's and
optax's own examples call it so).

Where every trainable parameter is its own master (float32, float64, complex
params: :func:`.state.stores_master` false), ``tx.update`` returns the inner
optimizer's ``u`` gathered (:mod:`.updates`): it needs the params' shapes,
dtypes and placement, not their values. The gradients, which ``jax.grad``
gives the params' structure, shapes and dtypes, stand in for them in the
plan, and the inner optimizer is handed ``params=None`` as optax's would be:
one that reads them (``optax.adamw``'s weight decay) raises optax's own
error. A parameter with a stored master (bf16 / fp16) needs them: its update
is ``new - params`` (:func:`.updates.difference`), and zero1 says so.

Example:
  >>> import jax.numpy as jnp
  >>> stand_in({"w": jnp.ones(3)}, jnp.float32)["w"].shape
  (3,)
  >>> stand_in({"w": jnp.ones(3, jnp.bfloat16)}, jnp.float32)
  Traceback (most recent call last):
  ...
  ValueError: zero1: update needs params here: tx.update(grads, state, params). ...
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from zero1_jax.core import layout as lay
from zero1_jax.core import updates as upd
from zero1_jax.core.state import Zero1State

NEEDS_PARAMS = (
    "zero1: update needs params here: tx.update(grads, state, params). {why} "
    "Without params zero1 returns the inner optimizer's updates only where "
    "each parameter is its own master (float32, float64, complex params) and "
    "the inner optimizer does not read them (optax.adam does not; adamw "
    "does).")


def stand_in(grads: Any, master_dtype: Any) -> Any:
  """``grads``, standing for the params in an update called without them;
  ValueError where a gradient's dtype says its param keeps a stored master
  (its update is ``new - params``)."""
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    dt = lay.leaf_dtype(g)
    if lay.trainable(dt) and np.dtype(lay.master_dtype(dt, master_dtype)) != dt:
      raise ValueError(NEEDS_PARAMS.format(why=(
          f"grads{jax.tree_util.keystr(path)} is {dt.name}: its param keeps "
          f"a {np.dtype(master_dtype).name} master, and its update is the "
          f"new weights minus params.")))
  return grads


def check_state(state: Any, grads: Any) -> None:
  """ValueError unless ``state`` (boxes stripped) is zero1's, built for
  params of ``grads``' structure, and keeps no master: a stored master means
  a bf16 / fp16 param, whose update needs it."""
  if not isinstance(state, Zero1State):
    raise ValueError(
        f"zero1: update's state is not zero1's but a {type(state).__name__}: "
        f"pass the state this optimizer's init returned (or the last "
        f"update's).")
  none = lambda x: x is None   # the master holds None where params do
  built_for = jax.tree.structure(state.master, is_leaf=none)
  got = jax.tree.structure(grads, is_leaf=none)
  if built_for != got:
    raise ValueError(
        f"zero1: update's grads are not of the params' structure this state "
        f"was built for: grads {got}, the state's params {built_for}.")
  if jax.tree.leaves(state.master):
    raise ValueError(NEEDS_PARAMS.format(why=(
        "The state keeps a master copy of some params (bf16 / fp16 params), "
        "and their update is the new weights minus params.")))


def check_u(pairs: Sequence[tuple], p_leaves: Sequence, layout: lay.Layout,
            master_dtype: Any) -> None:
  """ValueError unless every trainable leaf's update is the inner ``u``
  itself (:func:`.updates.gathers_u`): an update computed from params is
  not possible without them."""
  for (_, u), p, spec in zip(pairs, p_leaves, layout.leaves):
    if spec.kind == lay.STATIC or u is None:
      continue
    if not upd.gathers_u(spec, p.dtype, jax.numpy.result_type(u),
                         master_dtype):
      raise ValueError(NEEDS_PARAMS.format(why=(
          f"The inner optimizer's update is {jax.numpy.result_type(u)} for "
          f"a {np.dtype(p.dtype).name} parameter: wider, so zero1 returns "
          f"the new weights minus params there.")))
