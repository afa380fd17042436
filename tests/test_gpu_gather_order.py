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
"""

import re

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from experiments.gpu import aot as gpu_aot  # first: it keeps jax on the CPU backend
from zero1_jax.inspect import gpu, hlo_graph
from helpers import gpu_program_with_barriers

LAYERS, WIDTH = 5, 256   # each layer's 256 KiB kernel a gather group of its own


def compiled_step(mesh) -> str:
  """An optax loop's step as flax users write it (``jax.grad``, ``tx.update``,
  ``optax.apply_updates``) on a stack of dense layers, compiled for
  ``mesh``; its optimized HLO text."""
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
    low = jax.jit(step).lower(placed(params, P()), state, placed(
        jax.ShapeDtypeStruct((64, WIDTH), jnp.float32), P("data")))
  # XLA's combiner off: each layer's gradient its own reduce-scatter
  # (this model's 1.3 MB would otherwise be one)
  return gpu_program_with_barriers(low, {
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
