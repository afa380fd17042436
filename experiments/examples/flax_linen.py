"""A Flax linen model trained with zero1_jax's TrainState in a shard_map step.

  python -m experiments.examples.flax_linen   # 4 simulated CPU devices

The step is ordinary Flax: compute this device's gradients on its slice of
the batch, call ``state.apply_gradients``. zero1 reduce-scatters them,
updates this device's shard of the fp32 master and Adam moments, and
all-gathers the new weights.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zero1_jax as z1  # noqa: E402
import zero1_jax.flax as z1flax  # noqa: E402


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(64)(x))
    return nn.Dense(1)(x)


def main(steps: int = 200) -> float:
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  model = MLP()
  params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
  tx = z1.zero1(optax.adamw(3e-3, weight_decay=1e-4), axis_name="data",
                max_grad_norm=1.0)
  state = z1flax.TrainState.create(apply_fn=model.apply, params=params, tx=tx,
                                   mesh=mesh)
  specs = z1flax.state_specs(state, mesh)

  def loss_fn(p, batch):
    pred = state.apply_fn({"params": p}, batch["x"])[:, 0]
    return jnp.mean((pred - batch["y"]) ** 2)

  def per_device(state, batch):
    local = jax.lax.pcast(state.params, "data", to="varying")  # local grads
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    return state.apply_gradients(grads=grads), jax.lax.pmean(loss, "data")

  # z1.bounded: at most 8 steps in flight on simulated CPU devices. This loop
  # reads a loss every 50 steps; under load 50 queued steps deadlocked XLA's
  # CPU client, which aborts the process (docs/cpu_rendezvous.md).
  step = z1.bounded(jax.jit(jax.shard_map(
      per_device, mesh=mesh, in_specs=(specs, P("data")),
      out_specs=(specs, P())), donate_argnums=0))
  rng = np.random.default_rng(0)
  w = rng.normal(size=8)
  for i in range(steps):
    x = rng.normal(size=(64, 8)).astype(np.float32)
    batch = {"x": x, "y": np.sin(x @ w).astype(np.float32)}
    state, loss = step(state, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    if i % 50 == 0 or i == steps - 1:
      print(f"step {i:4d} loss {float(loss):.4f}")
  return float(loss)


if __name__ == "__main__":
  main()
