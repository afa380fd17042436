"""Every DeepSpeed 0.19 key zero1_jax accepts, and what it does with it.

``NOTES`` maps the keys that have no effect under XLA to (default, reason):
a value equal to the default (``ANY``: any value; ``DICT``: a disabled
section) logs one INFO line, unless it switches the feature off (false, 0,
none, a disabled section: nothing is asked for); any other value is a
request zero1_jax cannot honour and raises a UserWarning. ``TOP_LEVEL`` is every accepted top-level
key; ``MINIMUM`` the lower bounds DeepSpeed enforces.
"""
from __future__ import annotations

from typing import Any

ANY, DICT = object(), object()
_XLA = "XLA schedules, fuses and overlaps collectives itself"
# overlap_comm=true: the whole line (MESSAGES), not "has no effect".
OVERLAP_ON = (
    "zero_optimization.overlap_comm=True: what overlaps is XLA's choice, not "
    "zero1_jax's. On GPU, XLA's latency-hiding scheduler overlaps the gradient "
    "reduce-scatter with the backward: zero1-train turns it on for this "
    "config; in your own program set XLA_FLAGS="
    "--xla_gpu_enable_latency_hiding_scheduler=true before jax is imported. "
    "On CPU nothing changes")
_TORCH = "PyTorch/CUDA-specific; no equivalent under JAX/XLA"
_S3 = "only used by ZeRO stage 3"
_OFF = "no CPU/NVMe offload under XLA"
_MON = "DeepSpeed monitoring backend; use jax.profiler / your own logger"
_NI = "feature not implemented by zero1_jax"
_PROF = "DeepSpeed timers/profiler; use jax.profiler"
NOTES: dict[str, tuple[Any, str]] = {
    # true asks for output zero1_jax does not print: a warning
    "wall_clock_breakdown": (False, _PROF), "memory_breakdown": (False, _PROF),
    "flops_profiler": (DICT, _PROF), "timers": (DICT, _PROF),
    "dump_state": (False, _TORCH),
    "prescale_gradients": (ANY, "pre- or post-division give the same mean"),
    "gradient_predivide_factor": (ANY, "the mean of the gradients does not "
                                  "depend on where the division happens"),
    "zero_force_ds_cpu_optimizer": (ANY, _OFF), "aio": (ANY, _OFF),
    "disable_allgather": (ANY, _XLA),
    "compile": (ANY, "torch.compile; XLA compiles the whole step"),
    "vocabulary_size": (ANY, "tensor-core alignment hint only"),
    "dataloader_drop_last": (ANY, "data loading is outside zero1_jax"),
    "checkpoint": (ANY, "checkpoints are written with orbax"),
    "seq_parallel_communication_data_type": (ANY, "no sequence parallelism"),
    "allgather_size": (ANY, "legacy; read only with zero_optimization: true"),
    "data_types": (DICT, "gradients accumulate in their own dtype"),
    "activation_checkpointing": (DICT, "use jax.checkpoint in the model"),
    "torch_autocast": (DICT, _TORCH),
    # tensorboard, csv_monitor, wandb: honoured (monitor.py)
    **{k: (DICT, _MON) for k in ("comet", "comms_logger")},
    **{k: (DICT, _NI) for k in (
        "hybrid_engine", "autotuning", "data_efficiency", "pipeline",
        "tensor_parallel", "expert_parallel", "weight_quantization",
        "datastates_ckpt")},
    "log_level": (ANY, "zero1_jax logs through Python's logging "
                  "(logging.getLogger('zero1_jax'))"),
    "disable_python_gc": (ANY, _TORCH),
    "managed_gradient_accumulation": (True, "the step always accumulates "
                                      "gradient_accumulation_steps micro-batches"),
    "use_data_before_expert_parallelism": (False, "no expert parallelism"),
    "model_info": (ANY, "autotuning only"),
    "data_parallel_size": (ANY, "the data-parallel size is the mesh's"),
    "gradient_allreduce_op": ("mean", "gradients are averaged over devices"),
    "fp16.auto_cast": (False, "the model chooses its compute dtype"),
    "fp16.fp16_master_weights_and_grads": (False, "master weights are fp32"),
    "bf16.immediate_grad_update": (ANY, "the update is one XLA program"),
    **{"bf16." + k: (False, "bf16 keeps fp32 master weights and state")
       for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states")},
    "zero_optimization.overlap_comm": (ANY, OVERLAP_ON),
    "zero_optimization.contiguous_gradients": (ANY, "XLA owns buffer layout"),
    "zero_optimization.allgather_partitions": (ANY, "parameters are always "
                                               "all-gathered, never broadcast"),
    "zero_optimization.round_robin_gradients": (ANY, "CPU-offload only"),
    "zero_optimization.elastic_checkpoint": (ANY, "orbax checkpoints "
                                             "reshard to any world size"),
    "zero_optimization.use_multi_rank_bucket_allreduce": (ANY, _XLA),
    "zero_optimization.load_from_fp32_weights": (ANY, "orbax restores the "
                                                 "fp32 master weights saved"),
    "zero_optimization.ignore_unused_parameters": (ANY, "unused parameters "
                                                   "get zero gradients in JAX"),
    "zero_optimization.enable_sanity_checks": (ANY, _TORCH),
    "zero_optimization.legacy_stage1": (False, "removed in DeepSpeed 0.5.9"),
    "zero_optimization.parameter_alignment": (ANY, "XLA owns buffer layout"),
    **{"zero_optimization." + k: (ANY, _S3) for k in (
        "sub_group_size", "memory_efficient_linear", "override_module_apply",
        "pipeline_loading_checkpoint", "log_trace_cache_warnings",
        "gather_16bit_weights_on_model_save", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
        "prefetch_bucket_size", "param_persistence_threshold",
        "model_persistence_threshold", "max_live_parameters",
        "max_reuse_distance", "gather_16bit_weights_on_model_save",
        "module_granularity_threshold", "use_all_reduce_for_fetch_params",
        "allgather_sequential", "save_muon_momentum_buffer_in_memory",
        "leaf_module")},
    **{"zero_optimization." + k: (v, _OFF) for k, v in (
        ("offload_param", DICT), ("cpu_offload_param", False),
        ("cpu_offload_use_pin_memory", ANY))},
    **{"zero_optimization." + k: (v, "ZeRO++ / MiCS / ZenFlow: " + _NI)
       for k, v in (("zero_hpz_partition_size", 1),
                    ("zero_quantized_weights", False),
                    ("zero_quantized_nontrainable_weights", False),
                    ("zero_quantized_gradients", False),
                    ("zenflow", None))},
}
TOP_LEVEL = {"train_batch_size", "train_micro_batch_size_per_gpu",
             "gradient_accumulation_steps", "steps_per_print",
             "gradient_clipping", "fp16", "bf16", "bfloat16",
             "zero_optimization", "optimizer", "scheduler",
             "zero_allow_untested_optimizer", "communication_data_type",
             "sequence_parallel_size", "tensorboard", "csv_monitor", "wandb"
             } | {k for k in NOTES if "." not in k}
# Keys whose INFO line is a sentence of its own, not "<key> has no effect".
MESSAGES = {"zero_optimization.overlap_comm": OVERLAP_ON}
# Lower bounds DeepSpeed enforces whatever else the config says. fp16's
# loss_scale_window / min_loss_scale / hysteresis are checked only when
# dynamic fp16 is on (config.py, as runtime/precision_config.py does).
MINIMUM = {"fp16.loss_scale": 0, "zero_optimization.reduce_bucket_size": 1,
           "zero_optimization.allgather_bucket_size": 0, "steps_per_print": 1}
COMM_DTYPES = ("fp16", "bf16", "fp32")

_GONE = "DeepSpeed 0.19 removed it and rejects any config that contains it"
# Keys DeepSpeed 0.19 rejects whenever present, whatever their value
# (runtime/config.py _reject_removed_config_keys): key -> what to do instead.
REMOVED = {
    "amp": "NVIDIA Apex AMP; use 'fp16' or 'bf16' instead",
    "nebula": "Nebula checkpointing; checkpoints are written with orbax",
    "compression_training": "the compression library",
    "quantize_training": "Mixture-of-Quantization",
    "sparse_gradients": "sparse embedding-gradient compression; JAX "
                        "gradients are dense",
    "eigenvalue": "eigenvalue-based Mixture-of-Quantization",
    "sparse_attention": "DeepSpeed Sparse Attention",
    "elasticity": "elastic training; give train_batch_size / "
                  "train_micro_batch_size_per_gpu / gradient_accumulation_steps",
    "graph_harvesting": "graph harvesting",
    "curriculum_learning": "top-level curriculum learning (DeepSpeed moved it "
                           "to data_efficiency.data_sampling)",
    "progressive_layer_drop": "Progressive Layer Dropping",
    "zero_optimization.mics_shard_size": "MiCS ZeRO-3 sharding",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding",
    "zero_optimization.zeropp_loco_param": "LoCo-ZeRO++",
}


def removed_key_error(raw: dict) -> str | None:
  """The message for the first removed key in ``raw``, or None."""
  zero = raw.get("zero_optimization")
  present = [k for k in raw if k in REMOVED] + (
      [f"zero_optimization.{k}" for k in zero
       if f"zero_optimization.{k}" in REMOVED]
      if isinstance(zero, dict) else [])
  if not present:
    return None
  k = present[0]
  return f"'{k}' ({REMOVED[k]}): {_GONE}. Delete the key."
