"""A linen language model sharded by logical axis rules (lm1b-style program).

  python -m experiments.examples.linen_lm           # 8 simulated CPU devices
  python -m experiments.examples.linen_lm --optax   # the same with plain optax

Written as a Flax user writes a sharded LM: params annotated with
``nn.with_logical_partitioning``, logical axis rules, the state's shardings
derived from its annotations (``jax.eval_shape`` -> ``nn.get_partition_spec``
-> ``nn.logical_to_mesh_sharding``), flax's ``TrainState`` in a ``jax.jit``
with those in/out shardings, and an orbax checkpoint. The only zero1 line is
the optimizer's construction (:func:`make_tx`).
"""

from __future__ import annotations

import os

if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

VOCAB, EMBED, MLP, SEQ = 64, 32, 64, 8
# Logical name -> mesh axis; names without a rule are unsharded.
RULES = (("batch", "data"), ("vocab", "model"), ("mlp", "model"),
         ("embed", None), ("length", None))


def _init(names):
  return nn.with_logical_partitioning(nn.initializers.normal(0.1), names)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(scale_init=nn.with_logical_partitioning(
        nn.initializers.ones, ("embed",)), use_bias=False)(x)
    h = nn.Dense(MLP, kernel_init=_init(("embed", "mlp")),
                 bias_init=nn.with_logical_partitioning(nn.initializers.zeros,
                                                        ("mlp",)))(h)
    h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
    return x + nn.Dense(EMBED, kernel_init=_init(("mlp", "embed")),
                        use_bias=False)(h)


class LM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, EMBED, embedding_init=_init(("vocab", "embed")))
    x = embed(tokens)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    for _ in range(2):
      x = Block()(x)
    return embed.attend(x)   # tied output embedding


def make_tx(use_zero1: bool, mesh):
  tx = optax.adamw(3e-3, weight_decay=0.01)
  if not use_zero1:
    return tx
  import zero1_jax as z1
  return z1.zero1(tx, axis_name="data", mesh=mesh)   # the one zero1 line


def loss_fn(params, apply_fn, tokens):
  logits = apply_fn({"params": params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]).mean()


def setup(use_zero1: bool, mesh):
  """(state, step, state_shardings, data_sharding) for ``mesh``."""
  model = LM()
  tx = make_tx(use_zero1, mesh)

  def init_state(rng):
    params = model.init(rng, jnp.zeros((1, SEQ), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=tx)

  rng = jax.random.key(0)
  with nn.logical_axis_rules(RULES):        # shardings from the annotations,
    abstract = jax.eval_shape(init_state, rng)   # before any mesh is set
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract),
                                          mesh, RULES)
  data = NamedSharding(mesh, P("data"))

  def train_step(state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn,
                                              tokens)
    return state.apply_gradients(grads=grads), loss

  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    state = jax.jit(init_state, out_shardings=shardings)(rng)
  step = jax.jit(train_step, in_shardings=(shardings, data),
                 out_shardings=(shardings, None), donate_argnums=0)
  return state, step, shardings, data


def batches(k: int, rows: int = 16):
  r = np.random.default_rng(0)
  return [r.integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)
          for _ in range(k)]


def train(state, step, data, mesh, k: int):
  losses = []
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    for tokens in batches(k):
      state, loss = step(state, jax.device_put(tokens, data))
      losses.append(float(loss))
  return state, losses


def save_restore(state, shardings, path: str):
  """Saves ``state`` with orbax and restores it onto ``shardings``."""
  import orbax.checkpoint as ocp
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, state)
  ckpt.wait_until_finished()
  del shardings   # the arrays carry them (jit's out_shardings)
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)
  return ckpt.restore(path, target)


def main(use_zero1: bool = True, steps: int = 20):
  mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  state, step, _, data = setup(use_zero1, mesh)
  state, losses = train(state, step, data, mesh, steps)
  opt = sum(x.addressable_shards[0].data.nbytes
            for x in jax.tree.leaves(state.opt_state))
  print(f"{'zero1' if use_zero1 else 'optax'}: loss {losses[0]:.4f} -> "
        f"{losses[-1]:.4f}, optimizer state {opt} B on device 0")


if __name__ == "__main__":
  import sys
  main(use_zero1="--optax" not in sys.argv)
