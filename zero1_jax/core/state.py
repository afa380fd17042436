"""The state :func:`zero1_jax.zero1` keeps, and which leaves store a master.

Below both the transform (:mod:`.transform`) and the specs of its state
(:mod:`.specs`), so each can use it without importing the other.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zero1_jax.core import layout as lay
from zero1_jax.core import precision


class Zero1State(NamedTuple):
  """State of :func:`zero1_jax.zero1`.

  Globally, each ``master`` leaf of a sharded parameter has the parameter's
  shape padded on its shard dim to a multiple of N and is sharded over the
  data axis there; inside shard_map it is this device's ``shard_shape`` piece.

  It reads like the inner optimizer's state: an attribute it does not have
  is the inner state's (``opt_state.hyperparams["learning_rate"]`` of
  ``inject_hyperparams``, ``opt_state.gradient_step`` / ``mini_step`` /
  ``acc_grads`` of ``optax.MultiSteps``), and setting a hyperparameter in
  that dict sets it in ``inner``. Scalars read as optax holds them;
  parameter-shaped leaves (``acc_grads``, moments) as zero1 holds them,
  padded at the end of their shard dim to a multiple of N with zeros and
  sharded over the data axis, so a mean over one counts the padding (reading
  one says so, once per name); ``z1.inner_state(tx, opt_state,
  params)`` gives them at the parameters' shapes.
  """

  master: Any                            # param-shaped shards, master dtype; None at static
                                         # leaves and where the param is in the master dtype
  inner: optax.OptState                  # the wrapped optimizer's state over the master shards
  loss_scale: precision.LossScaleState   # replicated scalars

  def __getattr__(self, name: str) -> Any:
    # Only reached for names the NamedTuple lacks: the inner state's.
    if name.startswith("__") or name in ("_fields", "_field_defaults"):
      raise AttributeError(name)
    inner = tuple.__getitem__(self, 1)
    try:
      value = getattr(inner, name)
    except AttributeError:
      raise AttributeError(
          f"'Zero1State' object has no attribute {name!r}, nor has its inner "
          f"optimizer's state ({type(inner).__name__}) (opt_state.inner; "
          f"z1.inner_state(tx, opt_state, params) as optax holds it)") from None
    _warn_if_param_shaped(name, value)
    return value

  @property
  def count(self) -> Any:
    """The inner state's ``count`` (optax's step counts are so named); it
    shadows ``tuple.count``, which no optimizer state is read by."""
    return self.__getattr__("count")


_SAID: set = set()


def _warn_if_param_shaped(name: str, value: Any) -> None:
  """Once per name: ``value`` holds arrays of rank >= 1 (parameter-shaped
  leaves, which zero1 pads and shards)."""
  if name in _SAID or not any(
      len(getattr(x, "shape", ())) for x in jax.tree.leaves(value)):
    return
  _SAID.add(name)
  warnings.warn(
      f"zero1: opt_state.{name} reads the inner optimizer's state as zero1 "
      f"holds it: each parameter-shaped leaf is padded at the end of its "
      f"shard dim to a multiple of N (zeros: a mean over it counts them) and "
      f"sharded over the data axis. z1.inner_state(tx, opt_state, "
      f"params).{name} gives it at the parameters' shapes.", UserWarning,
      stacklevel=3)


def stores_master(spec: lay.LeafSpec, master_dtype: Any) -> bool:
  """Whether a leaf keeps a separate master shard in :class:`Zero1State`:
  trainable (not static) and not already in its master dtype
  (:func:`.layout.master_dtype`: float32 for bf16/fp16 params, the param's
  own for float32, float64 and complex ones). A parameter in its master dtype
  is replicated and bitwise equal to its last update on every device, so its
  own shard is the master."""
  return (spec.kind != lay.STATIC
          and jnp.dtype(spec.dtype) != lay.master_dtype(spec.dtype,
                                                        master_dtype))


def master_tree(layout: lay.Layout, master_dtype: Any, values) -> Any:
  """``Zero1State.master`` from one value per leaf: None wherever
  :func:`stores_master` is false."""
  return layout.treedef.unflatten(
      [v if stores_master(s, master_dtype) else None
       for s, v in zip(layout.leaves, values)])
