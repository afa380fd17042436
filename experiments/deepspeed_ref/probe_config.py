"""Probe DeepSpeed 0.19.8's config parser for the rules in docs/ds_0.19.8_reference.md.

Needs the torch + deepspeed venv of experiments/deepspeed_ref/record_parity.py; no
distributed launch (DeepSpeedConfig falls back to world size 1)::

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python experiments/deepspeed_ref/probe_config.py

Prints one line per probe: ``ok`` (accepted, with the parsed value where it
matters) or the exception DeepSpeed raises. Nothing imports this file.
"""
import logging

logging.disable(logging.CRITICAL)

from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402
from deepspeed.runtime.precision_config import (DeepSpeedBF16Config,  # noqa: E402
                                                DeepSpeedFP16Config)
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402

BASE = {"train_batch_size": 8}


def probe(label, extra, show=None):
  try:
    cfg = DeepSpeedConfig({**BASE, **extra})
  except Exception as e:  # pylint: disable=broad-except
    print(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:140]}")
    return
  print(f"{label}: ok" + (f" -> {show(cfg)!r}" if show else ""))


def main():
  print("gradient_clipping default:", DeepSpeedConfig(dict(BASE)).gradient_clipping)
  print("bf16 defaults:", DeepSpeedBF16Config().model_dump())
  print("fp16 defaults:", DeepSpeedFP16Config().model_dump())
  zero = DeepSpeedZeroConfig().model_dump()
  zero.pop("leaf_module")
  print("zero_optimization defaults:", zero)
  for key in ("amp", "sparse_gradients", "elasticity", "curriculum_learning",
              "graph_harvesting", "progressive_layer_drop", "compression_training",
              "eigenvalue", "sparse_attention", "nebula", "quantize_training"):
    probe(f"top-level {key}={{'enabled': false}}", {key: {"enabled": False}})
  for key, value in (("mics_shard_size", -1), ("mics_hierarchical_params_gather", False),
                     ("zeropp_loco_param", None)):
    probe(f"zero_optimization.{key}={value!r}", {"zero_optimization": {"stage": 1, key: value}})
  for key, value in (("reduce_bucket_size", 0), ("allgather_bucket_size", 0),
                     ("reduce_bucket_size", 5e8), ("reduce_bucket_size", 1.5), ("stage", 4),
                     ("compute_grad_norm", False), ("parameter_alignment", True),
                     ("prefetch_bucket_size", 10), ("param_persistence_threshold", 1),
                     ("model_persistence_threshold", 1), ("max_live_parameters", 10),
                     ("max_reuse_distance", 1), ("module_granularity_threshold", 0),
                     ("use_all_reduce_for_fetch_params", False), ("allgather_sequential", True),
                     ("stage3_allgather_sequential", True),
                     ("save_muon_momentum_buffer_in_memory", False), ("leaf_module", {}),
                     ("bogus_key", 1)):
    probe(f"zero_optimization.{key}={value!r}", {"zero_optimization": {"stage": 1, key: value}})
  for key, value in (("gradient_allreduce_op", "sum"), ("gradient_allreduce_op", "max"),
                     ("log_level", "info"), ("managed_gradient_accumulation", False),
                     ("disable_python_gc", True), ("totally_unknown_key", 1),
                     ("gradient_clipping", -1.0), ("gradient_clipping", "auto")):
    probe(f"top-level {key}={value!r}", {key: value},
          show=lambda c, k=key: getattr(c, k, "(ignored)"))
  probe("fp16.min_loss_scale=1e-4", {"fp16": {"enabled": True, "min_loss_scale": 1e-4}})
  probe("fp16.hysteresis=0", {"fp16": {"enabled": True, "hysteresis": 0}})
  probe("fp16.loss_scale_window=0 (fp16 off)", {"fp16": {"enabled": False, "loss_scale_window": 0}})
  probe("fp16.loss_scale_window=0 (fp16 dynamic)", {"fp16": {"enabled": True, "loss_scale_window": 0}})
  probe("bf16.check_overflow (old name)", {"bf16": {"enabled": True, "check_overflow": True}})
  probe("bf16.enabled='auto'", {"bf16": {"enabled": "auto"}}, show=lambda c: c.bfloat16_config.enabled)


if __name__ == "__main__":
  main()
