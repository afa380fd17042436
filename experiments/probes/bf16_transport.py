"""Could fp32 params computing in bf16 reduce their gradients in bf16 bytes
and still sum them in fp32?

Where the loss reads a leaf only cast to bf16, each device's gradient of it
is a bf16 value widened to fp32: every element is exact in bf16. zero1
reduce-scatters it in fp32 (the sums optax makes on one device); DDP's
partitioner all-reduces it in bf16 (half the bytes, bf16 sums). An
all-to-all of the bf16 pieces, each device then summing the N pieces of its
shard in fp32, would move a bf16 reduce-scatter's bytes with fp32's sums.

This prices each way, compiled alone for 8 H100s a host (the compile-only
topology, XLA's cost model, µs), on X MiB of fp32 gradients:

- an fp32 reduce-scatter over every GPU (what zero1 does);
- an all-to-all of the same elements in bf16 over every GPU;
- a bf16 reduce-scatter over every GPU (``reduce_dtype=jnp.bfloat16``);
- in two stages, the host first: the bf16 all-to-all among the host's 8
  GPUs, each summing its eighth in fp32, then an fp32 reduce-scatter of
  that eighth across the hosts (the network carries 1/8 of the elements,
  in fp32); and the same with an fp32 reduce-scatter in the host first.

On one host the all-to-all is as cheap as the bf16 reduce-scatter (64 MiB:
134 µs against 135, fp32 219). Across hosts, where the bytes decide
against DDP, the flat all-to-all is 2.2-5.6x the fp32 reduce-scatter (2
hosts, 64 MiB: 1,096 against 496; 8 hosts 3,361 against 735): each device
sends to every peer over the network, where the ring sends to one. The
host-first bf16 transport is 0.80-0.95 of the fp32 reduce-scatter on 2
hosts (395 against 496 at 64 MiB), 0.96-1.03 on 4 and 1.02-1.04 on 8,
where the bf16 reduce-scatter is 0.62-0.89: the cost model prices the
reduce-scatter of an eighth across the hosts at 53-88% of the whole
one's (261 of 496 µs on 2 hosts, 613 of 735 on 8, at 64 MiB). The
host-first fp32 reduce-scatter is 0.97-1.13 of the flat one. An exact
bf16 transport gains only on 2 hosts, and less there than reducing in
bf16: zero1 keeps the one fp32 reduce-scatter, and ``reduce_dtype=jnp.bfloat16`` is
the way to DDP's bytes (docs/gpu.md).

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

ALL = ("host", "gpu")        # every GPU, host-major: the flat collectives
KINDS = ["reduce-scatter", "all-to-all", "reduce-scatter"]
STAGED = ["all-to-all", "reduce-scatter", "reduce-scatter", "reduce-scatter"]


def costs(hosts: int, mib: int) -> dict[str, float]:
  """µs of each way to reduce ``mib`` MiB of fp32 gradients on ``8 *
  hosts`` H100s, one after another with nothing beside them: "fp32 RS",
  "bf16 all-to-all", "bf16 RS" and, across hosts, "host-first bf16" and
  "host-first fp32" (the two stages' sum)."""
  n = 8 * hosts
  mesh = gpu.mesh((hosts, 8), ALL, hosts=hosts)
  size = mib * 2**20 // 4 // n * n

  def to_all(x, axis, parts):   # bf16 pieces to their owners, summed in fp32
    pieces = x.astype(jnp.bfloat16).reshape(parts, x.size // parts)
    return jax.lax.all_to_all(pieces, axis, 0, 0, tiled=True).astype(
        jnp.float32).sum(0)

  def body(g):   # each collective waits for the one before
    out = [jax.lax.psum_scatter(g, ALL, tiled=True)]
    out.append(to_all(g + out[-1].sum(), ALL, n))
    out.append(jax.lax.psum_scatter((g * out[-1].sum()).astype(jnp.bfloat16),
                                    ALL, tiled=True))
    if hosts > 1:
      eighth = to_all(g + out[-1].sum().astype(jnp.float32), "gpu", 8)
      out.append(jax.lax.psum_scatter(eighth, "host", tiled=True))
      eighth = jax.lax.psum_scatter(g * out[-1].sum(), "gpu", tiled=True)
      out.append(jax.lax.psum_scatter(eighth, "host", tiled=True))
    return sum(o.sum().astype(jnp.float32) for o in out)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                            check_vma=False))
  g = jax.ShapeDtypeStruct((size,), jnp.float32,
                           sharding=NamedSharding(mesh, P()))
  _, schedule = gpu.compile(f.lower(g), aot.OPTIONS)
  windows = [w for w in sched.summary(schedule).collectives
             if w.kind != "all-reduce"]          # the scalar sum at the end
  assert [w.kind for w in windows] == KINDS + (STAGED if hosts > 1 else []), \
      windows
  assert all(w.overlapped < 0.01 * (w.end - w.start) for w in windows)
  t = [w.end - w.start for w in windows]
  names = ["fp32 RS", "bf16 all-to-all", "bf16 RS"]
  out = dict(zip(names, t))
  if hosts > 1:
    out["host-first bf16"] = t[3] + t[4]
    out["host-first fp32"] = t[5] + t[6]
  return out


def main() -> None:
  print("XLA's cost model, µs, each way alone; 8 H100s a host")
  cols = ["fp32 RS", "bf16 all-to-all", "bf16 RS", "host-first bf16",
          "host-first fp32"]
  print(f"{'hosts':>5} {'MiB':>4} " + " ".join(f"{c:>16}" for c in cols))
  for hosts in (1, 2, 4, 8):
    for mib in (16, 64):
      c = costs(hosts, mib)
      print(f"{hosts:5d} {mib:4d} " + " ".join(
          f"{c[k]:16,.0f}" if k in c else f"{'-':>16}" for k in cols),
          flush=True)


if __name__ == "__main__":
  main()
