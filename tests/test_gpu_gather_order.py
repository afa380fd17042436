"""Plain jit's gathers of optax's updates, compiled for 8 H100s without a GPU.

``tx.update`` in the user's jit returns updates the user adds to the params
after the backward (``optax.apply_updates``). Each group of gathers waits
for the reduced gradients of the group gathered before it, that is of the
layers below it: XLA can then never fuse that add with a bf16 copy of the
same params the backward reads, which made the backward wait for the
gather (flax's lm1b on 8 H100s, docs/gpu.md). Read from the dependencies of
jax 0.10.2's optimized GPU program, where the barrier has become edges; jax
0.12's XLA schedules by the same barriers (lm1b's stall is gone there too:
8,866 µs a step against 9,256) but drops them from the program it prints.

Across hosts the forms that own the step gather their stored shards at its
start in packed buckets, one after another in the order the forward reads
them (16 H100s on 2 hosts).
"""

import re

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from experiments.gpu import aot as gpu_aot  # first: it keeps jax on the CPU backend
from zero1_jax.inspect import gpu, hlo_graph, schedule as sc
from helpers import gpu_program_with_barriers, starts
from zero1_jax.core import collectives as col, layout as lay

LAYERS, WIDTH = 5, 256   # each layer's 256 KiB kernel a gather group of its own


def lowered_step(mesh, compiler_options: dict | None = None):
  """An optax loop's step as flax users write it (``jax.grad``, ``tx.update``,
  ``optax.apply_updates``) on a stack of dense layers, lowered for ``mesh``
  (``compiler_options``: ``jax.jit``'s)."""
  import flax.linen as nn

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      for k in range(LAYERS):
        x = jnp.tanh(nn.Dense(WIDTH, use_bias=False, name=f"layer_{k}")(x))
      return x

  model = Stack()
  tx = z1.zero1(optax.adamw(1e-3), axis_name="data",
                bucket_bytes=WIDTH * WIDTH * 4)
  loss = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)

  def step(params, state, x):
    updates, state = tx.update(jax.grad(loss)(params, x), state, params)
    return optax.apply_updates(params, updates), state

  placed = lambda t, spec: jax.tree.map(lambda s: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=NamedSharding(mesh, spec)), t)
  with jax.set_mesh(mesh):
    params = jax.eval_shape(lambda: model.init(
        jax.random.key(0), jnp.ones((1, WIDTH))))["params"]
    state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(tx.init, params), z1.state_shardings(tx, params, mesh))
    return jax.jit(step, compiler_options=compiler_options).lower(
        placed(params, P()), state,
        placed(jax.ShapeDtypeStruct((64, WIDTH), jnp.float32), P("data")))


def compiled_step(mesh) -> str:
  """:func:`lowered_step` compiled for ``mesh`` with XLA's combiner off
  (each layer's gradient its own reduce-scatter: this model's 1.3 MB
  would otherwise be one); its optimized HLO text."""
  return gpu_program_with_barriers(lowered_step(mesh), {
      **gpu_aot.OPTIONS, "xla_gpu_reduce_scatter_combine_threshold_bytes": 1})


def lowest_layer_each_gather_waits_for(text: str) -> list[int]:
  """Per all-gather, the lowest layer whose backward gemms are among its
  ancestors."""
  m = hlo_graph.parse(text)
  instrs = m.computations[m.entry]
  deps = hlo_graph.dependencies(instrs)
  gemm = re.compile(r'op_name="[^"]*transpose\([^"]*/layer_(\d+)/')
  layer = {deps.node_of[k]: int(found.group(1)) for k, i in enumerate(instrs)
           if i.opcode == "custom-call" and (found := gemm.search(i.attrs))}
  # jax 0.12's dump before its barriers go prints the collectives as
  # async-start ops named for them
  gathers = [k for k, i in enumerate(instrs) if i.opcode == "all-gather-start"
             or (i.opcode == "async-start" and "all-gather-start" in i.attrs)]
  return [min(layer[n] for n in layer if deps.ancestors[deps.node_of[k]] >> n & 1)
          for k in gathers]


def test_each_gather_waits_for_the_backward_of_the_layer_below():
  """Layer k's updates are gathered once the backward has reduced layer
  k - 1's gradient (layer 0's, with nothing below, once its own is)."""
  lowest = lowest_layer_each_gather_waits_for(compiled_step(gpu.mesh(8)))
  assert sorted(lowest) == [0] + list(range(LAYERS - 1)), lowest


