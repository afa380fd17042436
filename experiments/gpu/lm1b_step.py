"""flax's examples/lm1b train step, compiled for H100s: optax against zero1.

A real program, not ours: lm1b's ``train_step`` jitted as its
``train_and_evaluate`` jits it (``in_shardings`` / ``out_shardings`` from
the logical partition specs of the abstract ``TrainState``, through
``nn.logical_to_mesh_sharding`` under its ``logical_axis_rules``), on its
mesh ``('data', 'fsdp', 'tensor')`` in data-parallel form (N x 1 x 1,
``ici_data_parallelism=-1``, ``ici_fsdp_parallelism=1``), its default
config (6 layers, emb 512, vocabulary 30,000, 32 x 128 tokens a GPU, bf16
compute, dropout). Lowered on abstract arguments for the compile-only
topology, twice: with its ``optax.adamw(...)`` and with that line wrapped,
``z1.zero1(optax.adamw(...), axis_name="data", mesh=mesh)``. The state's
shardings come from lm1b's own ``utils`` (``nn.get_partition_spec`` of
``jax.eval_shape`` of its ``init_train_state``); its data pipeline's and
logging's imports (tensorflow, tfds, clu, sentencepiece) are stubbed, as the
step reads none of them.

Printed per GPU count as experiments/gpu/nanodo_step.py prints it
(experiments/gpu/real_steps.py); the
line: optax's peak less the 8 bytes a param of adamw's moments zero1
shards, ``(1 - 1/N)`` of them.

  git clone https://github.com/google/flax /some/where/flax
  pip install ml_collections          # lm1b's config; gpu-aot extra as aot.py
  python -m experiments.gpu.lm1b_step --flax /some/where/flax --gpus 8,16

``--zero1-only``: a checkout whose ``train_step`` was changed to call
``z1.value_and_grad`` (its ``loss_fn`` taking ``inputs`` and ``weights`` as
arguments), which takes zero1's transformation only. ``--zero1 K=V,...``:
more keywords for ``z1.zero1`` (as aot.py's).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys

from experiments.gpu import real_steps   # first: it keeps jax off the GPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero1_jax as z1  # noqa: E402
from experiments.gpu import aot  # noqa: E402
from experiments.gpu.real_steps import stub_unused  # noqa: E402
from zero1_jax.inspect import gpu  # noqa: E402

UNUSED = ("tensorflow", "tensorflow_datasets", "tensorflow_text", "sentencepiece",
          "clu", "clu.metric_writers", "clu.periodic_actions", "clu.deterministic_data")


def import_lm1b(path: str):
  """lm1b's ``train``, ``models``, ``utils`` and default config from a flax
  checkout at ``path``."""
  importlib.import_module("flax.training.checkpoints")   # before the stubs: flax.io
                                                         # looks for tensorflow
  stub_unused(UNUSED)
  sys.path.insert(0, os.path.join(path, "examples", "lm1b"))
  import models
  import train
  import utils
  from configs import default
  return train, models, utils, default


def lowered(lm1b, gpus: int, zero1: bool, **zero1_kw):
  """lm1b's jitted train step for ``gpus`` GPUs (8 a host), and its param
  count (``zero1_kw``: more keywords for ``z1.zero1``)."""
  from flax import linen as nn
  from jax.sharding import NamedSharding, PartitionSpec as P
  train, models, utils, default = lm1b
  config = default.get_config()
  config.ici_data_parallelism, config.ici_fsdp_parallelism = -1, 1
  mesh = gpu.mesh((gpus, 1, 1), tuple(config.mesh_axes), hosts=max(1, gpus // 8))
  train_config = models.TransformerConfig(   # train_and_evaluate's, as configured
      vocab_size=config.vocab_size, output_vocab_size=config.vocab_size,
      logits_via_embedding=config.logits_via_embedding,
      dtype=jnp.bfloat16 if config.use_bfloat16 else jnp.float32,
      emb_dim=config.emb_dim, num_heads=config.num_heads,
      num_layers=config.num_layers, qkv_dim=config.qkv_dim,
      mlp_dim=config.mlp_dim,
      max_len=max(config.max_target_length, config.max_eval_target_length),
      dropout_rate=config.dropout_rate,
      attention_dropout_rate=config.attention_dropout_rate,
      deterministic=False, decode=False,
      kernel_init=nn.initializers.xavier_uniform(),
      bias_init=nn.initializers.normal(stddev=1e-6))
  model = models.TransformerLM(train_config.replace(deterministic=True))
  lr = train.create_learning_rate_schedule(
      learning_rate=config.learning_rate, warmup_steps=config.warmup_steps)
  tx = optax.adamw(lr, b1=0.9, b2=0.98, eps=1e-9, weight_decay=config.weight_decay)
  if zero1:
    tx = z1.zero1(tx, axis_name="data", mesh=mesh, **zero1_kw)
  # utils.setup_initial_state, abstract: its shardings, no init run
  init = functools.partial(utils.init_train_state, model, tx, config)
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    shardings = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(abstract), mesh, config.logical_axis_rules)
  state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      utils.unbox_logicallypartioned_trainstate(abstract), shardings)
  step = jax.jit(train.train_step,
                 in_shardings=(shardings, NamedSharding(mesh, P(config.data_sharding)), None),
                 out_shardings=(shardings, None), static_argnums=(2, 3, 4),
                 donate_argnums=0)
  batch = {"inputs": jax.ShapeDtypeStruct(
      (config.per_device_batch_size * gpus, config.max_target_length), jnp.int32)}
  psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  with jax.set_mesh(mesh):
    return step.lower(state, batch, train_config, lr, 0.0,
                      jax.ShapeDtypeStruct((2,), jnp.uint32)), psi


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--flax", required=True, help="a checkout of google/flax")
  ap.add_argument("--gpus", default="8,16")
  ap.add_argument("--xla", default="", help="KEY=VALUE,... more XLA options, e.g. "
                  "xla_gpu_reduce_scatter_combine_threshold_bytes=8388608")
  ap.add_argument("--zero1-only", action="store_true",
                  help="the zero1 step alone (a checkout whose train_step "
                       "calls z1.value_and_grad, which takes zero1's tx only)")
  ap.add_argument("--zero1", default="", help="KEY=VALUE,... more keywords for "
                  "z1.zero1, e.g. inplace_bytes=1")
  args = ap.parse_args(argv)
  kw = aot.key_values(args.zero1) if args.zero1 else {}
  real_steps.table("flax lm1b's train step, data-parallel, its default config",
                   functools.partial(lowered, **kw), import_lm1b(args.flax),
                   [int(g) for g in args.gpus.split(",")], state_bytes=8,
                   zero1_only=args.zero1_only, xla=real_steps.xla_options(args.xla))


if __name__ == "__main__":
  main()
