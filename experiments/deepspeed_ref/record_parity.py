"""Record DeepSpeed 0.19.8 ZeRO-1 training runs as JSON fixtures (CPU, 2 ranks).

The fixtures under ``tests/fixtures/ds_parity/`` let a JAX test replay the
same steps without torch or deepspeed. Record all of them with::

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install "torch==2.13.0" "deepspeed==0.19.8" numpy
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/deepspeed --num_gpus=2 \\
        experiments/deepspeed_ref/record_parity.py --out-dir tests/fixtures/ds_parity

(``torchrun --nproc_per_node=2 experiments/deepspeed_ref/record_parity.py ...`` with
``DS_ACCELERATOR=cpu`` works too.) ``--only NAME[,NAME]`` records a subset.
Nothing here is imported by the package or the tests.

Model (torch layout; ``torch.nn.Linear`` stores its weight as (out, in) and
computes ``x @ W.T + b``)::

    fc1.weight (13, 7)   fc1.bias (13,)
    fc2.weight (5, 13)   fc2.bias (5,)
    gain       (1,)
    pred = gain * (tanh(x @ fc1.weight.T + fc1.bias) @ fc2.weight.T + fc2.bias)

175 parameters; every tensor has an odd size, so DeepSpeed's flat buffer does
not split evenly between the 2 ranks (it pads the last partition) and fc2.weight
straddles the partition boundary.

Data and loss. ``batches.x[s][m]`` / ``batches.y[s][m]`` are micro-step ``m``
of optimizer step ``s``: ``world * micro`` rows (``micro`` =
train_micro_batch_size_per_gpu, ``world`` = 2). Rank ``r`` gets rows
``[r*micro:(r+1)*micro]`` of each micro-batch. Each rank's loss is
``torch.nn.functional.mse_loss(pred, y)``: the mean over its ``micro`` rows and
the 5 outputs of ``(pred - y)**2``. DeepSpeed divides it by
gradient_accumulation_steps in ``backward`` and averages the gradients over the
ranks, so the gradient applied is the gradient of the mean squared error over
all ``gas * world * micro`` rows of step ``s`` (all micro-batches have equal
size). ``loss[s]`` is that global mean, computed with the parameters before
step ``s``.

Recorded per optimizer step ``s`` (after ``engine.step()`` at the boundary):
``params[s]`` the full fp32 master parameters (gathered with
``deepspeed.utils.safe_get_full_fp32_param``), ``skipped[s]`` (DeepSpeed's
``skipped_steps`` went up), ``grad_norm[s]`` (``engine.get_global_grad_norm()``,
the norm of the averaged, unscaled, unclipped gradient; null when the step was
skipped), ``lr[s]`` (the learning rate that step used) and, for fp16/bf16,
``params_lp[s]`` (the low-precision module weights, as float). Non-finite
numbers are written as the strings "nan", "inf", "-inf".

bf16 and fp16 run on DeepSpeed's CPU accelerator (the "cpu" FusedAdam kernel is
JIT-compiled with the system C++ compiler on first use); if a config fails to
run, the script records the error in ``<name>.error.txt`` instead and goes on.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

IN, HID, OUT = 7, 13, 5
WORLD = 2
STEPS = 6
SEED_INIT = 1234
SEED_DATA = 4321

BASE_ZERO = {"stage": 1, "allgather_partitions": True, "allgather_bucket_size": 5e8,
             "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": False}
ADAM = {"type": "Adam", "params": {"lr": 2e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                                   "weight_decay": 0.01}}


def _cfg(**over):
  cfg = {"train_batch_size": 8, "gradient_accumulation_steps": 1,
         "zero_optimization": dict(BASE_ZERO), "optimizer": json.loads(json.dumps(ADAM)),
         "steps_per_print": 10**9}
  cfg.update(over)
  return cfg


# name -> (DeepSpeed config, data options, note). y_scale multiplies the targets
# (large targets give a gradient norm well above 1, so clipping is active);
# bad_step puts +inf into x[0][0] of that step (rank 0's first row).
CONFIGS = {
    "seed_fp32": (
        _cfg(), {"y_scale": 1.0},
        "The issue's seed config with fp16 disabled, train_batch_size 32 -> 8 and "
        "lr 2e-5 -> 2e-2 so the fixture is small and the weights move visibly. "
        "It has no gradient_clipping key, so DeepSpeed 0.19.8's default 1.0 applies."),
    "default_clip": (
        _cfg(), {"y_scale": 4.0},
        "No gradient_clipping key: GRADIENT_CLIPPING_DEFAULT = 1.0 applies. Targets "
        "scaled by 4 so the gradient norm is > 1 and the clip is active (compare "
        "with clip_off, identical except gradient_clipping 0)."),
    "clip_off": (
        _cfg(gradient_clipping=0.0), {"y_scale": 4.0},
        "As default_clip with gradient_clipping 0.0 (no clipping)."),
    "sgd_default_clip": (
        _cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}},
             zero_allow_untested_optimizer=True),
        {"y_scale": 4.0},
        "torch.optim.SGD (lr 0.1, no momentum) with the default gradient_clipping 1.0: "
        "Adam is nearly invariant to the gradient scale, SGD shows the clip factor "
        "directly. SGD needs zero_allow_untested_optimizer with ZeRO."),
    "clip_gas2_rs": (
        _cfg(gradient_clipping=0.5, gradient_accumulation_steps=2,
             zero_optimization=dict(BASE_ZERO, reduce_scatter=True, reduce_bucket_size=16,
                                    allgather_bucket_size=16)),
        {"y_scale": 2.0},
        "gradient_clipping 0.5, 2 accumulation micro-steps per optimizer step "
        "(micro batch 2 per rank), reduce_scatter true, bucket sizes 16 elements."),
    "adam_l2": (
        _cfg(optimizer={"type": "Adam", "params": {"lr": 2e-2, "betas": [0.9, 0.999],
                                                   "eps": 1e-8, "weight_decay": 0.1,
                                                   "adam_w_mode": False}}),
        {"y_scale": 1.0},
        "Type Adam with adam_w_mode false: weight_decay 0.1 is added to the gradient "
        "(L2) after clipping and before the Adam moments. Default clipping 1.0 applies."),
    "warmuplr": (
        _cfg(gradient_clipping=0.0,
             scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                       "warmup_max_lr": 2e-2,
                                                       "warmup_num_steps": 4,
                                                       "warmup_type": "linear"}}),
        {"y_scale": 1.0},
        "WarmupLR linear over 4 steps from 0 to 2e-2; no clipping. lr[s] is the lr "
        "step s used: DeepSpeed sets the warmup_min_lr before step 0 and calls "
        "scheduler.step() after every applied step."),
    "bf16": (
        _cfg(bf16={"enabled": True}), {"y_scale": 1.0},
        "bf16 enabled (check_grad_overflow default true in 0.19.8). The model "
        "computes in bf16; params are the fp32 masters, params_lp the bf16 weights."),
    "fp16_dynamic": (
        _cfg(fp16={"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2,
                   "hysteresis": 2, "min_loss_scale": 1}), {"y_scale": 1.0},
        "The seed's fp16 enabled (dynamic loss scale 2**16, window 2, hysteresis 2). "
        "loss_scale[s] is the scale step s used."),
    "nonfinite_fp32": (
        _cfg(gradient_clipping=0.0), {"y_scale": 1.0, "bad_step": 2},
        "fp32, no clipping; x of step 2 has +inf in rank 0's first row: the loss stays "
        "finite (tanh saturates) but the gradients are NaN, so the global norm is "
        "invalid and ZeRO-1 skips the step (no Adam update, scheduler not stepped)."),
    "nonfinite_bf16": (
        _cfg(gradient_clipping=0.0, bf16={"enabled": True}), {"y_scale": 1.0, "bad_step": 2},
        "As nonfinite_fp32 with bf16 enabled (check_grad_overflow default true)."),
}


class MLP(nn.Module):
  def __init__(self):
    super().__init__()
    self.fc1 = nn.Linear(IN, HID)
    self.fc2 = nn.Linear(HID, OUT)
    self.gain = nn.Parameter(torch.ones(1))

  def forward(self, x, y):
    pred = self.gain * self.fc2(torch.tanh(self.fc1(x)))
    return F.mse_loss(pred, y)


def init_params():
  """Fixed numpy init, torch layout (weights are (out, in))."""
  rng = np.random.RandomState(SEED_INIT)
  return {
      "fc1.weight": (rng.randn(HID, IN) / math.sqrt(IN)).astype(np.float32),
      "fc1.bias": (0.1 * rng.randn(HID)).astype(np.float32),
      "fc2.weight": (rng.randn(OUT, HID) / math.sqrt(HID)).astype(np.float32),
      "fc2.bias": (0.1 * rng.randn(OUT)).astype(np.float32),
      "gain": np.array([1.25], np.float32),
  }


def make_batches(gas, micro, y_scale, bad_step=None):
  """x: [steps, gas, world*micro, IN], y: [steps, gas, world*micro, OUT]."""
  rng = np.random.RandomState(SEED_DATA)
  rows = WORLD * micro
  x = rng.randn(STEPS, gas, rows, IN).astype(np.float32)
  y = (y_scale * rng.randn(STEPS, gas, rows, OUT)).astype(np.float32)
  if bad_step is not None:
    x[bad_step, 0, 0, 0] = np.inf
  return x, y


def _num(v):
  v = float(v)
  if math.isfinite(v):
    return v
  return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _nested(a):
  return [_num(v) for v in a] if a.ndim == 1 else [_nested(r) for r in a]


def record(name, ds_config, data, note, rank):
  import deepspeed
  from deepspeed.utils import safe_get_full_fp32_param

  torch.manual_seed(0)
  model = MLP()
  init = init_params()
  with torch.no_grad():
    for n, p in model.named_parameters():
      p.copy_(torch.from_numpy(init[n]))
  engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                    config=json.loads(json.dumps(ds_config)))
  gas = engine.gradient_accumulation_steps()
  micro = engine.train_micro_batch_size_per_gpu()
  assert engine.train_batch_size() == gas * micro * WORLD
  x, y = make_batches(gas, micro, data["y_scale"], data.get("bad_step"))
  lp_dtype = next(engine.module.parameters()).dtype
  rows = slice(rank * micro, (rank + 1) * micro)

  out = {k: [] for k in ("params", "params_lp", "loss", "skipped", "grad_norm", "lr",
                         "loss_scale")}
  for s in range(STEPS):
    lr = float(engine.get_lr()[0])
    scale = float(getattr(engine.optimizer, "loss_scale", 1.0))
    skipped_before = engine.skipped_steps
    losses = []
    for m in range(gas):
      xb = torch.from_numpy(x[s, m, rows]).to(lp_dtype)
      yb = torch.from_numpy(y[s, m, rows]).to(lp_dtype)
      loss = engine(xb, yb)
      engine.backward(loss)
      engine.step()
      losses.append(loss.detach().float())
    local = torch.stack(losses).mean()
    dist.all_reduce(local)
    out["loss"].append(_num(local / WORLD))
    skipped = engine.skipped_steps > skipped_before
    out["skipped"].append(bool(skipped))
    gn = engine.get_global_grad_norm()
    gn = None if gn is None or skipped else _num(gn.item() if torch.is_tensor(gn) else gn)
    out["grad_norm"].append(gn)
    out["lr"].append(lr)
    out["loss_scale"].append(scale)
    full = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    out["params"].append({n: _nested(t.detach().float().cpu().numpy()) for n, t in full.items()})
    if lp_dtype != torch.float32:
      out["params_lp"].append({n: _nested(p.detach().float().cpu().numpy())
                               for n, p in engine.module.named_parameters()})
  if lp_dtype == torch.float32:
    del out["params_lp"]
  if not ds_config.get("fp16", {}).get("enabled"):
    del out["loss_scale"]

  if rank != 0:
    return None
  import deepspeed as ds
  return {
      "name": name,
      "note": note,
      "deepspeed_version": ds.__version__,
      "torch_version": torch.__version__,
      "world_size": WORLD,
      "ds_config": ds_config,
      "resolved": {"train_batch_size": engine.train_batch_size(),
                   "train_micro_batch_size_per_gpu": micro,
                   "gradient_accumulation_steps": gas,
                   "gradient_clipping": engine.gradient_clipping(),
                   "optimizer_class": type(engine.basic_optimizer).__name__,
                   "zero_optimizer_class": type(engine.optimizer).__name__,
                   "model_dtype": str(lp_dtype)},
      "model": {
          "description": "pred = gain * (tanh(x @ fc1.weight.T + fc1.bias) @ fc2.weight.T "
                         "+ fc2.bias); torch.nn.Linear weights are (out, in)",
          "layers": [["Linear", IN, HID], ["tanh"], ["Linear", HID, OUT], ["scale", "gain"]],
          "params": {n: list(v.shape) for n, v in init.items()},
          "param_order": list(init),
      },
      "loss_definition": "per rank F.mse_loss(pred, y) (mean over micro rows and 5 outputs); "
              "DeepSpeed divides by gradient_accumulation_steps and averages over ranks, "
              "so the update uses the gradient of the MSE over all rows of the step. "
              "loss[s] is that global mean before step s.",
      "batch_split": "batches.x[s][m] holds world*micro rows; rank r uses rows "
                     "[r*micro:(r+1)*micro]",
      "data": {"seed_init": SEED_INIT, "seed_data": SEED_DATA, **data},
      "init_params": {n: _nested(v) for n, v in init.items()},
      "batches": {"x": _nested(x), "y": _nested(y)},
      "steps": STEPS,
      **out,
  }


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out-dir", default="tests/fixtures/ds_parity")
  ap.add_argument("--only", default="", help="comma-separated config names")
  ap.add_argument("--local_rank", type=int, default=0)
  args = ap.parse_args()

  import deepspeed
  torch.set_num_threads(1)
  deepspeed.init_distributed(dist_backend="gloo")
  rank = dist.get_rank()
  assert dist.get_world_size() == WORLD, "run with 2 ranks"
  names = [n for n in args.only.split(",") if n] or list(CONFIGS)
  os.makedirs(args.out_dir, exist_ok=True)
  for name in names:
    ds_config, data, note = CONFIGS[name]
    try:
      res = record(name, ds_config, data, note, rank)
    except Exception as e:  # pylint: disable=broad-except
      if rank == 0:
        with open(os.path.join(args.out_dir, f"{name}.error.txt"), "w") as f:
          f.write(f"{type(e).__name__}: {e}\n")
        print(f"[ds_parity] {name}: FAILED {type(e).__name__}: {e}", flush=True)
      dist.barrier()
      continue
    if rank == 0:
      path = os.path.join(args.out_dir, f"{name}.json")
      with open(path, "w") as f:
        json.dump(res, f, separators=(",", ":"))
        f.write("\n")
      print(f"[ds_parity] {name}: wrote {path} ({os.path.getsize(path)} bytes) "
            f"skipped={res['skipped']} grad_norm={res['grad_norm']}", flush=True)
    dist.barrier()


if __name__ == "__main__":
  sys.exit(main())
