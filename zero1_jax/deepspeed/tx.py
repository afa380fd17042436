"""The ZeRO transformation a DeepSpeed config describes: the compute dtype
(fp16 / bf16 sections), the loss-scale policy (fp16's, or which non-finite
steps are skipped without one), the stage run, and the :func:`zero1` /
:func:`zero2` call with the config's buckets, clipping and offload.

:class:`zero1_jax.deepspeed.engine.Engine` builds its ``tx`` here (the names
stay importable from :mod:`zero1_jax.deepspeed.engine`).

Example:
  >>> from zero1_jax.deepspeed.config import load_config
  >>> cfg = load_config({"train_batch_size": 4,
  ...                    "zero_optimization": {"stage": 0}}, world_size=1)
  >>> run_stage(cfg), compute_dtype(cfg)
  (1, None)
"""

from __future__ import annotations

import logging

import jax.numpy as jnp

from zero1_jax.deepspeed import config as zconfig
from zero1_jax.deepspeed import optim as ds_optim
from zero1_jax.core import precision
from zero1_jax.core.transform import Zero1Transformation, zero1
from zero1_jax.core.zero2 import zero2

logger = logging.getLogger("zero1_jax")
_COMM = {"fp16": jnp.float16, "bf16": jnp.bfloat16, "fp32": jnp.float32}


def compute_dtype(cfg: zconfig.DeepSpeedConfig):
  """The parameter dtype the config asks for: float16, bfloat16 or None."""
  if cfg.fp16.enabled:
    return jnp.float16
  if cfg.bf16.enabled:
    return jnp.bfloat16
  return None


def loss_scale_policy(cfg: zconfig.DeepSpeedConfig) -> precision.LossScale:
  """DeepSpeed's fp16 section as a :mod:`zero1_jax.core.precision` policy."""
  f = cfg.fp16
  if not f.enabled:
    # DeepSpeed 0.19 ZeRO-1/2 skips a step with a non-finite gradient norm:
    # bf16 when check_grad_overflow, fp32 when the norm is computed
    # (runtime/engine.py _configure_zero_optimizer, zero/stage_1_and_2.py).
    skip = (cfg.bf16.check_grad_overflow if cfg.bf16.enabled
            else cfg.zero.compute_grad_norm)
    if cfg.zero.stage == 0 and not cfg.bf16.enabled:
      skip = False   # stage 0's torch optimizer has no overflow check (engine.py)
    return precision.NoLossScale(skip_nonfinite=skip)
  if not f.dynamic_loss_scale:
    return precision.StaticLossScale(float(f.loss_scale))
  return precision.DynamicLossScale(
      initial_scale_power=f.initial_scale_power,
      loss_scale_window=f.loss_scale_window, hysteresis=f.hysteresis,
      consecutive_hysteresis=f.consecutive_hysteresis,
      min_loss_scale=float(f.min_loss_scale))


def run_stage(cfg: zconfig.DeepSpeedConfig) -> int:
  """The ZeRO stage the engine runs: the config's, stage 0 as stage 1 (the
  same update; DeepSpeed's stage-0 rule for a non-finite fp32 step, applied,
  is kept by :func:`loss_scale_policy`)."""
  return max(1, cfg.zero.stage)


def build_tx(cfg: zconfig.DeepSpeedConfig, axis_name: str = "data"
             ) -> Zero1Transformation:
  """The :func:`zero1` (stage 0 or 1) or :func:`zero2` (stage 2)
  transformation a DeepSpeed config describes.

  ``reduce_bucket_size`` / ``allgather_bucket_size`` count elements in
  DeepSpeed; here they become bytes at the gradient / parameter dtype
  (stage 2 reduces large leaves alone as the backward produces them and
  caps each group of small leaves at ``reduce_bucket_size``: see
  :func:`zero2`).
  """
  if cfg.zero.stage == 0:
    logger.info("zero_optimization.stage=0 (DeepSpeed's plain data "
                "parallelism, also what a config without zero_optimization "
                "means) runs as ZeRO stage 1: the same update and the same "
                "weights, with 1/N of the optimizer state on each device")
  itemsize = jnp.dtype(compute_dtype(cfg) or jnp.float32).itemsize
  comm = (_COMM[cfg.communication_data_type]
          if cfg.communication_data_type else None)
  make = zero2 if run_stage(cfg) == 2 else zero1
  return make(
      ds_optim.build_optimizer(cfg.optimizer, cfg.scheduler), axis_name=axis_name,
      reduce="reduce_scatter" if cfg.zero.reduce_scatter else "all_reduce",
      bucket_bytes=int(cfg.zero.reduce_bucket_size) * itemsize,
      gather_bucket_bytes=int(cfg.zero.allgather_bucket_size) * itemsize,
      max_grad_norm=cfg.gradient_clipping if cfg.gradient_clipping > 0 else None,
      clip_rule="deepspeed",
      loss_scale=loss_scale_policy(cfg), reduce_dtype=comm,
      offload=cfg.zero.offload_optimizer == "cpu")
