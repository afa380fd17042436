"""Will the run fit? zero1-train's memory check, before anything big exists.

The estimate is :func:`zero1_jax.inspect.estimate` with BERT's activations:
``ACT_BYTES`` per token, hidden unit and layer, whatever the dtype. The
constant comes from the compiled step's ``memory_analysis()`` (temp bytes, one
device, fp16, batch 8 x 128 and 4 x 64): bert-tiny 190-224, bert-mini 185-193,
bert-small 203 bytes, so 200, the estimate landing 5-15% above the compiled
peak. Not per itemsize: softmax, LayerNorm and the loss run in fp32 whatever
the compute dtype, and fp16's casts add copies, so fp32 needs no more (bert-
tiny, 8 x 128 per device on 4 devices: about 126 bytes in fp32, 164 in fp16;
twice fp16's figure, as before, put an fp32 run 2.4x over its compiled peak). ``ZERO1_DEVICE_MEMORY_BYTES``
(see :func:`zero1_jax.inspect.capacity`) replaces the measured capacity, e.g.
to try the refusal on a small model.

Example:
  >>> from zero1_jax.models import bert
  >>> m = bert.make_config("bert-tiny", vocab_size=260, max_len=128)  # fp32
  >>> activation_bytes(m, micro_batch=8, seq_len=128) / 2**20
  50.0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zero1_jax import inspect
from zero1_jax.cli.common import UsageError, gib
from zero1_jax.core.transform import Zero1Config
from zero1_jax.deepspeed import tx as ds_tx

ACT_BYTES = 200


def activation_bytes(mcfg, micro_batch: int, seq_len: int) -> int:
  """What the backward pass keeps of one micro-batch of BERT-MLM."""
  return (ACT_BYTES * micro_batch * seq_len * mcfg.hidden_size
          * mcfg.num_layers)


def _estimate(num_params: int, mcfg, n: int, mb: int, seq_len: int,
              stage: int = 1, largest_leaf: int = 0,
              state_on_device: bool = True):
  item = jnp.dtype(mcfg.dtype).itemsize
  return inspect.estimate(
      num_params, n, param_itemsize=item,
      # Adam's two fp32 moments, plus an fp32 master unless the params are
      # fp32; none with offload_optimizer on an accelerator (host memory).
      state_bytes_per_param=(8 + (4 if item != 4 else 0)) * state_on_device,
      activation_bytes=activation_bytes(mcfg, mb, seq_len),
      stage=stage, largest_leaf=largest_leaf)


def batch_change(cfg, pinned: frozenset, n: int, mb: int) -> str | None:
  """What else a run with micro batch ``mb`` on ``n`` devices must change
  so DeepSpeed's batch rule (train = micro x accumulation x devices) still
  holds: ``""`` nothing, a flag, or a value to edit in the JSON when the
  JSON itself sets that key (``pinned``: a flag may not contradict it);
  None when no accumulation keeps the JSON's ``train_batch_size``.

  >>> from types import SimpleNamespace as C
  >>> seed = C(train_batch_size=32, gradient_accumulation_steps=1)
  >>> batch_change(seed, frozenset({"train_batch_size", "gradient_accumulation_steps"}), 4, 4)
  ' and "gradient_accumulation_steps": 2 in the JSON (32 = 4 x 2 x 4)'
  >>> batch_change(seed, frozenset({"train_batch_size"}), 4, 4)
  ' --gradient_accumulation_steps 2'
  >>> batch_change(seed, frozenset(), 4, 4), batch_change(seed, frozenset({"train_batch_size"}), 3, 8)
  ('', None)
  """
  if "train_batch_size" not in pinned:
    return ""          # the global batch follows micro batch and devices
  tb = cfg.train_batch_size
  if tb % (mb * n):
    return None
  gas = tb // (mb * n)
  if gas == cfg.gradient_accumulation_steps:
    return ""
  if "gradient_accumulation_steps" in pinned:
    return (f' and "gradient_accumulation_steps": {gas} in the JSON '
            f"({tb} = {mb} x {gas} x {n})")
  return f" --gradient_accumulation_steps {gas}"


def check(mcfg, init_fn, cfg, mesh, seq_len: int, *, model: str,
          ignore: bool = False, pinned: frozenset = frozenset()
          ) -> tuple[inspect.MemoryEstimate, int, str]:
  """Estimates per-device bytes from shapes alone (``jax.eval_shape`` of
  ``init_fn``: nothing is allocated) and raises :class:`UsageError` with
  what to change when it exceeds :func:`zero1_jax.inspect.capacity`: each
  suggestion keeps DeepSpeed's batch rule with the batch keys the JSON sets
  (``pinned``), saying what else to change (:func:`batch_change`).

  Returns ``(estimate, capacity bytes per device, where capacity comes from)``.
  """
  shapes = jax.eval_shape(init_fn, jax.random.key(0))
  num_params = sum(x.size for x in jax.tree.leaves(shapes))
  # ZeRO-2: whole gradients alive at once in the backward are the leaf being
  # reduced in place plus the group of small leaves packed into one bucket.
  sizes = [x.size for x in jax.tree.leaves(shapes)]
  small = Zero1Config("data", stage=2).inplace_threshold() // jnp.dtype(
      mcfg.dtype).itemsize
  largest = max(sizes, default=0) + sum(s for s in sizes if s < small)
  devices = list(mesh.devices.flat)
  n, mb = len(devices), cfg.train_micro_batch_size_per_gpu
  # On CPU, host and device memory are one: offload saves nothing there.
  offloaded = (cfg.zero.offload_optimizer == "cpu"
               and devices[0].platform != "cpu")
  zero = dict(stage=ds_tx.run_stage(cfg), largest_leaf=largest,
              state_on_device=not offloaded)
  est = _estimate(num_params, mcfg, n, mb, seq_len, **zero)
  cap, source = inspect.capacity(devices)
  if est.per_device <= cap or ignore:
    return est, cap, source
  cpu = devices[0].platform == "cpu"
  fixes = []
  smaller = next((b for b in range(mb - 1, 0, -1)
                  if batch_change(cfg, pinned, n, b) is not None
                  and _estimate(num_params, mcfg, n, b, seq_len,
                                **zero).per_device <= cap),
                 None)
  if smaller:
    micro = ('"train_micro_batch_size_per_gpu": {} in the JSON'
             if "train_micro_batch_size_per_gpu" in pinned
             else "--per_device_train_batch_size {}")
    fixes.append(micro.format(smaller) + batch_change(cfg, pinned, n, smaller))
  if cpu and n > 1:   # fewer simulated devices share the same RAM
    host = cap * n
    fewer = next((k for k in range(n - 1, 0, -1)
                  if batch_change(cfg, pinned, k, mb) is not None
                  and _estimate(num_params, mcfg, k, mb, seq_len,
                                **zero).per_device * k
                  <= host), None)
    if fewer:
      fixes.append(f"--num_devices {fewer}" + batch_change(cfg, pinned, fewer, mb))
  if jnp.dtype(mcfg.dtype).itemsize > 2:
    fixes.append("bf16 or fp16 in the config")
  fixes += ["a shorter --seq_len", "a smaller model"]
  raise UsageError(
      f"{model} will not fit: the step needs about {gib(est.per_device)} per "
      f"device (params {gib(est.params)}, gradients {gib(est.grads)}, "
      f"optimizer state {gib(est.state)}, activations {gib(est.activations)}) "
      f"on {n} device(s), but each has {gib(cap)} ({source}). Try "
      f"{', or '.join(fixes)} (or --ignore_memory_estimate to run anyway).")
