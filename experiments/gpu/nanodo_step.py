"""google-deepmind/nanodo's own train step, compiled for H100s: optax against zero1.

A real program, not ours: nanodo's ``Trainer.step_fn`` (its ``jax.jit`` of
``_train_step`` with the shardings ``nn.get_sharding`` derives from the
abstract state) in its data-parallel mode (``fsdp_enabled=False``), lowered
on abstract arguments for the compile-only topology, twice: with nanodo's
optimizer (``optimizer.get_optimizer``: adamw in ``optax.MultiSteps``) and
with that one line wrapped, ``z1.zero1(get_optimizer(c.opt),
axis_name="data", mesh=mesh)``. Nothing else of nanodo changes; its data
pipeline's imports (grain, tfds, sentencepiece) and its logging's (clu) are
stubbed, as the step reads none of them. The model: GPT-2-small's shape (D
768, 12 heads and layers, F 3,072, context 1,024, nanodo's 32,100-token
vocabulary, bf16 compute on fp32 params), 2 sequences a GPU.

Printed per GPU count: XLA's estimated step (its cost model, not a
measurement), exposed collective time, the collectives, the arguments and
the peak per GPU from ``memory_analysis()``, and zero1's peak against
optax's less the state zero1 shards (adamw's moments and MultiSteps'
accumulated gradients, 12 bytes a param, ``(1 - 1/N)`` of them).

  git clone https://github.com/google-deepmind/nanodo /some/where/nanodo
  pip install ml_collections          # nanodo's config; gpu-aot extra as aot.py
  python -m experiments.gpu.nanodo_step --nanodo /some/where/nanodo --gpus 8,16
"""
from __future__ import annotations

import argparse
import sys

from experiments.gpu import real_steps   # first: it keeps jax off the GPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import zero1_jax as z1  # noqa: E402
from experiments.gpu.real_steps import stub_unused  # noqa: E402
from zero1_jax.inspect import gpu  # noqa: E402

UNUSED = ("grain", "grain.python", "tensorflow_datasets", "sentencepiece", "clu",
          "clu.metric_writers", "clu.periodic_actions")
SHAPE = dict(D=768, H=12, L=1024, N=12, F=3072, fsdp_enabled=False)
VOCAB, PER_GPU = 32100, 2


def import_nanodo(path: str):
  """nanodo's ``train``, ``model_factory``, ``optimizer`` and default config
  from a checkout at ``path``, its unused pipeline modules stubbed."""
  stub_unused(UNUSED)
  sys.path.insert(0, path)
  from nanodo import model_factory, optimizer, train
  from nanodo.configs import default
  return train, model_factory, optimizer, default


def lowered(nanodo, gpus: int, zero1: bool):
  """nanodo's step for ``gpus`` GPUs (8 a host), and its param count."""
  from flax import linen as nn
  from flax.training.train_state import TrainState
  from jax.sharding import NamedSharding, PartitionSpec as P
  train, model_factory, optimizer, default = nanodo
  c = default.get_config()
  c.model.update(**SHAPE)
  c.batch_size = PER_GPU * gpus
  mesh = gpu.mesh(gpus, ("data",), hosts=max(1, gpus // 8))
  model, get_loss_fn = model_factory.get_model_and_loss(c, VOCAB)
  tx = optimizer.get_optimizer(c.opt)
  if zero1:
    tx = z1.zero1(tx, axis_name="data", mesh=mesh)

  def init(rng, inputs):   # nanodo's _init_train_state, abstract
    return TrainState.create(apply_fn=model.apply,
                             params=model.init(rng, inputs)["params"], tx=tx)
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0),
                            jax.ShapeDtypeStruct((1, c.model.L), jnp.int32))
  shardings = nn.get_sharding(abstract, mesh)
  state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      nn.meta.unbox(abstract), shardings)
  trainer = train.Trainer(c=c, state=None, mesh=mesh, shardings=shardings,
                          get_loss_fn=get_loss_fn)
  batch = jax.ShapeDtypeStruct((c.batch_size, c.model.L), jnp.int32,
                               sharding=NamedSharding(mesh, P()))
  psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))
  return trainer.step_fn.lower(state, batch), psi


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--nanodo", required=True, help="a checkout of google-deepmind/nanodo")
  ap.add_argument("--gpus", default="8,16")
  ap.add_argument("--xla", default="", help="KEY=VALUE,... more XLA options, e.g. "
                  "xla_gpu_reduce_scatter_combine_threshold_bytes=8388608")
  args = ap.parse_args(argv)
  real_steps.table("nanodo's train step, data-parallel, GPT-2-small shape",
                   lowered, import_nanodo(args.nanodo),
                   [int(g) for g in args.gpus.split(",")], state_bytes=12,
                   xla=real_steps.xla_options(args.xla))


if __name__ == "__main__":
  main()
