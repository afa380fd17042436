"""What ZeRO-2 saves on GPUs: the accumulated gradients, nothing else.

``z1.train_step`` with ``grad_accum_steps`` sums the micro-batches'
gradients in a loop. Stage 1 carries each device's whole local gradient
(Psi x its dtype) from one micro-batch to the next and reduces it once;
stage 2 (``z1.zero2``) reduce-scatters each micro-batch's gradient in its
backward and carries only the 1/N shards. Compiled for 8 H100s without a GPU
(jax's compile-only topology; ``memory_analysis``, XLA's own account of the
program's buffers, not an estimate), this prints each form's peak per GPU
at 1 and 2 micro-batches and the carry stage 2 leaves out, Psi x dtype x
(1 - 1/N). Without accumulation the two peaks are the same: every leaf's
gradient is freed once its reduce-scatter has read it in either form.

The step's time is not priced: XLA's latency-hiding schedule counts a loop's
body 0.01 in its caller (:mod:`zero1_jax.inspect.schedule`).

Run: ``python -m experiments.probes.zero2_accumulation [--models bert-base,gpt2]
[--dtypes fp32,bf16]`` (needs the gpu-aot extra; about 5 minutes on 2 cores).
"""
from __future__ import annotations

import argparse

from experiments.gpu import aot   # first: it keeps jax off the GPU backend

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zero1_jax as z1  # noqa: E402
from zero1_jax.inspect import gpu  # noqa: E402

GPUS, ACCUM = 8, (1, 2)   # GPT-2 has 2 sequences a device


def peak(form: str, model: str, dtype: str, accum: int, mesh) -> int:
  """``form``'s peak bytes per GPU at ``accum`` micro-batches."""
  kw = {"grad_accum_steps": accum} if accum > 1 else {}
  compiled, _ = gpu.compile(aot.lower(form, model, dtype, mesh, **kw), aot.OPTIONS)
  return z1.inspect.memory(compiled)["peak"]


def carry_left_out(model: str, dtype: str, n: int) -> int:
  """Psi x the gradient's dtype x (1 - 1/N): stage 1's carry less stage 2's."""
  shapes = aot.model(model, dtype)[0]
  grad = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
  return grad - grad // n


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="bert-base,gpt2")
  ap.add_argument("--dtypes", default="fp32,bf16")
  args = ap.parse_args(argv)
  mesh = gpu.mesh(GPUS)
  mib = 1 << 20
  print(f"Peak per GPU, {GPUS} x H100 (memory_analysis of XLA's GPU program), MiB")
  print()
  print("| model, params | micro-batches | `train_step` (stage 1) | zero2 "
        "| zero2 less | stage 1's carry less stage 2's |")
  print("|---|---|---|---|---|---|")
  for model in args.models.split(","):
    for dtype in args.dtypes.split(","):
      carry = carry_left_out(model, dtype, GPUS)
      for accum in ACCUM:
        one, two = (peak(f, model, dtype, accum, mesh) for f in ("train_step", "zero2"))
        less = round((one - two) / mib, 1) + 0.0   # no "-0.0"
        print(f"| {model}, {dtype} | {accum} | {one / mib:,.1f} | {two / mib:,.1f} "
              f"| {less:,.1f} | {carry / mib if accum > 1 else 0:,.1f} |", flush=True)


if __name__ == "__main__":
  main()
