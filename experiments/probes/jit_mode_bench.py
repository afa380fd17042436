"""Plain-jit ZeRO-1 (flax TrainState under jax.set_mesh) vs z1.train_step.

  python -m experiments.probes.jit_mode_bench [--steps 30] [--width 512] [--bf16]

One run, one model, one batch, three forms of the same Adam step:
  train_step  z1.init + z1.train_step (shard_map; reduce-scatter of local grads)
  jit         flax TrainState.create / apply_gradients in jax.jit, plain
              replicated params (jit all-reduces the grads, zero1 slices)
  jit+reduced the same with z1.reduced_params (grads unreduced: one
              reduce-scatter per bucket, no all-reduce)
Prints per-step time (median over --steps after one warm-up step), the
compiled step's memory_analysis (per device) and its collectives, and the
largest difference between the three forms' weights after the run. Params
and state are donated in all three.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zero1_jax as z1  # noqa: E402


def init_params(width: int, depth: int, dtype) -> dict:
  r = np.random.default_rng(0)
  dims = [width] * (depth + 1)
  return {f"l{i}": {"w": jnp.asarray(r.normal(size=(a, b)) / np.sqrt(a), dtype),
                    "b": jnp.zeros((b,), dtype)}
          for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))}


def mlp_loss(params, x, y, add=jnp.add):
  h = x
  for layer in params.values():
    h = jnp.tanh(add(h @ layer["w"], layer["b"]))
  return jnp.mean(jnp.square(h.astype(jnp.float32) - y))


def add_like(h, b):
  """``h + b`` for a reduced-typed ``b`` (broadcast to h's sharding first)."""
  return h + jax.lax.broadcast_in_dim(b, h.shape, (h.ndim - 1,),
                                      out_sharding=jax.typeof(h).sharding)


def timed(forms: dict, steps: int) -> tuple[dict, dict]:
  """``forms``: name -> (step, state). Steps them in turn (one step of each
  per round, so load from other processes hits all alike); returns the final
  states and each form's median seconds per step."""
  states = {k: f(s) for k, (f, s) in forms.items()}   # warm-up
  jax.block_until_ready(states)
  times = {k: [] for k in forms}
  for _ in range(steps):
    for k, (f, _) in forms.items():
      t = time.perf_counter()
      states[k] = jax.block_until_ready(f(states[k]))
      times[k].append(time.perf_counter() - t)
  return states, {k: float(np.median(v)) for k, v in times.items()}


def main(steps=30, width=512, depth=4, batch=64, dtype=jnp.float32):
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  n = mesh.shape["data"]
  r = np.random.default_rng(1)
  x = r.normal(size=(batch, width)).astype(np.float32).astype(dtype)
  y = r.normal(size=(batch, width)).astype(np.float32)
  make_tx = lambda: z1.zero1(optax.adam(1e-3), axis_name="data")
  forms, info = {}, {}

  # z1.train_step
  tx = make_tx()
  params, opt_state = z1.init(tx, init_params(width, depth, dtype), mesh)
  step = z1.train_step(lambda p, b: mlp_loss(p, b["x"], b["y"]), tx, mesh)
  b = jax.device_put({"x": x, "y": y}, NamedSharding(mesh, P("data")))
  c = step.lower(params, opt_state, b).compile()
  forms["train_step"] = (lambda s, c=c: c(*s, b)[:2], (params, opt_state))
  info["train_step"] = (z1.inspect.memory(c), z1.inspect.collectives(c))

  # plain jit: flax TrainState under jax.set_mesh
  for name, place, add in (("jit", None, jnp.add),
                           ("jit+reduced", z1.reduced_params, add_like)):
    with jax.set_mesh(mesh):
      p0 = init_params(width, depth, dtype)
      if place is not None:
        p0 = place(p0, mesh)
      state = train_state.TrainState.create(apply_fn=None, params=p0,
                                            tx=make_tx())
      xs, ys = jax.device_put((x, y), NamedSharding(mesh, P("data")))

      def one(state, x, y, add=add):
        g = jax.grad(mlp_loss)(state.params, x, y, add)
        return state.apply_gradients(grads=g)

      c = jax.jit(one, donate_argnums=0).lower(state, xs, ys).compile()
      forms[name] = (lambda s, c=c, xs=xs, ys=ys: c(s, xs, ys), state)
      info[name] = (z1.inspect.memory(c), z1.inspect.collectives(c))
  states, secs = timed(forms, steps)
  finals = {k: jax.tree.map(np.asarray, s[0] if k == "train_step" else s.params)
            for k, s in states.items()}

  psi = sum(v.size for v in jax.tree.leaves(init_params(width, depth, dtype)))
  print(f"model: {depth} x Dense({width}) {jnp.dtype(dtype).name}, "
        f"{psi:,} params, batch {batch}, N={n}, Adam, {steps} timed steps")
  print(f"{'form':12s} {'ms/step':>8s} {'peak MiB':>9s} {'temp MiB':>9s} "
        f"{'args MiB':>9s}  collectives (count, MiB)")
  for name, (mem, coll) in info.items():
    t = secs[name]
    cs = ", ".join(f"{k} {c.count}x {c.bytes / 2**20:.2f}" for k, c in coll.items())
    print(f"{name:12s} {t * 1e3:8.2f} {mem['peak'] / 2**20:9.2f} "
          f"{mem['temp'] / 2**20:9.2f} {mem['argument'] / 2**20:9.2f}  {cs}")
  ref = jax.tree.map(np.asarray, finals["train_step"])
  for name in ("jit", "jit+reduced"):
    diff = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
               for a, b in zip(jax.tree.leaves(finals[name]), jax.tree.leaves(ref)))
    print(f"max |{name} - train_step| after {steps + 1} steps: {diff:.3g}")
  return secs, info


if __name__ == "__main__":
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--width", type=int, default=512)
  ap.add_argument("--depth", type=int, default=4)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--bf16", action="store_true")
  a = ap.parse_args()
  main(a.steps, a.width, a.depth, a.batch,
       jnp.bfloat16 if a.bf16 else jnp.float32)
