"""Why ``z1.zero1`` after ``jax.value_and_grad`` cannot split its reduce-scatter.

In plain jit with ``jax.value_and_grad``, the gradients' reduce-scatters are
the partitioner's: ``tx.update`` asks for each leaf's gradient as the
device's block, and the partitioner sums it into the blocks where the
backward makes it. XLA's GPU reduce-scatter combiner then merges every one
whose key matches (reduction, dtype, replica groups) up to its threshold,
counted in output bytes: at 16 GPUs, all of GPT-2's fp32 gradients are one
reduce-scatter that waits for the backward's last gradient. zero1's own
collectives are kept apart by an XLA ``combiner_key`` per group
(:mod:`zero1_jax.core.order`); this probe shows that key cannot reach the
partitioner's:

1. ``jax.experimental.xla_metadata.set_xla_metadata`` tags the ops traced
   in it, but not a sharding constraint (with Shardy, an
   ``sdy.sharding_constraint``): the lowered module carries no tag there;
2. compiled for 16 H100s on 2 hosts (the compile-only topology, XLA's cost
   model), DDP and ``jit_grad`` for GPT-2 fp32, the latter three ways: as it is; with each
   leaf's gradient constrained to its block under a tag per 64 MiB group
   (the same program: one reduce-scatter); with XLA's own threshold at 8
   MiB a device (``xla_gpu_reduce_scatter_combine_threshold_bytes``, a
   compiler option the user's jit would have to carry), which does split it.
   Beside each, when the backward's weight-gradient gemms run: XLA
   schedules them next to the reduce-scatter they feed, after the input
   gradients, where DDP's run under its per-block all-reduces.
3. The groups chained instead, in backward order: each 64 MiB group's
   gradients pass through one ``jax.lax.optimization_barrier`` with the
   previous group's constrained ones, so that no reduce-scatter could be
   combined with the next. Still one reduce-scatter (22,649 µs): sharding
   propagation gives the barrier's operands the blocks' sharding, so the
   partitioner reduces before the barrier, which then ties only the outputs
   of reduce-scatters already placed.
4. The gradients of the upper blocks (the backward's first) all-reduced
   whole, DDP's collective, and sliced on each device, the rest
   reduce-scattered: blocks 6-11 21,476 µs, blocks 3-11 21,223, against
   22,594 as it is, 20,542 with XLA's threshold and DDP's 19,925.
5. The token and position embeddings' gradients all-reduced whole, so that
   no all-gather of the lookups' indices and no all-to-all of their
   gradients (the partitioner's scatter-add into the blocks) runs at the
   backward's end, ahead of the reduce-scatters: 22,886 µs, and 22,730
   with XLA's threshold, whose first reduce-scatter still starts after the
   input gradients (13.5 ms, against 13.8 with the all-to-all): what keeps
   the reduce-scatters late is where XLA schedules the weight gemms, not
   the embeddings' collectives.

Run: ``python -m experiments.probes.untagged_reduce_scatter`` (needs the
gpu-aot extra; about two minutes on 2 cores). Measured
2026-12-06, 2-core x86_64 VM without a GPU, jax 0.10.2.
"""
from __future__ import annotations

import contextlib
import re
import tempfile
from unittest import mock

from experiments.gpu import aot   # first: it keeps jax off the GPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zero1_jax as z1  # noqa: E402
from zero1_jax.core import collectives as col  # noqa: E402
from zero1_jax.core import jit_mode  # noqa: E402
from zero1_jax.core import layout as lay  # noqa: E402
from zero1_jax.core import order  # noqa: E402
from zero1_jax.inspect import gpu, schedule as sched  # noqa: E402

MODEL, DTYPE, GPUS, GROUP = "gpt2", "fp32", 16, 64 << 20


