"""experiments/gpu/aot.py's precisions: fp32, bf16 params, and "mixed" (fp32
params computing in bf16, as flax's lm1b and nanodo train), where DDP keeps
no master and zero1 shards the two moments, as in fp32."""

import jax
import jax.numpy as jnp

from experiments.gpu import aot as gpu_aot
from experiments.gpu import aot_tables as tables


def test_mixed_keeps_fp32_params_and_computes_in_bf16():
  shapes, loss_fn, per_device, seq = gpu_aot.model("small-bert", "mixed")
  assert {x.dtype for x in jax.tree.leaves(shapes)} == {jnp.dtype(jnp.float32)}
  ids = jax.ShapeDtypeStruct((per_device, seq), jnp.int32)
  jaxpr = jax.make_jaxpr(loss_fn)(shapes, {"input_ids": ids, "labels": ids})
  dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  assert dots and all(e.outvars[0].aval.dtype == jnp.bfloat16 for e in dots[:4])


def test_mixeds_memory_line_saves_what_fp32s_does():
  """Two fp32 moments sharded away (8 bytes a param x (1 - 1/N)), the
  forms that own the step keeping an fp32 param shard."""
  psi, mib = 1 << 20, 1 << 20
  ddp = {"form": "ddp", "model": "m", "gpus": 8, "dtype": "mixed",
         "peak_bytes": 100 * mib}
  for form, kept in (("jit_vg", 0), ("train_step", 4 / 8)):
    row = dict(ddp, form=form)
    assert tables.memory_line(row, ddp, psi) / mib == 100 - 8 * 7 / 8 + kept
