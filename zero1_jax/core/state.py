"""The state :func:`zero1_jax.zero1` keeps, and which leaves store a master.

Below both the transform (:mod:`.transform`) and the specs of its state
(:mod:`.specs`), so each can use it without importing the other.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from zero1_jax.core import layout as lay
from zero1_jax.core import precision


class Zero1State(NamedTuple):
  """State of :func:`zero1_jax.zero1`.

  Globally, each ``master`` leaf of a sharded parameter has the parameter's
  shape padded on its shard dim to a multiple of N and is sharded over the
  data axis there; inside shard_map it is this device's ``shard_shape`` piece.
  """

  master: Any                            # param-shaped shards, master dtype; None at static
                                         # leaves and where the param is in the master dtype
  inner: optax.OptState                  # the wrapped optimizer's state over the master shards
  loss_scale: precision.LossScaleState   # replicated scalars


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