def tags_on_a_constraint() -> tuple[int, int]:
  """``(tags on the constraint, tags on the multiply)`` in the lowered text
  of ``x -> constraint(x) * 2`` traced under one ``combiner_key``."""
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices("cpu")[:1])

  def f(x):
    with order.tagged("probe"):
      return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data"))) * 2
  lines = jax.jit(f).lower(jnp.ones((4, 3))).as_text().splitlines()
  tagged = [ln for ln in lines if 'combiner_key = "probe"' in ln]
  on_constraint = sum("sharding_constraint" in ln or "@Sharding" in ln for ln in tagged)
  return on_constraint, sum("multiply" in ln for ln in tagged)


def _tagged_blocks(grads, g_specs, layout, mesh, where, axis):
  """jit_mode._as_blocks, each block-entering gradient then constrained to
  its block under the combiner_key of its 64 MiB group, in tree order."""
  specs, grads = _AS_BLOCKS(grads, g_specs, layout, mesh, where, axis)
  s_leaves = layout.treedef.flatten_up_to(specs)
  g_leaves = layout.treedef.flatten_up_to(grads)
  group, filled = 0, 0
  for i, s in enumerate(layout.leaves):
    if s.kind != lay.SHARD or s.padded_shape != s.shape:
      continue
    size = int(np.prod(s.shape)) * jnp.dtype(g_leaves[i].dtype).itemsize
    if filled and filled + size > GROUP:
      group, filled = group + 1, 0
    filled += size
    with order.tagged(col.REDUCE_KEY.format(group)):
      g_leaves[i] = jax.lax.with_sharding_constraint(
          g_leaves[i], NamedSharding(mesh or where, s_leaves[i]))
  return specs, layout.treedef.unflatten(g_leaves)


_AS_BLOCKS = jit_mode._as_blocks


def _chained_blocks(grads, g_specs, layout, mesh, where, axis):
  """jit_mode._as_blocks, the block-entering gradients constrained group
  after group in backward order (64 MiB groups), each group first passed
  through an optimization_barrier with the previous group's results."""
  specs, grads = _AS_BLOCKS(grads, g_specs, layout, mesh, where, axis)
  s_leaves = layout.treedef.flatten_up_to(specs)
  g_leaves = layout.treedef.flatten_up_to(grads)
  groups, filled = [[]], 0
  for i in reversed(range(len(layout.leaves))):
    s = layout.leaves[i]
    if s.kind != lay.SHARD or s.padded_shape != s.shape:
      continue
    size = int(np.prod(s.shape)) * jnp.dtype(g_leaves[i].dtype).itemsize
    if filled and filled + size > GROUP:
      groups, filled = groups + [[]], 0
    filled += size
    groups[-1].append(i)
  prev = None
  for group in groups:
    xs = [g_leaves[i] for i in group]
    if prev is not None:
      _, xs = jax.lax.optimization_barrier((prev, xs))
    prev = [jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh or where, s_leaves[i])) for x, i in zip(xs, group)]
    for x, i in zip(prev, group):
      g_leaves[i] = x
  return specs, layout.treedef.unflatten(g_leaves)


def _whole_where(enters_whole):
  """jit_mode._as_blocks, but the gradients of the leaves whose path
  ``enters_whole(path)`` enter whole: jit's partitioner all-reduces them,
  as DDP's, and each device slices its block."""
  def as_blocks(grads, g_specs, layout, mesh, where, axis):
    specs, grads = _AS_BLOCKS(grads, g_specs, layout, mesh, where, axis)
    paths = [jax.tree_util.keystr(k) for k, _ in
             jax.tree_util.tree_flatten_with_path(g_specs)[0]]
    s_leaves = layout.treedef.flatten_up_to(specs)
    whole = layout.treedef.flatten_up_to(g_specs)
    for i, path in enumerate(paths):
      if enters_whole(path):
        s_leaves[i] = whole[i]
    return layout.treedef.unflatten(s_leaves), grads
  return as_blocks


def _upper_blocks_whole(first: int):
  """The gradients of GPT-2's blocks ``first`` and above (the backward's
  first) enter whole."""
  def upper(path: str) -> bool:
    m = re.search(r"block_(\d+)", path)
    return bool(m) and int(m.group(1)) >= first
  return _whole_where(upper)


