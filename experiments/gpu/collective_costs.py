"""What XLA's cost model charges one collective on H100s, compiled alone.

An all-reduce of X bytes, then a reduce-scatter of X and an all-gather of
its result, one after the other with nothing beside them, for 8 GPUs on
1 to 8 hosts: each one's window in XLA's latency-hiding schedule is its
estimated time (nothing overlaps it). ZeRO-1 moves the gradients as a
reduce-scatter plus an all-gather where data parallelism all-reduces them;
NCCL's ring all-reduce is itself a reduce-scatter followed by an
all-gather, so the ratio printed is the cost model's, not the wire's.

  python -m experiments.gpu.collective_costs                  # 2 and 4 hosts, 16-154 MiB
  python -m experiments.gpu.collective_costs --hosts 1,8 --mib 64

Every figure is XLA's cost model, an estimate: jax 0.10.2's, which the
tables of experiments/gpu/aot.py come from (jax 0.12's XLA gives a
collective compiled alone no cost of its own: :class:`Unpriced`). Needs
jax's CUDA plugin at jax's version, as experiments/gpu/aot.py does.
"""
from __future__ import annotations

import argparse

from experiments.gpu import aot  # noqa: F401  (the plugin path, platforms=cpu)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from zero1_jax.inspect import gpu, schedule as sched  # noqa: E402


KINDS = {"all-reduce", "reduce-scatter", "all-gather"}


class Unpriced(RuntimeError):
  """This jax's XLA gives a lone collective no cost: jax 0.12's prices each
  at 1 µs on one host and at a flat 5,001 µs across hosts."""


def costs(hosts: int, mib: float) -> dict[str, float]:
  """{kind: estimated µs} of an all-reduce, a reduce-scatter and an
  all-gather of ``mib`` MiB of fp32 on ``8 * hosts`` H100s."""
  n = 8 * hosts
  mesh = gpu.mesh(n, ("data",), hosts=hosts)
  size = int(mib * 2**20 / 4) // n * n

  def body(x):   # each waits for the one before: nothing runs beside it
    summed = jax.lax.psum(x, "data")
    shard = jax.lax.psum_scatter(summed * 2, "data", tiled=True)
    return summed, jax.lax.all_gather(shard * 3, "data", tiled=True)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(),
                            out_specs=(P(), P()), check_vma=False))
  x = jax.ShapeDtypeStruct((size,), jnp.float32,
                           sharding=NamedSharding(mesh, P()))
  _, schedule = gpu.compile(f.lower(x), aot.OPTIONS)
  out = {}
  for w in sched.summary(schedule).collectives:
    assert w.overlapped < 0.01 * (w.end - w.start), w   # alone, as meant
    out[w.kind] = out.get(w.kind, 0.0) + w.end - w.start
  if set(out) != KINDS or len(set(out.values())) < 3 or min(out.values()) < 5:
    raise Unpriced(f"jax {jax.__version__}'s XLA does not price a collective "
                   f"compiled alone ({out}): run this with jax 0.10.2")
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--hosts", default="2,4")
  ap.add_argument("--mib", default="16,64,154")
  args = ap.parse_args(argv)
  print("| GPUs (hosts) | MiB | all-reduce µs | reduce-scatter + all-gather µs | ratio |")
  print("|---|---|---|---|---|")
  for h in (int(v) for v in args.hosts.split(",")):
    for m in (float(v) for v in args.mib.split(",")):
      c = costs(h, m)
      pair = c["reduce-scatter"] + c["all-gather"]
      print(f"| {8 * h} ({h}) | {m:g} | {c['all-reduce']:,.0f} | "
            f"{pair:,.0f} | {pair / c['all-reduce']:.2f} |")


if __name__ == "__main__":
  main()
