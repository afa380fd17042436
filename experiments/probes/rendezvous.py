"""Long CPU runs on simulated devices under load: does a loop of steps that
never blocks abort with XLA's ``Termination timeout for 'reduce scatter
RendezvousKey...'`` (issue #33, item 6)? Timings and outcomes go to stdout.

    python -m experiments.probes.rendezvous --form train_step --steps 300 --load 2
    python -m experiments.probes.rendezvous --form shard_map --steps 300 --load 2 --no-fix

``--form``: ``train_step`` (the README's complete example), ``plain_jit``
(``tx.update`` inside a ``jax.jit`` step under ``jax.set_mesh``, blocking
every k steps by :func:`zero1_jax.bounded`) or ``shard_map`` (psum_scatter +
all_gather in a bare shard_map step, no zero1). ``--load K`` starts K
busy-loop processes for the run's duration. ``--no-fix`` sets the runtime's
bound to 0 (unbounded, as before the fix) and, for ``plain_jit`` and
``shard_map``, calls the step without :func:`zero1_jax.bounded`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _busy(k: int) -> list:
  # Each spins until its parent (this process) is gone, killed or not.
  code = f"import os\nwhile os.getppid() == {os.getpid()}: pass"
  return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(k)]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--form", default="train_step",
                  choices=("train_step", "plain_jit", "shard_map"))
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--load", type=int, default=0)
  ap.add_argument("--no-fix", action="store_true")
  a = ap.parse_args(argv)
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={a.devices}").strip()
  if a.no_fix:
    os.environ["ZERO1_CPU_STEPS_IN_FLIGHT"] = "0"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import PartitionSpec as P
  import zero1_jax as z1

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  params = {"w": jnp.zeros((5, 3)), "b": jnp.zeros(3)}
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
  batch = {"x": np.ones((64, 5), np.float32), "y": np.ones((64, 3), np.float32)}
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", max_grad_norm=1.0)

  if a.form == "train_step":
    params, state = z1.init(tx, params, mesh)
    step = z1.train_step(loss_fn, tx, mesh)
    run = lambda p, s: step(p, s, batch)[:2]
  elif a.form == "plain_jit":
    ctx = jax.set_mesh(mesh)   # the mesh for tx.init / tx.update, for the run
    ctx.__enter__()
    state = tx.init(params)

    @jax.jit
    def jit_step(p, s):
      g = jax.grad(loss_fn)(p, batch)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    run = jit_step if a.no_fix else z1.bounded(jit_step)
  else:
    state = None

    def per_device(w):
      g = jax.lax.psum_scatter(w * 0.5 + 1.0, "data", tiled=True)
      return jax.lax.all_gather(g * 1e-3, "data", tiled=True)
    sm = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(),
                               out_specs=P(), check_vma=False))
    run0 = lambda p, s: ({"w": sm(p["w"].reshape(-1)[:8].repeat(8)).reshape(
        8, 8)[:5, :3], "b": p["b"]}, s)
    run = run0 if a.no_fix else z1.bounded(run0)

  params, state = run(params, state)   # compile
  procs = _busy(a.load)
  t = time.perf_counter()
  try:
    for _ in range(a.steps):
      params, state = run(params, state)
    jax.block_until_ready(params)
  finally:
    for p in procs:
      p.kill()
      p.wait()
  print(f"form={a.form} steps={a.steps} load={a.load} fix={not a.no_fix} "
        f"completed in {time.perf_counter() - t:.1f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
