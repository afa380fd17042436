"""What one collective and one copy cost on this backend, alone.

Issue #12 asks for ZeRO-1's overhead above the no-communication floor to be
at most DDP's at N=2 and half of it at N=8. This section prices the pieces
such a step is made of, on buffers of the bench model's size (``--psi``
float32 elements per device), each in its own ``shard_map`` program, timed
interleaved:

* ``copy``: one full-size elementwise pass (what a bucket copy, or the slices
  that unpack a gathered bucket, cost);
* ``psum`` / ``psum_scatter`` / ``all_gather`` of one buffer;
* the same bytes in ``K`` leaves: a ``psum`` of a K-leaf tree (one variadic
  all-reduce, what DDP's ``pmean(grads)`` lowers to) and K separate
  reduce-scatters / all-gathers (what in-place ZeRO issues).

From these: a packed ZeRO-1 step pays reduce-scatter + all-gather + two
copies (pack, unpack); a copy-free one would pay the two collectives alone.
On XLA:CPU every extra collective, and every extra operand of a variadic one,
is another rendezvous of all N device threads.

Run: ``python -m experiments.probes.collective_costs [--ns 2 8] [--psi 851332]``
(prints a markdown table; ``--out FILE`` also writes it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

AXIS = "d"


def _pieces(x: jax.Array, k: int) -> list[jax.Array]:
  """``x`` as k leaves (a multiply, so each is a buffer of its own)."""
  size = x.shape[0] // k
  return [x[i * size:(i + 1) * size] * 1.0 for i in range(k)]


def programs(n: int, k: int, axis: str = AXIS) -> dict[str, callable]:
  """name -> per-device function of one float32 vector (its length divisible
  by n * k), inside a shard_map over ``axis`` of size n."""
  return {
      "copy": lambda x: x * 2.0,
      "psum": lambda x: jax.lax.psum(x, axis),
      "psum_scatter": lambda x: jax.lax.psum_scatter(x, axis, tiled=True),
      "all_gather": lambda x: jax.lax.all_gather(x[:x.shape[0] // n], axis, tiled=True),
      f"split into {k} (baseline of the next three)": lambda x: jnp.concatenate(
          _pieces(x, k)),
      f"psum of a {k}-leaf tree": lambda x: jnp.concatenate(
          jax.lax.psum(_pieces(x, k), axis)),
      f"{k} psum_scatters": lambda x: jnp.concatenate(
          [jax.lax.psum_scatter(p, axis, tiled=True) for p in _pieces(x, k)]),
      f"{k} all_gathers": lambda x: jnp.concatenate(
          [jax.lax.all_gather(p[:p.shape[0] // n], axis, tiled=True)
           for p in _pieces(x, k)]),
  }


def measure(n: int, psi: int, k: int = 8, rounds: int = 25) -> dict[str, float]:
  """Median seconds of each program at N=n, interleaved over ``rounds``."""
  mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
  e = max(psi // (n * k), 1) * n * k        # divisible by n and by k
  x = jax.device_put(np.ones((n * e,), np.float32), NamedSharding(mesh, P(AXIS)))
  fns = {name: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                     check_vma=False))
         for name, f in programs(n, k).items()}
  for f in fns.values():                   # compile and warm up
    jax.block_until_ready(f(x))
    jax.block_until_ready(f(x))
  times = {name: [] for name in fns}
  for r in range(rounds):
    names = list(fns)
    for name in names[r % len(names):] + names[:r % len(names)]:
      t0 = time.perf_counter()
      jax.block_until_ready(fns[name](x))
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(v) for name, v in times.items()}


def table(rows: dict[int, dict[str, float]], psi: int) -> list[str]:
  ns = sorted(rows)
  lines = [f"### Collective and copy costs alone ({psi:,} float32 per device, "
           f"{4 * psi / 1e6:.1f} MB; medians, interleaved)", "",
           "| program | " + " | ".join(f"N={n} ms" for n in ns) + " |",
           "|---|" + "---|" * len(ns)]
  for name in rows[ns[0]]:
    lines.append(f"| {name} | " + " | ".join(f"{rows[n][name] * 1e3:.2f}" for n in ns) + " |")
  lines.append("| *packed ZeRO-1: reduce-scatter + all-gather + 2 copies* | " + " | ".join(
      f"{(rows[n]['psum_scatter'] + rows[n]['all_gather'] + 2 * rows[n]['copy']) * 1e3:.2f}"
      for n in ns) + " |")
  lines.append("| *copy-free ZeRO-1: reduce-scatter + all-gather* | " + " | ".join(
      f"{(rows[n]['psum_scatter'] + rows[n]['all_gather']) * 1e3:.2f}" for n in ns) + " |")
  lines.append("")
  return lines


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--ns", type=int, nargs="+", default=[2, 8])
  ap.add_argument("--psi", type=int, default=851_332, help="elements per device (model s)")
  ap.add_argument("--leaves", type=int, default=8)
  ap.add_argument("--rounds", type=int, default=25)
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  rows = {n: measure(n, a.psi, a.leaves, a.rounds) for n in a.ns}
  text = "\n".join(table(rows, a.psi))
  print(text)
  if a.out:
    with open(a.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
