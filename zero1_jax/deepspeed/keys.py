"""Every DeepSpeed 0.19 key zero1_jax accepts, and what it does with it.

``NOTES`` maps the keys that have no effect under XLA to (default, reason):
a value equal to the default (``ANY``: any value; ``DICT``: a disabled
section) logs one INFO line; any other value is a request zero1_jax cannot
honour and raises a UserWarning. ``TOP_LEVEL`` is every accepted top-level
key; ``MINIMUM`` the lower bounds DeepSpeed enforces.
"""
from __future__ import annotations

from typing import Any

ANY, DICT = object(), object()
_XLA = "XLA schedules, fuses and overlaps collectives itself"
_OVERLAP = ("XLA schedules collectives itself; zero1-train turns on XLA's "
            "latency-hiding scheduler on GPU when it is true "
            "(--xla_gpu_enable_latency_hiding_scheduler)")
_TORCH = "PyTorch/CUDA-specific; no equivalent under JAX/XLA"
_S3 = "only used by ZeRO stage 3"
_OFF = "no CPU/NVMe offload under XLA"
_MON = "DeepSpeed monitoring backend; use jax.profiler / your own logger"
_NI = "feature not implemented by zero1_jax"
_PROF = "DeepSpeed timers/profiler; use jax.profiler"
NOTES: dict[str, tuple[Any, str]] = {
    "wall_clock_breakdown": (ANY, _PROF), "memory_breakdown": (ANY, _PROF),
    "flops_profiler": (DICT, _PROF), "timers": (DICT, _PROF),
    "dump_state": (ANY, _TORCH),
    "prescale_gradients": (ANY, "pre- or post-division give the same mean"),
    "gradient_predivide_factor": (ANY, "the mean of the gradients does not "
                                  "depend on where the division happens"),
    "sparse_gradients": (ANY, "JAX gradients are always dense"),
    "zero_force_ds_cpu_optimizer": (ANY, _OFF), "aio": (ANY, _OFF),
    "disable_allgather": (ANY, _XLA),
    "graph_harvesting": (ANY, "CUDA graphs; XLA compiles the whole step"),
    "compile": (ANY, "torch.compile; XLA compiles the whole step"),
    "vocabulary_size": (ANY, "tensor-core alignment hint only"),
    "dataloader_drop_last": (ANY, "data loading is outside zero1_jax"),
    "checkpoint": (ANY, "checkpoints are written with orbax"),
    "seq_parallel_communication_data_type": (ANY, "no sequence parallelism"),
    "allgather_size": (ANY, "legacy; read only with zero_optimization: true"),
    "data_types": (DICT, "gradients accumulate in their own dtype"),
    "activation_checkpointing": (DICT, "use jax.checkpoint in the model"),
    "amp": (DICT, "Apex AMP is PyTorch-only; use fp16 or bf16"),
    "torch_autocast": (DICT, _TORCH),
    **{k: (DICT, _MON) for k in ("tensorboard", "wandb", "csv_monitor",
                                  "comet", "comms_logger")},
    **{k: (DICT, _NI) for k in (
        "hybrid_engine", "autotuning", "progressive_layer_drop",
        "curriculum_learning", "data_efficiency", "compression_training",
        "eigenvalue", "sparse_attention", "elasticity")},
    "fp16.auto_cast": (False, "the model chooses its compute dtype"),
    "fp16.fp16_master_weights_and_grads": (False, "master weights are fp32"),
    "bf16.immediate_grad_update": (ANY, "the update is one XLA program"),
    **{"bf16." + k: (False, "bf16 keeps fp32 master weights and state and "
                     "never skips steps") for k in (
                         "check_grad_overflow", "bf16_master_weights_and_grads",
                         "bf16_optimizer_states")},
    "zero_optimization.overlap_comm": (ANY, _OVERLAP),
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
    **{"zero_optimization." + k: (ANY, _S3) for k in (
        "sub_group_size", "memory_efficient_linear", "override_module_apply",
        "pipeline_loading_checkpoint", "log_trace_cache_warnings",
        "gather_16bit_weights_on_model_save", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params")},
    **{"zero_optimization." + k: (v, _OFF) for k, v in (
        ("offload_optimizer", DICT), ("offload_param", DICT),
        ("cpu_offload", False), ("cpu_offload_param", False),
        ("cpu_offload_use_pin_memory", ANY))},
    **{"zero_optimization." + k: (v, "ZeRO++ / MiCS / ZenFlow: " + _NI)
       for k, v in (("zero_hpz_partition_size", 1),
                    ("zero_quantized_weights", False),
                    ("zero_quantized_nontrainable_weights", False),
                    ("zero_quantized_gradients", False),
                    ("zeropp_loco_param", None), ("mics_shard_size", -1),
                    ("mics_hierarchical_params_gather", False),
                    ("zenflow", None))},
}
TOP_LEVEL = {"train_batch_size", "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps", "steps_per_print", "gradient_clipping",
        "fp16", "bf16", "bfloat16", "zero_optimization", "optimizer",
        "scheduler", "zero_allow_untested_optimizer",
        "communication_data_type"} | {k for k in NOTES if "." not in k}
MINIMUM = {"fp16.loss_scale": 0, "fp16.loss_scale_window": 1, "fp16.hysteresis": 1,
        "fp16.min_loss_scale": 1, "zero_optimization.reduce_bucket_size": 0,
        "zero_optimization.allgather_bucket_size": 0, "gradient_clipping": 0,
        "steps_per_print": 1}
COMM_DTYPES = ("fp16", "bf16", "fp32")
