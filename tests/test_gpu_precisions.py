"""experiments/gpu/aot.py's precisions: fp32, bf16 params, and "mixed" (fp32
params computing in bf16, as flax's lm1b and nanodo train), where DDP keeps
no master and zero1 shards the two moments, as in fp32; train_step then
gathers the leaves its loss reads only in bf16 in bf16."""

import jax
import jax.numpy as jnp
import numpy as np

from experiments.gpu import aot as gpu_aot
from experiments.gpu import aot_tables as tables

import zero1_jax as z1
from zero1_jax.core import layout as lay
from zero1_jax.core import narrow
from zero1_jax.inspect import gpu


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


def test_mixeds_kept_shards_travel_in_bf16_and_their_gradients_in_fp32():
  """train_step with fp32 params computing in bf16, compiled for 8 H100s:
  the stored shards of every leaf the loss reads only cast to bf16
  (zero1_jax/core/narrow.py) are gathered in bf16, the rest (LayerNorms,
  read in fp32) in fp32; the gradients are reduce-scattered in fp32, the
  params' dtype. (Without the rule XLA's GPU compiler narrows a few
  gathers itself, those of leaves nothing but a cast reads: here the
  position table's.)"""
  shapes, loss_fn, per_device, seq = gpu_aot.model("small-bert", "mixed")
  ids = jax.ShapeDtypeStruct((per_device, seq), jnp.int32)
  layout = lay.plan(shapes, 8)
  stored = {i for i, s in enumerate(layout.leaves)
            if s.kind == lay.SHARD and s.padded_shape == s.shape}
  cast = narrow.narrow_reads(loss_fn, shapes, {"input_ids": ids, "labels": ids},
                             candidates=stored)
  assert set(cast.values()) == {jnp.dtype(jnp.bfloat16)}
  size = lambda s: int(np.prod(s.padded_shape))
  sizes = [size(s) for s in layout.leaves]
  # Every stored leaf but the LayerNorms' (read in fp32): most of the params.
  assert sum(sizes[i] for i in cast) > 0.9 * sum(sizes)

  c, _ = gpu.compile(gpu_aot.lower("train_step", "small-bert", "mixed",
                                   gpu.mesh(8)))
  got = z1.inspect.hlo_collectives(c.as_text())
  after_update = [i for i, s in enumerate(layout.leaves)   # padded: not kept
                  if s.kind == lay.SHARD and i not in stored]
  token_ids = 8 * per_device * seq * 4   # every device's lookups read them
  assert got["all-gather"].bytes == (
      2 * sum(sizes[i] for i in cast)
      + 4 * sum(sizes[i] for i in stored - set(cast))
      + 4 * sum(sizes[i] for i in after_update) + token_ids)
  assert got["reduce-scatter"].bytes == 4 * sum(
      size(s) for s in layout.leaves if s.kind == lay.SHARD)
