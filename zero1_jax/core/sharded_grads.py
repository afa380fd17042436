"""``ShardedGrads``: gradients already reduced to each device's shard.

:func:`zero1_jax.value_and_grad` returns them in plain ``jax.jit`` code: per
parameter leaf, the gradient summed over the data axis, as the global array
whose block on each device is that device's shard (zero1's layout: the
parameter's shape padded on its shard dim to a multiple of N, sharded over
the data axis there; scalars whole; None at integer and zero-size leaves).
They are made to be handed to ``tx.update`` (``TrainState.apply_gradients``,
``nnx.Optimizer.update``), which then reduces nothing: the gradients' only
collective was the backward's reduce-scatter.

Example:
  >>> import jax.numpy as jnp
  >>> g = ShardedGrads({"w": jnp.ones(4)})
  >>> import jax; jax.tree.leaves(g)
  [Array([1., 1., 1., 1.], dtype=float32)]
"""

from __future__ import annotations

from typing import Any, Mapping

import jax


@jax.tree_util.register_pytree_node_class
class ShardedGrads:
  """A tree of reduced gradient shards (see the module docstring)."""

  def __init__(self, tree: Any):
    self.tree = tree

  def tree_flatten(self):
    return (self.tree,), None

  @classmethod
  def tree_unflatten(cls, _, children):
    return cls(children[0])

  # Key lookups as on the gradient dict, so code that inspects its grads
  # (TrainState.apply_gradients looks for flax's overwrite-with-gradient
  # collection) works; a sub-tree is still ShardedGrads.
  def __contains__(self, key) -> bool:
    return isinstance(self.tree, Mapping) and key in self.tree

  def __getitem__(self, key) -> "ShardedGrads":
    return ShardedGrads(self.tree[key])

  def __repr__(self) -> str:
    return f"ShardedGrads({self.tree!r})"
