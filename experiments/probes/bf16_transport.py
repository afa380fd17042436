"""Could fp32 params computing in bf16 reduce their gradients in bf16 bytes
and still sum them in fp32?

Where the loss reads a leaf only cast to bf16, each device's gradient of it
is a bf16 value widened to fp32: every element is exact in bf16. zero1
reduce-scatters it in fp32 (the sums optax makes on one device); DDP's
partitioner all-reduces it in bf16 (half the bytes, bf16 sums). An
all-to-all of the bf16 pieces, each device then summing the N pieces of its
shard in fp32, would move a bf16 reduce-scatter's bytes with fp32's sums.

This prices the three, each compiled alone for 8 H100s a host (the
compile-only topology, XLA's cost model, µs): an fp32 reduce-scatter of X
MiB, an all-to-all of the same elements in bf16, and a bf16
reduce-scatter. On one host the all-to-all is as cheap as the bf16
reduce-scatter (64 MiB: 134 µs against 135, fp32 219), but across hosts,
where the bytes decide against DDP, it is 2.2-4.2x the fp32
reduce-scatter (2 hosts, 64 MiB: 1,096 against 496; 4 hosts 2,019 against
581): each device sends to every peer over the network, where the ring
sends to one. So zero1 keeps the fp32 reduce-scatter, and
``reduce_dtype=jnp.bfloat16`` is the way to DDP's bytes (docs/gpu.md).

Run: ``python -m experiments.probes.bf16_transport`` (needs the gpu-aot
extra; under a minute on 2 cores). Measured 2026-12-06, 2-core x86_64 VM
without a GPU, jax 0.10.2.
"""
from __future__ import annotations

from experiments.gpu import aot   # first: it keeps jax off the GPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from zero1_jax.inspect import gpu, schedule as sched  # noqa: E402


def costs(hosts: int, mib: int) -> tuple[float, float, float]:
  """(fp32 reduce-scatter, bf16 all-to-all, bf16 reduce-scatter) µs of
  ``mib`` MiB of fp32 gradients on ``8 * hosts`` H100s, one after another
  with nothing beside them."""
  n = 8 * hosts
  mesh = gpu.mesh(n, ("data",), hosts=hosts)
  size = mib * 2**20 // 4 // n * n

  def body(g):   # each collective waits for the one before
    fp32 = jax.lax.psum_scatter(g, "data", tiled=True)
    pieces = (g + fp32.sum()).astype(jnp.bfloat16).reshape(n, size // n)
    mine = jax.lax.all_to_all(pieces, "data", 0, 0, tiled=True)
    summed = mine.astype(jnp.float32).sum(0)    # the shard's N pieces, fp32
    return jax.lax.psum_scatter((g * summed.sum()).astype(jnp.bfloat16),
                                "data", tiled=True)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(),
                            out_specs=P("data"), check_vma=False))
  g = jax.ShapeDtypeStruct((size,), jnp.float32,
                           sharding=NamedSharding(mesh, P()))
  _, schedule = gpu.compile(f.lower(g), aot.OPTIONS)
  windows = sched.summary(schedule).collectives
  assert [w.kind for w in windows] == [
      "reduce-scatter", "all-to-all", "reduce-scatter"], windows
  assert all(w.overlapped < 0.01 * (w.end - w.start) for w in windows)
  return tuple(w.end - w.start for w in windows)


def main() -> None:
  print("XLA's cost model, µs, each collective alone; 8 H100s a host")
  print(f"{'hosts':>5} {'MiB':>4} {'fp32 RS':>8} {'bf16 all-to-all':>16} "
        f"{'bf16 RS':>8}")
  for hosts in (1, 2, 4):
    for mib in (16, 64):
      rs32, a2a, rs16 = costs(hosts, mib)
      print(f"{hosts:5d} {mib:4d} {rs32:8,.0f} {a2a:16,.0f} {rs16:8,.0f}",
            flush=True)


if __name__ == "__main__":
  main()
