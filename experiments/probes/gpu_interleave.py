"""How far interleaving the gathers with the backward's reduce-scatters goes,
in XLA's cost model, for a step that ends with whole params (plain jit).

A hand-written ZeRO-1 step (not zero1's code) inside one ``shard_map``:
local gradients, then per bucket of leaves in the order the backward
completes them (``--bucket-mb``, packed flat): reduce-scatter, an Adam-like
update of this device's piece, all-gather. Each reduce-scatter waits for the
one before it (``optimization_barrier``), and the loss's scalar psum for the
last. ``--mode``:

* ``end``: every gather after the last reduce-scatter (what
  ``z1.value_and_grad`` + ``tx.update`` give: the update is traced after
  the backward, its gathers follow);
* ``paced``: bucket j's gather waits for reduce-scatter j+1;
* ``chained``: paced, and reduce-scatter j+2 waits for gather j, so the
  collective stream runs RS, RS, AG, RS, AG, ... under the backward.

Usage (no GPU needed; see docs/gpu.md for the plugin)::

  python -m experiments.probes.gpu_interleave --model bert-base --mode chained

Prints XLA's estimated step, its compute, exposed collective time, and with
``--timeline`` each collective's window. Compare with ``python -m
experiments.gpu.aot --forms floor,ddp,jit_vg`` on the same model.

BERT-base fp32, 32 MB buckets (10), 8 x H100, XLA's cost model: end 10,307
µs, paced 10,429, chained 10,323 (floor 9,481, DDP 11,144, ``jit_vg``
11,418). Even in ``end`` mode XLA's scheduler runs each gather between the
following reduce-scatters: the barriers are not what does it. What this
step has and ``z1.value_and_grad`` + ``tx.update`` lack: one gather bucket
per reduce-scatter bucket (same leaves, the backward's order; zero1 gathers
18 buckets across 9 reduce-scatter groups, some waiting on 2-3 of them),
reduce-scatters in order, and the loss's psum after the last one.
(``python -m experiments.probes.gpu_interleave --mode end``, 2026-12-03,
2-core x86_64 VM, jax 0.10.2.)
"""

from __future__ import annotations

import argparse
import math

import experiments.gpu.aot as ga   # first: jax on CPU, the CUDA plugin found
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from zero1_jax.core import order as ordering
from zero1_jax.inspect import gpu, schedule as sc


def buckets_in_backward_order(shapes, loss_fn, batch, limit: int) -> list[list[int]]:
  leaves = jax.tree.leaves(shapes)
  out, cur, size = [], [], 0
  for i in reversed(ordering.first_reads(loss_fn, shapes, batch)):
    cur.append(i)
    size += math.prod(leaves[i].shape) * 4
    if size >= limit:
      out.append(cur)
      cur, size = [], 0
  return out + ([cur] if cur else [])


def lowered(model: str, mode: str, bucket_bytes: int, gpus: int = 8):
  mesh = gpu.mesh(gpus)
  n = gpus
  shapes, loss_fn, per_device, seq = ga.model(model, "fp32")
  keys = ["input_ids"] + ([] if model == "gpt2" else ["labels"])
  local = {k: jax.ShapeDtypeStruct((per_device, seq), jnp.int32) for k in keys}
  batch = ga.placed({k: jax.ShapeDtypeStruct((n * per_device, seq), jnp.int32)
                     for k in keys}, mesh, lambda _: P("data"))
  leaves, treedef = jax.tree.flatten(shapes)
  buckets = buckets_in_backward_order(shapes, loss_fn, local, bucket_bytes)
  sizes = [sum(math.prod(leaves[i].shape) for i in b) for b in buckets]
  padded = [-(-s // n) * n for s in sizes]
  nb = len(buckets)
  row = NamedSharding(mesh, P("data"))
  state = [(jax.ShapeDtypeStruct((p,), jnp.float32, sharding=row),) * 2
           for p in padded]

  def per_device_step(p, st, bt):
    loss, g = jax.value_and_grad(loss_fn)(p, bt)
    pl, gl = jax.tree.leaves(p), jax.tree.leaves(g)
    me = jax.lax.axis_index("data")
    rs, ag, new = [None] * nb, [None] * nb, [None] * nb

    def flat(xs, j):
      return jnp.pad(jnp.concatenate([xs[i].ravel() for i in buckets[j]]),
                     (0, padded[j] - sizes[j]))

    def gather(j, wait):
      m, v = st[j]
      gs = rs[j] / n
      m, v = 0.9 * m + 0.1 * gs, 0.999 * v + 0.001 * gs * gs
      k = padded[j] // n
      mine = jax.lax.dynamic_slice(flat(pl, j), (me * k,), (k,))
      mine = mine - 1e-3 * (m / (jnp.sqrt(v) + 1e-8) + 0.01 * mine)
      new[j] = (m, v)
      if wait is not None:
        mine, _ = jax.lax.optimization_barrier((mine, wait))
      return jax.lax.all_gather(mine, "data", tiled=True)

    for j in range(nb):
      x, deps = flat(gl, j), []
      if j >= 1:
        deps.append(rs[j - 1])
      if mode == "chained" and j >= 2:
        deps.append(ag[j - 2])
      if deps:
        x, _ = jax.lax.optimization_barrier((x, deps))
      rs[j] = jax.lax.psum_scatter(x, "data", tiled=True)
      if mode != "end" and j >= 1:
        ag[j - 1] = gather(j - 1, rs[j])
    ag = [a if a is not None else gather(j, None) for j, a in enumerate(ag)]
    out = list(pl)
    for j, b in enumerate(buckets):
      at = 0
      for i in b:
        k = math.prod(pl[i].shape)
        out[i] = ag[j][at:at + k].reshape(pl[i].shape)
        at += k
    loss, _ = jax.lax.optimization_barrier((loss, rs[-1]))
    return treedef.unflatten(out), new, jax.lax.pmean(loss, "data")

  specs = [(P("data"), P("data"))] * nb

  def step(p, s, bt):
    return jax.shard_map(per_device_step, mesh=mesh,
                         in_specs=(P(), specs, P("data")),
                         out_specs=(P(), specs, P()), check_vma=False)(p, s, bt)

  with jax.set_mesh(mesh):
    return jax.jit(step, donate_argnums=(0, 1)).lower(
        ga.placed(shapes, mesh), state, batch), sizes


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="bert-base")
  ap.add_argument("--mode", choices=("end", "paced", "chained"), default="chained")
  ap.add_argument("--bucket-mb", type=float, default=32)
  ap.add_argument("--timeline", action="store_true")
  a = ap.parse_args(argv)
  low, sizes = lowered(a.model, a.mode, int(a.bucket_mb * 1e6))
  _, schedule = gpu.compile(low, ga.OPTIONS)
  s = sc.summary(schedule)
  print(f"{a.model} fp32, 8 x H100, {len(sizes)} buckets, mode {a.mode} "
        f"(XLA's cost model): step {s.step_us:,.0f} µs, compute "
        f"{s.compute_us:,.0f}, exposed collectives {s.exposed_us:,.0f}")
  if a.timeline:
    for w in sorted(s.collectives, key=lambda w: w.start):
      print(f"{w.kind:15s} {w.start:9.0f} {w.end:9.0f} under compute {w.overlapped:6.0f}")


if __name__ == "__main__":
  main()
