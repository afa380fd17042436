"""ZeRO-1 vs ZeRO-2 on one model: compiled per-device peaks and step-time ratio.

For each accumulation count, both stages are compiled for the same batch
(``z1.inspect.memory``: argument + output - alias + temp) and then timed
interleaved in one process (stage 1, stage 2, stage 1, ... after a warm-up);
the reported ratio is the median of per-round ``t(stage 2) / t(stage 1)``.

Usage (from the repository root; 8 simulated CPU devices):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
    python -m experiments.probes.zero2_compare --size s --n 8 --accum 1 4

The bench can call :func:`compare` (one model, one N) and print its rows.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax

import zero1_jax as z1
from experiments.bench import plan as bs

STAGES = {1: z1.zero1, 2: z1.zero2}


def floor_peak(m, mesh, b) -> int:
  """Per-device peak of fwd + bwd + local SGD with no communication (donating)."""
  P = jax.sharding.PartitionSpec

  def per_device(p, b):
    g = jax.grad(m.loss_fn)(p, b)
    return jax.tree.map(lambda x, y: x - 1e-4 * y, p, g)

  f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")),
                            out_specs=P(), check_vma=False), donate_argnums=0)
  p = jax.device_put(m.params, jax.sharding.NamedSharding(mesh, P()))
  return z1.inspect.memory(f, p, b)["peak"]


def compare(size: str = "s", n: int = 8, accums=(1, 4), dtype: str = "fp32",
            seq_len: int = 64, per_device_batch: int = 2, rounds: int = 9,
            warmup: int = 2, bucket_bytes: int = bs.DEFAULT_BUCKET) -> list[dict]:
  """One row per accumulation count: ``peak`` and ``temp`` bytes per device
  for each stage, the gradient bytes, the no-communication floor's peak
  (:func:`floor_peak`; accumulation 1 only, else None), stage 2's sharded
  state bytes on the first device, and ``time_ratio`` (stage 2 / stage 1,
  median over ``rounds`` interleaved rounds)."""
  m = bs.model(size, dtype, seq_len)
  mesh = bs.make_mesh(n)
  rows = []
  for accum in accums:
    b = bs.device_batch(bs.batch(per_device_batch * n * accum, seq_len), n)
    runs, row = {}, {"size": size, "n": n, "accum": accum, "psi": m.psi,
                     "grad_bytes": sum(x.nbytes for x in jax.tree.leaves(m.params))}
    for stage, make in STAGES.items():
      tx = make(bs.optimizer(), axis_name="data", bucket_bytes=bucket_bytes)
      p, s = z1.init(tx, m.params, mesh)
      compiled = z1.train_step(m.loss_fn, tx, mesh,
                               grad_accum_steps=accum).lower(p, s, b).compile()
      mem = z1.inspect.memory(compiled)
      row[f"peak{stage}"], row[f"temp{stage}"] = mem["peak"], mem["temp"]
      runs[stage] = [compiled, p, s]
    # The floor differentiates one batch at once: comparable without accumulation.
    row["floor_peak"] = floor_peak(m, mesh, b) if accum == 1 else None
    row["state_bytes"] = z1.inspect.device_bytes(
        (runs[2][2].master, runs[2][2].inner), mesh.devices.flat[0])
    ratios = []
    for r in range(warmup + rounds):
      t = {}
      for stage, run in runs.items():
        t0 = time.perf_counter()
        run[1], run[2], metrics = run[0](run[1], run[2], b)
        jax.block_until_ready((run[1], run[2], metrics))
        t[stage] = time.perf_counter() - t0
      if r >= warmup:
        ratios.append(t[2] / t[1])
    row["time_ratio"] = statistics.median(ratios)
    rows.append(row)
  return rows


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--size", default="s")
  ap.add_argument("--n", type=int, default=8)
  ap.add_argument("--accum", type=int, nargs="+", default=[1, 4])
  ap.add_argument("--rounds", type=int, default=9)
  a = ap.parse_args(argv)
  for r in compare(a.size, a.n, tuple(a.accum), rounds=a.rounds):
    g = r["grad_bytes"]
    floor = "" if r["floor_peak"] is None else (
        f"; ZeRO-2 = floor + state + "
        f"{(r['peak2'] - r['floor_peak'] - r['state_bytes']) / g:.2f} x grad")
    print(f"{r['size']} N={r['n']} accum={r['accum']} psi={r['psi']} grad {g / 1e6:.2f} MB | "
          f"peak ZeRO-1 {r['peak1'] / 1e6:.2f} MB, ZeRO-2 {r['peak2'] / 1e6:.2f} MB "
          f"(saved {(r['peak1'] - r['peak2']) / g:.2f} x grad{floor}) | temp "
          f"{r['temp1'] / 1e6:.2f} / {r['temp2'] / 1e6:.2f} MB | "
          f"t(ZeRO-2)/t(ZeRO-1) median {r['time_ratio']:.3f}")


if __name__ == "__main__":
  main()
