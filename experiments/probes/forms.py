"""The ways to train with zero1, side by side: optimizer-state bytes per
device and gradient/weight traffic per step, read from the compiled step.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.probes.forms

Model: a stock Flax MLP (Dense layers with biases), fp32, Adam, N=8, global
batch 64. Traffic is the ZeRO paper's per-device volume (all-reduce counts
2x its buffer; zinspect.Collective.traffic) summed over the step's
collectives; Psi is the parameter bytes.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zero1_jax as z1  # noqa: E402
from zero1_jax import inspect as zinspect  # noqa: E402

N = 8


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for width in (256, 256):
      x = jnp.tanh(nn.Dense(width)(x))
    return nn.Dense(16)(x)


MODEL = MLP()


def loss(p, x, y):
  return jnp.mean((MODEL.apply({"params": p}, x) - y) ** 2)


def _trainstate(mesh, tx, grad_of):
  params = MODEL.init(jax.random.key(0), jnp.ones((1, 64)))["params"]
  state = train_state.TrainState.create(apply_fn=MODEL.apply, params=params,
                                        tx=tx)

  def step(state, x, y):
    _, g = grad_of(tx)(state.params, x, y)
    return state.apply_gradients(grads=g)
  return jax.jit(step), state


def main() -> None:
  mesh = jax.make_mesh((N,), ("data",))
  r = np.random.default_rng(0)
  batch = jax.device_put((r.normal(size=(64, 64)).astype(np.float32),
                          r.normal(size=(64, 16)).astype(np.float32)),
                         NamedSharding(mesh, P("data")))
  jaxgrad = lambda tx: jax.value_and_grad(loss)
  zgrad = lambda tx: z1.value_and_grad(loss, tx, batch_argnums=(1, 2))
  rows = []
  with jax.set_mesh(mesh):
    forms = [
        ("optax (plain data parallel)", optax.adam(1e-3), jaxgrad),
        ("z1.zero1 + jax.value_and_grad", z1.zero1(optax.adam(1e-3),
                                                   axis_name="data"), jaxgrad),
        ("z1.zero1 + z1.value_and_grad", z1.zero1(optax.adam(1e-3),
                                                  axis_name="data"), zgrad),
        ("z1.zero2 + z1.value_and_grad", z1.zero2(optax.adam(1e-3),
                                                  axis_name="data"), zgrad),
    ]
    for name, tx, grad_of in forms:
      step, state = _trainstate(mesh, tx, grad_of)
      compiled = step.lower(state, *batch).compile()
      rows.append((name, zinspect.device_bytes(state.opt_state),
                   zinspect.collectives(compiled)))
  params = MODEL.init(jax.random.key(0), jnp.ones((1, 64)))["params"]
  for name, make in (("z1.train_step (zero1)", z1.zero1),
                     ("z1.train_step (zero2)", z1.zero2)):
    tx = make(optax.adam(1e-3), axis_name="data")
    p, s = z1.init(tx, params, mesh)
    step = z1.train_step(lambda q, b: loss(q, *b), tx, mesh)
    rows.append((name, zinspect.device_bytes(s),
                 zinspect.collectives(step.lower(p, s, batch).compile())))
  psi = sum(x.size for x in jax.tree.leaves(params)) * 4
  print(f"Psi = {psi:,} B (fp32 params), N = {N}")
  print("| form | optimizer state per device | collectives (bytes) | traffic / Psi |")
  print("|---|---|---|---|")
  for name, state_bytes, coll in rows:
    kinds = ", ".join(f"{k} {v.bytes:,}" for k, v in coll.items())
    traffic = sum(v.traffic for v in coll.values()) / psi
    print(f"| {name} | {state_bytes:,} B | {kinds} | {traffic:.2f} |")


if __name__ == "__main__":
  main()
