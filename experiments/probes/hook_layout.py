"""What zero1's backward hooks cost small-bert's plain-jit step on 8 H100s.

The tests' small-bert (3.8M params, 32 x 128 tokens a GPU) is the model
whose forms with zero1's backward hooks (``z1.value_and_grad``, zero2)
compiled furthest over the memory line (DDP's peak less the state ZeRO-1
saves). This probe compiles ``z1.value_and_grad``'s plain-jit step for the
compile-only topology, with the embedding's lookups from the blocks (the
default on one host) and gathered, its hooks three ways:

* ``per leaf`` (what GPUs and TPUs get): each leaf's gradient
  reduce-scattered in its own shape along its shard dim, XLA combining a
  group's by ``combiner_key``;
* ``packed`` (what CPUs get): a group's rank-major views side by side in one
  collective;
* ``no collective``: the hooks hand back the first rows of each gradient. A
  probe of the program's shape only: the sums are wrong.

and ``jax.value_and_grad``'s plain jit beside them; it counts, in XLA's
optimized HLO, the fusions that compute a layer norm's output. Where the
count is 10 (one a layer norm, and the MLM head's), XLA keeps each output
from the forward to its weight gradient, whose gemm reads it in place,
transposed; where it is 19 the backward recomputes the layer norm into a
transposed copy and the forward's output dies after the forward.

Run: ``python -m experiments.probes.hook_layout`` (needs the gpu-aot extra;
about a minute).
"""
from __future__ import annotations

import re

import jax

jax.config.update("jax_platforms", "cpu")

import zero1_jax as z1  # noqa: E402
from experiments.gpu import aot  # noqa: E402
from zero1_jax.core import collectives as col  # noqa: E402
from zero1_jax.core import layout as lay  # noqa: E402
from zero1_jax.core import zero2  # noqa: E402
from zero1_jax.inspect import gpu  # noqa: E402

MODEL, DTYPE, GPUS = "small-bert", "fp32", 8
SHIPPED = zero2.reduce_hook


def _no_collective(specs, n, axis_name, dtype, all_reduce=False, key=None,
                   waits=None, per_leaf=False):
  """``zero2.reduce_hook`` whose SHARD groups hand back the first rows of
  each gradient (a shard's shape, no collective: wrong sums)."""
  if specs[0].kind != lay.SHARD:
    return SHIPPED(specs, n, axis_name, dtype, all_reduce, key, waits, per_leaf)

  def reduce(cts):
    return tuple(jax.lax.slice_in_dim(col._pad_to_shards(c.astype(dtype), s),
                                      0, s.shard_shape[s.dim], axis=s.dim)
                 for c, s in zip(cts, specs))

  if waits is not None:
    return zero2._chained(reduce, waits)

  @jax.custom_vjp
  def hook(ps, slots):
    return ps

  hook.defvjp(lambda ps, slots: (ps, None), lambda _, cts: (None, reduce(cts)))
  return hook


VARIANTS = {"per leaf": SHIPPED,
            "packed": lambda *a, **k: SHIPPED(*a, **{**k, "per_leaf": False}),
            "no collective": _no_collective}


def ln_outputs(hlo: str) -> int:
  """Fusions in ``hlo`` whose op is a layer norm's last add (its output)."""
  return len(re.findall(r"= \S+ fusion\(.*op_name=\"[^\"]*_ln/add\"", hlo))


def measure(form: str, mesh) -> tuple[float, int]:
  compiled = aot.lower(form, MODEL, DTYPE, mesh).compile(
      compiler_options=dict(aot.OPTIONS))
  return z1.inspect.memory(compiled)["peak"] / 2 ** 20, ln_outputs(compiled.as_text())


def main() -> None:
  mesh = gpu.mesh(GPUS)
  ddp, _ = measure("ddp", mesh)
  psi = sum(x.size for x in jax.tree.leaves(aot.model(MODEL, DTYPE)[0]))
  line = ddp - 8 * psi * (1 - 1 / GPUS) / 2 ** 20
  print(f"{MODEL} {DTYPE} on {GPUS} H100s (compile-only), plain jit: DDP's peak "
        f"{ddp:,.1f} MiB, the memory line {line:,.1f} MiB\n")
  print("| step | peak MiB | over the line MiB | layer-norm output fusions |")
  print("|---|---|---|---|")
  peak, lns = measure("jit_grad", mesh)
  print(f"| jax.value_and_grad | {peak:,.1f} | {max(0, peak - line):.1f} | {lns} |")
  for form, lookups in (("jit_vg", "from the blocks"), ("jit_vg_gathered", "gathered")):
    for name, hook in VARIANTS.items():
      zero2.reduce_hook = hook
      try:
        peak, lns = measure(form, mesh)
      finally:
        zero2.reduce_hook = SHIPPED
      print(f"| z1.value_and_grad, lookups {lookups}, hooks {name} | {peak:,.1f} | "
            f"{max(0, peak - line):.1f} | {lns} |")


if __name__ == "__main__":
  main()
