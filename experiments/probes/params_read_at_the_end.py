"""What plain jit's ``optax.apply_updates(p, u)`` costs at the peak, on 8 H100s.

With bf16 params, the DDP baseline keeps an fp32 master (as DeepSpeed's
bf16 does) and writes its new weights from it: once the forward has read a
bf16 param for the last time, its donated buffer holds nothing live until
the new weights are written there, and XLA places temporaries in it. The
user's plain-jit step ends with ``optax.apply_updates(p, u)``, which reads
every param, so no param buffer frees. This probe compiles BERT-base's bf16
step on the compile-only topology three ways:

* ``ddp``: experiments/gpu/aot.py's DDP baseline;
* ``ddp, p read at the end``: the same, its new weights written as
  ``p + (new - p)`` (what ``apply_updates`` of ``new - p`` reads: every
  param at the step's end);
* ``jit_grad``: ``z1.zero1`` after ``jax.value_and_grad`` in plain jit,

and prints each one's ``memory_analysis()`` and the most bytes its temp heap
holds live at one point (:func:`experiments.probes.peak_breakdown.
temp_live_at_peak`). XLA's estimate of memory, not a measurement.

Run: ``python -m experiments.probes.params_read_at_the_end`` (needs the
gpu-aot extra; about a minute).
"""
from __future__ import annotations

import tempfile

from experiments.gpu import aot   # first: it keeps jax off the GPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zero1_jax as z1  # noqa: E402
from experiments import baselines as bl  # noqa: E402
from experiments.probes import peak_breakdown  # noqa: E402
from zero1_jax.inspect import gpu  # noqa: E402

MODEL, DTYPE, GPUS = "bert-base", "bf16", 8


def ddp(mesh, read_params: bool):
  """The DDP baseline's step, lowered; ``read_params``: its new weights
  through ``p + (new - p)``."""
  shapes, loss_fn, per_device, seq = aot.model(MODEL, DTYPE)
  ids = jax.ShapeDtypeStruct((GPUS * per_device, seq), jnp.int32)
  batch = aot.placed({"input_ids": ids, "labels": ids}, mesh, lambda _: P("data"))
  tx = aot.optimizer()
  state = aot.placed(jax.eval_shape(lambda p: bl._init_state(tx, p), shapes), mesh)

  def step(p, s, b):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    new, s = bl._update(tx, g, s, p)
    if read_params:
      new = jax.tree.map(lambda a, n: a + (n - a), p, new)
    return new, s, loss
  rep = NamedSharding(mesh, P())
  return jax.jit(step, out_shardings=(rep, rep, rep), donate_argnums=(0, 1)).lower(
      aot.placed(shapes, mesh), state, batch)


def main() -> None:
  mesh = gpu.mesh(GPUS, ("data",))
  print(f"{MODEL}, {DTYPE} params, {GPUS} x H100 (XLA's memory analysis, MiB)")
  print(f"{'step':26} {'argument':>9} {'temp':>7} {'peak':>8} {'temp live':>10}")
  for name, low in [("ddp", lambda: ddp(mesh, False)),
                    ("ddp, p read at the end", lambda: ddp(mesh, True)),
                    ("jit_grad", lambda: aot.lower("jit_grad", MODEL, DTYPE, mesh))]:
    with tempfile.TemporaryDirectory() as d:
      c, _ = gpu.compile(low(), dict(aot.OPTIONS), dump_to=d)
      mem = z1.inspect.memory(c)
      live = peak_breakdown.temp_live_at_peak(d, mem["temp"])
    m = {k: v / 2 ** 20 for k, v in mem.items()}
    print(f"{name:26} {m['argument']:9,.1f} {m['temp']:7,.1f} {m['peak']:8,.1f} "
          f"{live / 2 ** 20:10,.1f}", flush=True)


if __name__ == "__main__":
  main()