def reduce_scatters(mesh, compiler_options=None) -> tuple[list[sc.Window], float]:
  """The step's reduce-scatters in XLA's schedule, and when its backward's
  last gemm ends."""
  _, schedule = gpu.compile(lowered_step(mesh, compiler_options), gpu_aot.OPTIONS)
  backward_end = max(o.end for o in schedule.ops
                     if sc.is_compute(o) and "transpose(" in o.op_name)
  return [w for w in sc.summary(schedule).collectives
          if w.kind == "reduce-scatter"], backward_end


def test_the_reduce_scatter_threshold_given_to_jax_jit_splits_the_gradients():
  """docs/gpu.md's line for ``jax.grad`` in plain jit on GPUs: XLA combines
  the partitioner's reduce-scatters up to a threshold counted in each
  device's output bytes (1/N of the gradient), so by default this model's
  are one. ``tx.update`` takes each leaf as each device's block (nothing
  packed before the reduce), so the threshold passed to ``jax.jit`` splits
  them, a layer's kernel each, and the first runs under the backward."""
  mesh = gpu.mesh(8)
  assert len(reduce_scatters(mesh)[0]) == 1
  per_layer = WIDTH * WIDTH * 4 // 8
  split, backward_end = reduce_scatters(mesh, {
      "xla_gpu_reduce_scatter_combine_threshold_bytes": per_layer})
  assert len(split) == LAYERS, [(w.start, w.end) for w in split]
  assert split[0].start < backward_end, (split[0], backward_end)


def test_across_hosts_the_stored_shards_are_gathered_in_read_order():
  """The gathers at a ``train_step``'s start run one after another, each
  waiting for the one before it, the bucket the forward reads first
  first and the part-full last one last. Left unordered, XLA issued the
  part-full bucket first and BERT-base fp32's forward on 16 H100s waited
  for three gathers (12,158 µs a step against 11,899, its cost model)."""
  low = gpu_aot.lower("train_step", "small-bert", "fp32",
                      gpu.mesh(16, hosts=2), bucket_bytes=1 << 20)
  instrs = hlo_graph.parse(gpu_program_with_barriers(low))
  instrs = instrs.computations[instrs.entry]
  deps = hlo_graph.dependencies(instrs)
  node = lambda k: deps.node_of[k]
  rs = [node(k) for k in starts(instrs, "reduce-scatter")]
  first = [k for k in starts(instrs, "all-gather")
           if not any(deps.ancestors[node(k)] >> r & 1 for r in rs)]
  before = {k: sum(deps.ancestors[node(k)] >> node(q) & 1 for q in first)
            for k in first}
  assert len(first) > 4 and sorted(before.values()) == list(range(len(first))), before
  size = lambda k: hlo_graph.shape_bytes(instrs[k].shape)
  last = max(first, key=before.get)
  assert all(size(k) > size(last) for k in first if k != last)


def test_chained_gathers_leave_the_values_bitwise():
  """The chain orders the gathers, not a value: on 8 CPU devices the
  whole leaves rebuilt from every device's shard, chained bucket after
  bucket (in place and packed), are bitwise the unchained ones and the
  leaves themselves."""
  import numpy as np

  rng = np.random.default_rng(0)
  shapes = [(24, 16), (16,), (5, 7), (), (8, 2560)]
  leaves = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
  layout = lay.plan(leaves, 8)
  buckets = lay.plan_buckets(layout, (np.dtype("f4"),) * len(shapes), 512,
                             inplace_bytes=1 << 16)
  assert len(buckets) > 3 and any(b.whole_leaf(layout) is not None for b in buckets)
  shard_map = getattr(jax, "shard_map", None) or __import__(
      "jax.experimental.shard_map", fromlist=["shard_map"]).shard_map

  def run(chained):
    def per_device(*xs):
      shards = {i: col.local_shard(x, layout.leaves[i], "data")
                for i, x in enumerate(xs) if layout.leaves[i].kind == lay.SHARD}
      out = col.all_gather(shards, layout, buckets, "data", chained=chained)
      return tuple(out[i] for i in sorted(out))
    mesh = jax.make_mesh((8,), ("data",))
    f = shard_map(per_device, mesh=mesh, in_specs=P(), out_specs=P(),
                  check_vma=False)
    return jax.jit(f)(*(jax.device_put(x, NamedSharding(mesh, P()))
                        for x in leaves))

  chained, plain = run(True), run(False)
  whole = [x for i, x in enumerate(leaves) if layout.leaves[i].kind == lay.SHARD]
  assert len(chained) == len(whole) > 2
  for a, b, x in zip(chained, plain, whole):
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert np.array_equal(np.asarray(a), np.asarray(x))
