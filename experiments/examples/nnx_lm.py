"""An nnx language model with ``nnx.Optimizer`` on an Explicit 2-D mesh.

  python -m experiments.examples.nnx_lm           # 8 simulated CPU devices
  python -m experiments.examples.nnx_lm --optax   # the same with plain optax

Written as flax's nnx guides shard a model: params created sharded by
``nnx.with_partitioning`` (tensor parallelism over ``"model"``, size 1 by
default as in many real programs), the model and optimizer built under the
mesh, and the optimizer state constrained in the step to
``nnx.get_partition_spec`` of itself. The only zero1 line is the
optimizer's construction (:func:`make_tx`).
"""

from __future__ import annotations

import os

if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

VOCAB, EMBED, MLP, SEQ = 64, 32, 64, 8


class LM(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.1)
    self.embed = nnx.Param(init(rngs.params(), (VOCAB, EMBED)))
    self.up = nnx.Linear(EMBED, MLP, rngs=rngs, kernel_init=
                         nnx.with_partitioning(init, (None, "model")),
                         bias_init=nnx.with_partitioning(
                             nnx.initializers.zeros, ("model",)))
    self.down = nnx.Linear(MLP, EMBED, rngs=rngs, use_bias=False, kernel_init=
                           nnx.with_partitioning(init, ("model", None)))

  def __call__(self, tokens):
    # One-hot lookup: a gather on Explicit axes needs an out_sharding.
    x = jax.nn.one_hot(tokens, VOCAB) @ self.embed[...]
    # Megatron MLP: up column-parallel, down row-parallel (its contraction
    # over "model" is summed into a batch-sharded output).
    h = nnx.gelu(self.up(x))
    explicit = jax.sharding.get_abstract_mesh().are_all_axes_explicit
    x = x + self.down(h, out_sharding=P("data") if explicit else None)
    return x @ self.embed[...].T   # tied output embedding


def make_tx(use_zero1: bool):
  tx = optax.adam(3e-3)
  if not use_zero1:
    return tx
  import zero1_jax as z1
  return z1.zero1(tx, axis_name="data")   # the one zero1 line


def loss_fn(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]).mean()


def make_mesh(model_size: int = 1, kind=jax.sharding.AxisType.Explicit):
  return jax.make_mesh((jax.device_count() // model_size, model_size),
                       ("data", "model"), axis_types=(kind,) * 2)


def setup(use_zero1: bool, mesh, constrain: bool = True):
  """(model, optimizer, step) built under ``mesh``. ``constrain``: the step
  constrains the optimizer state to its own ``nnx.get_partition_spec``."""
  with jax.set_mesh(mesh):
    model = LM(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_tx(use_zero1), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    if constrain:
      state = nnx.state(optimizer)
      nnx.update(optimizer, jax.lax.with_sharding_constraint(
          state, nnx.get_partition_spec(state)))
    return loss

  return model, optimizer, step


def batches(k: int, rows: int = 16):
  r = np.random.default_rng(0)
  return [r.integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)
          for _ in range(k)]


def train(model, optimizer, step, mesh, k: int):
  losses = []
  with jax.set_mesh(mesh):
    for tokens in batches(k):
      x = jax.device_put(tokens, NamedSharding(mesh, P("data")))
      losses.append(float(step(model, optimizer, x)))
  return losses


def state_bytes(optimizer) -> int:
  """Bytes of the optimizer state on device 0."""
  return sum(x.addressable_shards[0].data.nbytes
             for x in jax.tree.leaves(nnx.state(optimizer, nnx.optimizer.OptState)))


def main(use_zero1: bool = True, steps: int = 20):
  mesh = make_mesh(2)
  model, optimizer, step = setup(use_zero1, mesh)
  losses = train(model, optimizer, step, mesh, steps)
  print(f"{'zero1' if use_zero1 else 'optax'}: loss {losses[0]:.4f} -> "
        f"{losses[-1]:.4f}, optimizer state {state_bytes(optimizer)} B on "
        f"device 0")


if __name__ == "__main__":
  import sys
  main(use_zero1="--optax" not in sys.argv)
