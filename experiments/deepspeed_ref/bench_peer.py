"""DeepSpeed ZeRO-1 as a peer: the same BERT MLM, batch and AdamW on CPU ranks.

Optional and separate from everything else (never imported by the package or
the tests). It needs torch and deepspeed, which the JAX venv does not have::

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install "torch==2.13.0+cpu" deepspeed numpy
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/deepspeed --num_gpus=2 \\
        experiments/deepspeed_ref/bench_peer.py --size s --out experiments/results/deepspeed.json

Each rank builds two engines over identical copies of the model, DeepSpeed
stage 0 (plain data parallel, the DDP baseline) and stage 1 (ZeRO-1), and
times them interleaved, round by round, like ``experiments.bench``. It
records per-rank optimizer-state bytes (the fp32 master partition plus Adam's
moments) next to 12 Psi / N and the step-time ratio stage 1 / stage 0.

The model mirrors :mod:`zero1_jax.models.bert` (post-LN encoder, learned positions,
tied MLM decoder with bias, fp32) and has exactly its parameter count.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

def _load_data_module():
  """zero1_jax/data.py is numpy only; load it by path, since importing the
  zero1_jax package would need jax in this torch venv."""
  import importlib.util
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                      "zero1_jax", "data.py")
  spec = importlib.util.spec_from_file_location("zero1_jax_data", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


data = _load_data_module()

SIZES = {  # == experiments.bench.plan.SIZES
    "xxs": dict(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=128),
    "xs": dict(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=256),
    "s": dict(hidden_size=128, num_layers=4, num_heads=2, intermediate_size=512),
    "m": dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024),
}


class Block(nn.Module):
  def __init__(self, h, heads, inter, eps):
    super().__init__()
    self.heads = heads
    self.query, self.value, self.out = (nn.Linear(h, h) for _ in range(3))
    self.key = nn.Linear(h, h, bias=False)   # as zero1_jax/models/bert.py: no key bias
    self.attention_ln = nn.LayerNorm(h, eps=eps)
    self.intermediate = nn.Linear(h, inter)
    self.output = nn.Linear(inter, h)
    self.output_ln = nn.LayerNorm(h, eps=eps)

  def forward(self, x):
    b, l, h = x.shape
    split = lambda t: t.view(b, l, self.heads, h // self.heads).transpose(1, 2)
    ctx = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)),
                                         split(self.value(x)))
    x = self.attention_ln(x + self.out(ctx.transpose(1, 2).reshape(b, l, h)))
    y = self.output(F.gelu(self.intermediate(x)))
    return self.output_ln(x + y)


class BertMLM(nn.Module):
  def __init__(self, vocab, max_len, hidden_size, num_layers, num_heads,
               intermediate_size, eps=1e-12):
    super().__init__()
    self.token_embed = nn.Embedding(vocab, hidden_size)
    self.position_embed = nn.Parameter(torch.randn(max_len, hidden_size) * 0.02)
    self.embed_ln = nn.LayerNorm(hidden_size, eps=eps)
    self.layers = nn.ModuleList(Block(hidden_size, num_heads, intermediate_size, eps)
                                for _ in range(num_layers))
    self.mlm_transform = nn.Linear(hidden_size, hidden_size)
    self.mlm_ln = nn.LayerNorm(hidden_size, eps=eps)
    self.mlm_bias = nn.Parameter(torch.zeros(vocab))
    for m in self.modules():
      if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.trunc_normal_(m.weight, std=0.02)

  def forward(self, input_ids, labels):
    x = self.token_embed(input_ids) + self.position_embed[: input_ids.shape[1]]
    x = self.embed_ln(x)
    for layer in self.layers:
      x = layer(x)
    h = self.mlm_ln(F.gelu(self.mlm_transform(x)))
    logits = h @ self.token_embed.weight.t() + self.mlm_bias
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1),
                           ignore_index=data.IGNORE_INDEX)


def tensor_bytes(ts) -> int:
  return sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))


def optimizer_bytes(engine, stage: int) -> dict:
  """Per-rank bytes of Adam moments and of the fp32 master copy."""
  opt = engine.optimizer
  inner = getattr(opt, "optimizer", opt)
  moments = tensor_bytes(t for st in inner.state.values() for t in st.values()
                         if torch.is_tensor(t) and t.numel() > 1)
  if stage == 0:   # fp32 training: the parameters are the master copy
    master = tensor_bytes(p for p in engine.module.parameters())
  else:
    master = tensor_bytes(opt.single_partition_of_fp32_groups)
  return dict(moments=moments, master=master, total=moments + master)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--size", default="s", choices=sorted(SIZES))
  ap.add_argument("--seq-len", type=int, default=64)
  ap.add_argument("--global-batch", type=int, default=16)
  ap.add_argument("--rounds", type=int, default=30)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
  ap.add_argument("--out", default="experiments/results/deepspeed.json")
  ap.add_argument("--local_rank", type=int, default=0)
  args = ap.parse_args()

  import deepspeed
  torch.set_num_threads(args.threads)
  deepspeed.init_distributed(dist_backend="gloo")
  rank, world = dist.get_rank(), dist.get_world_size()
  cfg = SIZES[args.size]

  engines = {}
  for stage in (0, 1):
    torch.manual_seed(0)
    model = BertMLM(data.VOCAB_SIZE, args.seq_len, **cfg)
    ds_config = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.global_batch // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_scatter": True,
                              "overlap_comm": False, "contiguous_gradients": True},
        "steps_per_print": 10 ** 9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config)
    engines[stage] = engine
  psi = sum(p.numel() for p in engines[0].module.parameters())

  corpus = data.load_corpus(None, cap=1 << 20)
  batches = data.MLMBatches(corpus, args.seq_len, args.global_batch, seed=0)
  per = args.global_batch // world

  def local(step):
    b = batches.batch_at(step % 4)
    sl = slice(rank * per, (rank + 1) * per)
    return (torch.from_numpy(b["input_ids"][sl]).long(),
            torch.from_numpy(b["labels"][sl]).long())

  def one(stage, step):
    ids, labels = local(step)
    dist.barrier()
    t0 = time.perf_counter()
    loss = engines[stage](ids, labels)
    engines[stage].backward(loss)
    engines[stage].step()
    dist.barrier()
    return time.perf_counter() - t0, float(loss)

  for s in range(args.warmup):
    for stage in (0, 1):
      one(stage, s)
  times = {0: [], 1: []}
  losses = {0: [], 1: []}
  for r in range(args.rounds):
    for stage in ((0, 1) if r % 2 == 0 else (1, 0)):
      t, loss = one(stage, r)
      times[stage].append(t)
      losses[stage].append(loss)

  mem = {stage: optimizer_bytes(engines[stage], stage) for stage in (0, 1)}
  per_round = [a / b for a, b in zip(times[1], times[0])]
  res = dict(
      deepspeed=deepspeed.__version__, torch=torch.__version__, world=world,
      backend=dist.get_backend(), size=args.size, psi=psi, seq_len=args.seq_len,
      global_batch=args.global_batch, rounds=args.rounds, threads_per_rank=args.threads,
      step_ms={f"stage{s}": 1e3 * statistics.median(times[s]) for s in (0, 1)},
      zero1_over_ddp=statistics.median(per_round),
      zero1_over_ddp_ratio_of_medians=statistics.median(times[1]) / statistics.median(times[0]),
      per_round_iqr=[float(np.percentile(per_round, 25)), float(np.percentile(per_round, 75))],
      optimizer_bytes_per_rank={f"stage{s}": mem[s] for s in (0, 1)},
      twelve_psi_over_n=12 * psi / world,
      stage1_over_twelve_psi_over_n=mem[1]["total"] / (12 * psi / world),
      final_loss={f"stage{s}": losses[s][-1] for s in (0, 1)})
  if rank == 0:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
  main()