# The token and position embeddings' gradients enter whole: the partitioner
# all-reduces them where the backward's scatter-adds make them, with no
# all-gather of the lookups' indices and no all-to-all of their gradients
# into the blocks.
_embeddings_whole = _whole_where(lambda path: "embed" in path)


def weight_gemms(schedule) -> tuple[float, float]:
  """When the backward's weight-gradient gemms run (µs): jax transposes a
  ``dot_general`` into a gemm named ``.../transpose`` for the weight."""
  ops = [o for o in schedule.ops if o.opcode == "custom-call"
         and "transpose(jvp" in o.op_name and o.op_name.endswith("/transpose")]
  return min(o.start for o in ops), max(o.end for o in ops)


def compiled(mesh, form: str, as_blocks, options: dict) -> tuple:
  """``(reduce-scatters, step µs, reduce-scatter µs exposed, all-reduce µs
  exposed, weight-gradient gemms (first start, last end) µs, each
  reduce-scatter's start µs)``, with ``as_blocks`` (None: zero1's) in
  place of ``jit_mode._as_blocks``."""
  patch = (mock.patch.object(jit_mode, "_as_blocks", as_blocks) if as_blocks
           else contextlib.nullcontext())
  with patch, tempfile.TemporaryDirectory() as d:
    c, schedule = gpu.compile(aot.lower(form, MODEL, DTYPE, mesh),
                              {**aot.OPTIONS, **options}, dump_to=d)
  rs = z1.inspect.hlo_collectives(c.as_text()).get("reduce-scatter")
  s = sched.summary(schedule)
  starts = sorted(o.start for o in schedule.ops
                  if o.name.startswith("reduce-scatter-start"))
  return (rs.count if rs else 0, s.step_us,
          s.exposed_by_kind.get("reduce-scatter", 0.0),
          s.exposed_by_kind.get("all-reduce", 0.0), weight_gemms(schedule),
          starts)


def main() -> None:
  on_constraint, on_multiply = tags_on_a_constraint()
  print(f"combiner_key in the lowered module: on the sharding constraint "
        f"{on_constraint}, on the multiply traced beside it {on_multiply}")
  mesh = gpu.mesh(GPUS, ("data",), hosts=GPUS // 8)
  print(f"{MODEL} {DTYPE}, {GPUS} x H100 on {GPUS // 8} hosts (XLA's cost model, "
        f"µs); W gemms: the weight gradients' gemms, first start to last end")
  print(f"{'':51} {'RS':>3} {'step':>7} {'RS exposed':>11} {'AR exposed':>11} "
        f"{'W gemms':>15}  each RS starts at")
  for name, form, as_blocks, opts in [
      ("ddp (all-reduces)", "ddp", None, {}),
      ("jit_grad", "jit_grad", None, {}),
      ("jit_grad, blocks constrained under a tag per group", "jit_grad",
       _tagged_blocks, {}),
      ("jit_grad, groups chained by optimization barriers", "jit_grad",
       _chained_blocks, {}),
      ("jit_grad, XLA's threshold at 8 MiB a device", "jit_grad", None,
       {"xla_gpu_reduce_scatter_combine_threshold_bytes": 8 << 20}),
      ("jit_grad, blocks 6-11 all-reduced whole", "jit_grad",
       _upper_blocks_whole(6), {}),
      ("jit_grad, blocks 3-11 all-reduced whole", "jit_grad",
       _upper_blocks_whole(3), {}),
      ("jit_grad, the embeddings all-reduced whole", "jit_grad",
       _embeddings_whole, {}),
      ("jit_grad, the embeddings whole, threshold 8 MiB", "jit_grad",
       _embeddings_whole,
       {"xla_gpu_reduce_scatter_combine_threshold_bytes": 8 << 20})]:
    n, step, exposed, ar, (w0, w1), starts = compiled(mesh, form, as_blocks, opts)
    print(f"{name:51} {n:3d} {step:7,.0f} {exposed:11,.0f} {ar:11,.0f} "
          f"{w0:7,.0f}-{w1:7,.0f}  "
          f"{', '.join(f'{t:,.0f}' for t in starts)}", flush=True)


if __name__ == "__main__":
  main()
