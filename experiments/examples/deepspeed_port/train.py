"""A DeepSpeed training script ported to JAX with zero1_jax.

It takes the flags a Hugging Face / DeepSpeed script takes, reads the same
``ds_config.json`` (``"auto"`` values filled from the flags, as the HF
Trainer fills them), trains its own small Flax model with ``z1.initialize``,
checkpoints every ``--save_steps`` and resumes with
``--resume_from_checkpoint``. docs/deepspeed_port.md walks through the
differences from the PyTorch original.

  python experiments/examples/deepspeed_port/train.py --num_devices 4 \
    --deepspeed experiments/examples/deepspeed_port/ds_config.json \
    --per_device_train_batch_size 8 --learning_rate 3e-3 --max_steps 40 \
    --save_steps 20 --output_dir /tmp/port_run

Each step prints one JSON line ``{"step": ..., "loss": 2.3702..., ...}``: the
loss as Python's shortest decimal that reads back as the same float, so a
resumed run can be compared with an uninterrupted one bit for bit.
``z1.initialize`` logs DeepSpeed's optimizer-memory lines first (stderr).
"""

import argparse
import json
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--deepspeed", required=True, help="the DeepSpeed JSON")
  p.add_argument("--per_device_train_batch_size", type=int, default=8)
  p.add_argument("--learning_rate", type=float, default=1e-3)
  p.add_argument("--max_steps", type=int, required=True)
  p.add_argument("--output_dir", required=True)
  p.add_argument("--save_steps", type=int, default=0,
                 help="checkpoint every this many optimizer steps (0: never)")
  p.add_argument("--resume_from_checkpoint", nargs="?", const="latest",
                 default=None, help="'latest' (the last save into "
                 "OUTPUT_DIR/checkpoints; the default with no value), a "
                 "checkpoint directory, or one step of it: DIR/6")
  p.add_argument("--seed", type=int, default=42)
  p.add_argument("--num_devices", type=int, default=None,
                 help="simulated CPU devices (CPU only; must be set before "
                 "jax starts, hence a flag)")
  return p.parse_args(argv)


def fill_auto(config: dict, args: argparse.Namespace) -> dict:
  """The HF Trainer's "auto": each such value from the matching flag."""
  cfg = json.loads(json.dumps(config))
  if cfg.get("train_micro_batch_size_per_gpu") == "auto":
    cfg["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
  opt = cfg.get("optimizer", {}).get("params", {})
  if opt.get("lr") == "auto":
    opt["lr"] = args.learning_rate
  sched = cfg.get("scheduler", {}).get("params", {})
  if sched.get("warmup_max_lr") == "auto":
    sched["warmup_max_lr"] = args.learning_rate
  if sched.get("total_num_steps") == "auto":
    sched["total_num_steps"] = args.max_steps
  return cfg


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.num_devices:   # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.num_devices}")
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np

  import zero1_jax as z1

  class Classifier(nn.Module):   # the model: a small MLP over 32 features
    @nn.compact
    def __call__(self, x):
      x = nn.gelu(nn.Dense(128)(x))
      x = nn.gelu(nn.Dense(128)(x))
      return nn.Dense(10)(x)

  model = Classifier()
  teacher = np.random.default_rng(0).normal(size=(32, 10)).astype(np.float32)

  def batch_at(step: int, rows: int) -> dict:
    """The data: step ``step``'s batch, a pure function of the step (so a
    resumed run reads exactly what the uninterrupted one read)."""
    r = np.random.default_rng([args.seed, step])
    x = r.normal(size=(rows, 32)).astype(np.float32)
    return {"x": x, "label": (x @ teacher).argmax(-1).astype(np.int32)}

  def loss_fn(params, batch):    # the mean loss over one micro-batch
    logits = model.apply({"params": params}, batch["x"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["label"][:, None], 1))

  with open(args.deepspeed) as f:
    config = fill_auto(json.load(f), args)
  params = model.init(jax.random.key(args.seed), np.zeros((1, 32), np.float32))["params"]
  engine = z1.initialize(config=config, loss_fn=loss_fn, params=params)

  ckpt_dir = os.path.join(args.output_dir, "checkpoints")
  if args.resume_from_checkpoint:
    where, tag = args.resume_from_checkpoint, None
    if where == "latest":              # the last save into this run's directory
      where = ckpt_dir
    elif os.path.basename(os.path.normpath(where)).isdigit():   # .../checkpoints/6
      where, tag = os.path.split(os.path.normpath(where))
      tag = int(tag)
    path, client_state = engine.load_checkpoint(where, tag)
    print(f"resumed from {path} at step {engine.global_steps}", file=sys.stderr)

  os.makedirs(args.output_dir, exist_ok=True)
  with open(os.path.join(args.output_dir, "losses.jsonl"), "a") as log:
    while engine.global_steps < args.max_steps:
      batch = batch_at(engine.global_steps, engine.train_batch_size)
      metrics = engine.train_batch(batch)
      line = {"step": engine.global_steps, "loss": float(metrics["loss"]),
              "skipped": bool(metrics["skipped"]), "lr": engine.get_lr()[0]}
      print(json.dumps(line), flush=True)
      log.write(json.dumps(line) + "\n")
      if args.save_steps and engine.global_steps % args.save_steps == 0:
        engine.save_checkpoint(ckpt_dir, client_state={"seed": args.seed})
  engine.wait_checkpoints()
  report = engine.memory_report()
  print(f"trained {engine.global_steps} steps on {report['num_devices']} devices; "
        f"optimizer state on device 0: {report['sharded_bytes']:,} of "
        f"{report['replicated_bytes']:,} bytes", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
