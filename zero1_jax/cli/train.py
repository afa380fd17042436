"""``zero1-train``: DeepSpeed's launch command, on a JAX mesh.

  zero1-train --num_devices 4 --deepspeed experiments/configs/ds_zero_stage1.json \\
    --model_name_or_path bert-large-uncased --per_device_train_batch_size 8 \\
    --output_dir ./output

On a machine without accelerators, ``--num_devices`` simulated CPU devices
are created; with GPUs, the first ``--num_devices`` GPUs are used.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from zero1_jax.cli import common

log = logging.getLogger("zero1_jax")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="zero1-train", description="Train a Flax BERT-MLM with ZeRO stage 1 "
      "from a DeepSpeed JSON config.")
  p.add_argument("--deepspeed", required=True, metavar="JSON",
                 help="DeepSpeed config file")
  p.add_argument("--num_devices", type=int, default=None,
                 help="data-parallel devices (CPU: simulated). Default: all")
  p.add_argument("--model_name_or_path", default="bert-tiny",
                 help="one of experiments.bert.SIZES (random init)")
  p.add_argument("--per_device_train_batch_size", type=int, default=None)
  p.add_argument("--gradient_accumulation_steps", type=int, default=None)
  p.add_argument("--train_batch_size", type=int, default=None)
  p.add_argument("--learning_rate", type=float, default=None)
  p.add_argument("--max_steps", type=int, default=100,
                 help="optimizer steps to run")
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--train_file", default=None,
                 help="any text file; default: the Python stdlib's sources")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--output_dir", default="./output")
  p.add_argument("--logging_steps", type=int, default=10)
  p.add_argument("--no_progress", action="store_true",
                 help="no progress bar (log lines instead)")
  return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
  """Trains; returns the summary written to ``output_dir/summary.json``."""
  jax = common.start_jax(args.num_devices)
  import numpy as np

  import zero1_jax as z1
  from experiments import bert, data
  from zero1_jax import config as zconfig
  from zero1_jax import engine as zengine

  mesh = common.data_mesh(jax, args.num_devices)
  n = mesh.shape["data"]
  cfg = zconfig.load_config(args.deepspeed, world_size=n).with_overrides(
      train_micro_batch_size_per_gpu=args.per_device_train_batch_size,
      gradient_accumulation_steps=args.gradient_accumulation_steps,
      train_batch_size=args.train_batch_size, lr=args.learning_rate)
  dtype = zengine.compute_dtype(cfg)
  mcfg = bert.make_config(args.model_name_or_path, vocab_size=data.VOCAB_SIZE,
                          max_len=args.seq_len, dtype=dtype or jax.numpy.float32)
  print(f"[zero1-train] {args.model_name_or_path}: architecture only, weights "
        f"start random (nothing is downloaded).", flush=True)
  params = bert.init_params(mcfg, jax.random.key(args.seed))
  corpus = data.load_corpus(args.train_file)
  batches = data.MLMBatches(corpus, args.seq_len, cfg.train_batch_size,
                            seed=args.seed)
  engine = zengine.initialize(cfg, bert.make_loss_fn(mcfg), params, mesh)
  mem = common.log_memory(engine, cfg)

  os.makedirs(args.output_dir, exist_ok=True)
  with open(os.path.join(args.output_dir, "ds_config.json"), "w") as f:
    json.dump(cfg.to_dict(), f, indent=2)
  metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
  history = []
  bar = common.progress(args.max_steps, disable=args.no_progress)
  t0 = time.perf_counter()
  with open(metrics_path, "w") as out:
    for step in range(args.max_steps):
      t = time.perf_counter()
      m = engine.train_batch(batches.batch_at(step))
      row = {"step": engine.global_steps, "loss": float(m["loss"]),
             "grad_norm": float(m["grad_norm"]), "skipped": bool(m["skipped"]),
             "loss_scale": float(m["loss_scale"]),
             "samples_per_s": cfg.train_batch_size / (time.perf_counter() - t)}
      history.append(row)
      out.write(json.dumps(row) + "\n")
      bar.update(1)
      bar.set_postfix(loss=f"{row['loss']:.3f}",
                      samples_s=f"{row['samples_per_s']:.1f}")
      if args.no_progress and (step % args.logging_steps == 0
                               or step == args.max_steps - 1):
        print(f"step {row['step']:5d} loss {row['loss']:.4f} scale "
              f"{row['loss_scale']:.0f} {row['samples_per_s']:.1f} samples/s",
              flush=True)
  bar.close()
  wall = time.perf_counter() - t0
  summary = common.write_outputs(args.output_dir, history, mem, engine, wall)
  print(f"[zero1-train] {engine.global_steps} steps ({engine.skipped_steps} "
        f"skipped) in {wall:.1f}s; loss {summary['first_loss']:.3f} -> "
        f"{summary['last_loss']:.3f}; outputs in {args.output_dir}", flush=True)
  return summary


def main(argv=None) -> int:
  args = parse_args(argv)
  common.setup_logging()
  return common.guarded(run, args, "zero1-train")


if __name__ == "__main__":
  sys.exit(main())
