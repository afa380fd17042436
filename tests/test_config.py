"""Specification of the DeepSpeed-JSON layer (zero1_jax.deepspeed).

Each test names the DeepSpeed rule it pins down; the source file the rule was
read from is listed in docs/deepspeed_config.md. Expected numbers are written
out by hand from DeepSpeed's formulas, not computed with the code under test.
"""
import json
import logging
import pathlib

import pytest

from zero1_jax.deepspeed.config import DeepSpeedConfig, load_config
from zero1_jax.deepspeed.schema import BF16Config, FP16Config, ZeroConfig
from helpers import SEED_CONFIG, config_error as err, fresh_ds_notes, load

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEED = SEED_CONFIG


fresh_ds_notes = fresh_ds_notes   # autouse fixture (helpers.py)


def base(**over):
  return load({"train_batch_size": 8}, **over)


# ----------------------------------------------------------------- seed config
def test_seed_config_loads_as_is_from_file_and_dict():
  path = ROOT / "experiments" / "configs" / "ds_zero_stage1.json"
  assert json.loads(path.read_text()) == SEED
  cfg = load_config(path, world_size=4)
  assert cfg == load_config(SEED, world_size=4)
  assert isinstance(cfg, DeepSpeedConfig) and cfg.source == str(path)
  assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
          cfg.gradient_accumulation_steps) == (32, 8, 1)
  assert cfg.zero == ZeroConfig(stage=1, reduce_scatter=False,
                                allgather_bucket_size=500_000_000,
                                overlap_comm=True)
  assert type(cfg.zero.allgather_bucket_size) is int  # 5e8 is a JSON float
  assert cfg.fp16 == FP16Config(enabled=True) and cfg.bf16 == BF16Config()
  assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print is None
  assert cfg.optimizer.type == "Adam" and cfg.optimizer.params["lr"] == 2e-5
  assert cfg.scheduler is None and cfg.raw == SEED


def test_no_effect_keys_log_one_info_line_each(caplog):
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    load(SEED, 4)
  msgs = [r.getMessage() for r in caplog.records if r.name == "zero1_jax"]
  for key in ("allgather_partitions", "contiguous_gradients"):
    hits = [m for m in msgs if f"zero_optimization.{key}=" in m]
    assert len(hits) == 1 and "no effect" in hits[0], (key, msgs)
  assert not any("reduce_scatter" in m or "bucket_size" in m for m in msgs)
  # overlap_comm true does something (XLA's latency-hiding scheduler, under
  # zero1-train): one line that says what, never "has no effect"
  hits = [m for m in msgs if "overlap_comm" in m]
  assert len(hits) == 1 and "no effect" not in hits[0], msgs
  for words in ("latency-hiding scheduler", "zero1-train turns it on",
                "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true "
                "before jax is imported", "On CPU nothing changes"):
    assert words in hits[0], (words, hits[0])


def test_keys_that_switch_a_feature_off_say_nothing(caplog):
  """wall_clock_breakdown false, a disabled monitor, activation_checkpointing
  all false: nothing is asked for that zero1_jax does not do, so no line
  (an HF config printed five such notes on every run). Switched on, each is
  noted or warned about."""
  off = dict(wall_clock_breakdown=False, memory_breakdown=False,
             prescale_gradients=False, csv_monitor={"enabled": False},
             activation_checkpointing={"partition_activations": False,
                                       "contiguous_memory_optimization": False})
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    base(**off)
  assert not [r for r in caplog.records if r.name == "zero1_jax"], caplog.text
  # true asks for timings / a memory report / a state dump that zero1_jax
  # does not print: a warning, not an INFO line nobody sees
  for key in ("wall_clock_breakdown", "memory_breakdown", "dump_state"):
    with pytest.warns(UserWarning, match=f"{key}=True is recognised but not "
                      f"honoured by zero1_jax"):
      base(**{key: True})
  with pytest.warns(UserWarning, match="comet"):
    base(comet={"enabled": True})


# ----------------------------------------------------------------- batch triple
@pytest.mark.parametrize("given,ws,want", [
    ((32, 4, 2), 4, (32, 4, 2)),      # all three given: only checked
    ((32, 4, None), 4, (32, 4, 2)),   # gas = tb // mb // ws
    ((32, None, 2), 4, (32, 4, 2)),   # mb = tb // ws // gas
    ((None, 4, 2), 4, (32, 4, 2)),    # tb = mb * gas * ws
    ((32, None, None), 4, (32, 8, 1)),  # gas = 1, mb = tb // ws
    ((None, 4, None), 4, (16, 4, 1)),   # gas = 1, tb = mb * ws
    ((32.0, None, 1.0), 2, (32, 16, 1)),  # integral floats are accepted
])
def test_batch_triple_derivation(given, ws, want):
  keys = ("train_batch_size", "train_micro_batch_size_per_gpu",
          "gradient_accumulation_steps")
  cfg = load({k: v for k, v in zip(keys, given) if v is not None}, ws)
  assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
          cfg.gradient_accumulation_steps, cfg.world_size) == (*want, ws)


@pytest.mark.parametrize("d,ws,msg", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 2, "32 != 4 * 2 * 2"),
    ({"train_batch_size": 32}, 3, "32 != 10 * 1 * 3"),   # floor division
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2,
     "30 != 4 * 3 * 2"),
])
def test_batch_mismatch_uses_deepspeeds_message(d, ws, msg):
  err(d, "Check batch related parameters. train_batch_size is not equal to "
      "micro_batch_per_gpu * gradient_acc_step * world_size", msg, ws=ws)


def test_batch_mismatch_says_what_would_hold():
  """After DeepSpeed's words: the accumulation that makes the rule hold, or
  that no accumulation can (the seed JSON with 4 per device on 4 devices)."""
  seed = {"train_batch_size": 32, "gradient_accumulation_steps": 1,
          "train_micro_batch_size_per_gpu": 4}
  err(seed, "32 != 4 * 1 * 4 (gradient_accumulation_steps 2 would make it "
      "hold with the other two; or leave one of the three out", ws=4)
  err(dict(seed, train_batch_size=30), "train_batch_size must be a multiple "
      "of micro batch x devices = 16", ws=4)
  # the micro batch left out (derived 7 from 60 on 8): what 60 must divide by
  err({"train_batch_size": 60}, "60 != 7 * 1 * 8 (train_batch_size must be a "
      "multiple of devices x gradient_accumulation_steps = 8; the values not "
      "given were derived from 60 on 8 devices)", ws=8)


def test_batch_errors():
  err({"gradient_accumulation_steps": 2}, "Either train_batch_size or "
      "train_micro_batch_size_per_gpu needs to be provided")
  err({"train_batch_size": 2}, "Micro batch size per gpu: 0 has to be greater "
      "than 0", ws=4)
  err({"train_batch_size": 0}, "Train batch size: 0 has to be greater than 0")
  err({"train_batch_size": 8, "gradient_accumulation_steps": 0},
      "Gradient accumulation steps: 0")
  err({"train_batch_size": 8.5}, "train_batch_size must be an integer")
  err({"train_batch_size": "auto"}, "train_batch_size is 'auto', which must "
      "be filled in")
  # every "auto" at once, as the HF Trainer's JSONs carry several
  err({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
       "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
      "train_batch_size, train_micro_batch_size_per_gpu, "
      "scheduler.params.warmup_max_lr are 'auto'")


def test_world_size_defaults_to_jax_device_count():
  assert load_config({"train_micro_batch_size_per_gpu": 2}).world_size == 8
  assert load_config({"train_micro_batch_size_per_gpu": 2}).train_batch_size == 16


# ----------------------------------------------------------------- fp16 / bf16
def test_fp16_defaults_are_deepspeeds():
  f = base(fp16={"enabled": True}).fp16
  assert (f.enabled, f.auto_cast, f.loss_scale, f.initial_scale_power,
          f.loss_scale_window, f.hysteresis, f.consecutive_hysteresis,
          f.min_loss_scale) == (True, False, 0.0, 16, 1000, 2, False, 1)
  assert f.dynamic_loss_scale and f.initial_scale == 65536.0
  s = base(fp16={"enabled": True, "loss_scale": 128}).fp16
  assert not s.dynamic_loss_scale and s.initial_scale == 128.0
  assert base().fp16 == FP16Config(enabled=False)


@pytest.mark.parametrize("fp16,needle", [
    ({"loss_scale": -1}, "fp16.loss_scale must be >= 0"),
    ({"loss_scale": True}, "fp16.loss_scale must be a finite number"),
    ({"enabled": True, "hysteresis": 0}, "fp16.hysteresis=0 is not supported"),
    ({"enabled": True, "loss_scale_window": 0},
     "fp16.loss_scale_window must be > 0 with dynamic loss scaling"),
    ({"enabled": True, "min_loss_scale": 0},
     "fp16.min_loss_scale must be > 0 with dynamic loss scaling"),
    ({"min_loss_scale": 0.5}, "fp16.min_loss_scale must be an integer"),
    ({"enabled": "yes"}, "fp16.enabled must be a boolean"),
    ({"loss_scale_windw": 5}, "unknown key 'loss_scale_windw' in section "
     "'fp16'; did you mean 'loss_scale_window'"),
])
def test_fp16_validation(fp16, needle):
  err({"train_batch_size": 8, "fp16": fp16}, needle)


def test_fp16_auto_is_dropped_and_auto_cast_warns():
  assert base(fp16={"enabled": "auto", "loss_scale": "auto"}).fp16 == FP16Config()
  with pytest.warns(UserWarning, match="fp16.auto_cast=True is recognised but "
                    "not honoured"):
    assert base(fp16={"enabled": True, "auto_cast": True}).fp16.auto_cast


def test_bf16_and_legacy_bfloat16_key():
  assert base(bf16={"enabled": True}).bf16.enabled
  assert base(bfloat16={"enabled": True}).bf16.enabled
  assert not base(bf16={"enabled": False}, bfloat16={"enabled": True}).bf16.enabled
  err({"train_batch_size": 8, "fp16": {"enabled": True},
       "bf16": {"enabled": True}},
      "bfloat16 and fp16 modes cannot be simultaneously enabled")
  # DeepSpeed 0.19: check_grad_overflow defaults to true (precision_config.py)
  assert base(bf16={"enabled": True}).bf16.check_grad_overflow
  assert not base(bf16={"enabled": True, "check_grad_overflow": False}
                  ).bf16.check_grad_overflow


def test_fp16_range_checks_only_for_dynamic_fp16():
  """runtime/precision_config.py checks window / min scale only when dynamic
  fp16 is on: the same values load with fp16 off or a static scale."""
  assert base(fp16={"loss_scale_window": 0, "min_loss_scale": 0,
                    "hysteresis": 0}).fp16.loss_scale_window == 0
  assert base(fp16={"enabled": True, "loss_scale": 128,
                    "loss_scale_window": 0}).fp16.loss_scale == 128


def test_gradient_clipping():
  # DeepSpeed 0.19: GRADIENT_CLIPPING_DEFAULT = 1.0 (runtime/constants.py);
  # any value <= 0 turns clipping off (zero/stage_1_and_2.py `clip_grad > 0`).
  assert base().gradient_clipping == 1.0
  assert base(gradient_clipping=0.5).gradient_clipping == 0.5
  assert base(gradient_clipping=-1.0).gradient_clipping == -1.0
  err({"train_batch_size": 8, "gradient_clipping": "big"},
      "gradient_clipping must be a finite number")


def test_compute_grad_norm_false_needs_clipping_off():
  cfg = base(zero_optimization={"stage": 1, "compute_grad_norm": False},
             gradient_clipping=0)
  assert not cfg.zero.compute_grad_norm
  err({"train_batch_size": 8,
       "zero_optimization": {"stage": 1, "compute_grad_norm": False}},
      "compute_grad_norm=false requires gradient_clipping=0")


@pytest.mark.parametrize("key", ["amp", "sparse_gradients", "elasticity",
                                 "graph_harvesting", "curriculum_learning",
                                 "progressive_layer_drop", "eigenvalue",
                                 "compression_training", "sparse_attention",
                                 "nebula", "quantize_training"])
def test_removed_keys_are_errors_even_when_disabled(key):
  """runtime/config.py _reject_removed_config_keys: present at all = error,
  checked before anything else (here: before a bad batch size)."""
  err({"train_batch_size": -3, key: {"enabled": False}},
      f"'{key}' (", "DeepSpeed 0.19 removed it")


@pytest.mark.parametrize("key,value", [("mics_shard_size", -1),
                                       ("mics_hierarchical_params_gather", False),
                                       ("zeropp_loco_param", None)])
def test_removed_zero_keys_are_errors(key, value):
  err({"train_batch_size": 8, "zero_optimization": {"stage": 1, key: value}},
      f"'zero_optimization.{key}' (", "removed it")


def test_keys_deepspeed_019_accepts():
  """Keys 0.19.8 reads that have no effect here load with one INFO line."""
  cfg = base(log_level="info", disable_python_gc=True,
             managed_gradient_accumulation=True, gradient_allreduce_op="MEAN",
             zero_optimization={"stage": 1, "compute_grad_norm": True,
                                "parameter_alignment": True,
                                "prefetch_bucket_size": 10,
                                "stage3_allgather_sequential": False},
             optimizer={"type": "AdamW", "params": {
                 "fp32_optimizer_states": True}})
  assert cfg.zero.compute_grad_norm
  err({"train_batch_size": 8, "gradient_allreduce_op": "max"},
      "Invalid gradient_allreduce_op")
  err({"train_batch_size": 8, "gradient_allreduce_op": "sum"},
      "gradient_allreduce_op='sum'", "not supported")
  err({"train_batch_size": 8, "sequence_parallel_size": 2},
      "sequence_parallel_size=2 is not supported")
  with pytest.warns(UserWarning, match="managed_gradient_accumulation"):
    base(managed_gradient_accumulation=False)
  with pytest.warns(UserWarning, match="tensor_parallel"):
    base(tensor_parallel={"autotp_size": 2})


# ----------------------------------------------------------------- zero
def test_zero_defaults_when_section_absent():
  assert base().zero == ZeroConfig(
      stage=0, reduce_scatter=True, reduce_bucket_size=500_000_000,
      allgather_bucket_size=500_000_000, overlap_comm=False,
      contiguous_gradients=True, allgather_partitions=True,
      round_robin_gradients=False, elastic_checkpoint=False)


@pytest.mark.parametrize("stage", [3, 4])
def test_zero_stage_other_than_0_1_or_2_is_rejected(stage):
  err({"train_batch_size": 8, "zero_optimization": {"stage": stage}},
      f"zero_optimization.stage={stage} is not supported")


def test_zero_stage2_is_accepted_and_its_keys_noted(caplog):
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    z = base(zero_optimization={"stage": 2, "reduce_bucket_size": 123457,
                                "overlap_comm": True,
                                "contiguous_gradients": False,
                                "round_robin_gradients": True}).zero
  assert (z.stage, z.reduce_bucket_size, z.overlap_comm) == (2, 123457, True)
  assert "zero_optimization.round_robin_gradients" in caplog.text
  assert "contiguous_gradients" not in caplog.text   # off: nothing to say


def test_zero_sizes_and_legacy_forms():
  z = base(zero_optimization={"stage": 1, "reduce_bucket_size": 2e8,
                              "allgather_bucket_size": 12345}).zero
  assert (z.reduce_bucket_size, z.allgather_bucket_size) == (200_000_000, 12345)
  err({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": 5.5}},
      "zero_optimization.reduce_bucket_size must be an integer")
  err({"train_batch_size": 8, "zero_optimization": {"allgather_bucket_size": -1}},
      "must be >= 0")
  with pytest.warns(UserWarning, match="this format of ZeRO optimization "
                    "setup is deprecated"):     # DeepSpeed's words
    legacy = base(zero_optimization=True, allgather_size=1e6).zero
  assert (legacy.stage, legacy.allgather_bucket_size) == (1, 1_000_000)
  with pytest.warns(UserWarning, match="deprecated"):
    assert base(zero_optimization=False).zero.stage == 0
  err({"train_batch_size": 8, "zero_optimization": {"legacy_stage1": True}},
      "not supported in deepspeed >= 0.5.9")


def test_zero_keys_without_meaning_info_and_unhonoured_warn(caplog):
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    base(zero_optimization={"stage": 1, "round_robin_gradients": True,
                            "stage3_max_live_parameters": 1e9,
                            "offload_optimizer": {"device": "none"},
                            "stage3_prefetch_bucket_size": "auto"})
  text = caplog.text
  for key in ("round_robin_gradients", "stage3_max_live_parameters",
              "stage3_prefetch_bucket_size"):
    assert text.count(f"zero_optimization.{key}") == 1, key
  assert "offload_optimizer" not in text    # switched off: nothing to say
  assert base(zero_optimization={"stage": 1, "offload_optimizer": {
      "device": "cpu"}}).zero.offload_optimizer == "cpu"   # honoured: no word
  with pytest.warns(UserWarning, match="zero_quantized_gradients"):
    base(zero_optimization={"stage": 1, "zero_quantized_gradients": True})
  err({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_sze": 1}},
      "unknown key 'reduce_bucket_sze' in section 'zero_optimization'",
      "did you mean 'reduce_bucket_size'")


# ----------------------------------------------------------------- top level
def test_unknown_top_level_key_warns_naming_the_close_match():
  """DeepSpeed 0.19 reads the top level key by key and ignores the rest
  (DeepSpeedExamples' imagenet configs carry cuda_visible_devices)."""
  from zero1_jax.deepspeed.schema import UnknownKeyWarning
  with pytest.warns(UnknownKeyWarning, match=r"unknown top-level key "
                    r"'gradient_clip' \(did you mean 'gradient_clipping'\?\) "
                    r"ignored: DeepSpeed 0\.19 ignores"):
    cfg = base(gradient_clip=0.5)
  assert cfg.gradient_clipping == 1.0          # ignored, not read as clipping
  with pytest.warns(UnknownKeyWarning, match="'gradient_clipping' is not set, "
                    "so its default applies"):
    base(gradient_clippping=0.5)
  with pytest.warns(UnknownKeyWarning, match="'cuda_visible_devices' ignored"):
    assert base(cuda_visible_devices="0,1").train_batch_size == 8


def test_top_level_no_effect_and_unhonoured_keys(caplog):
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    base(vocabulary_size=32000, tensorboard={"enabled": False},
         prescale_gradients=True)
  for key in ("vocabulary_size", "prescale_gradients"):
    assert caplog.text.count(f"{key}=") == 1, key
  assert "tensorboard" not in caplog.text   # switched off: nothing to say
  with pytest.warns(UserWarning, match="comet.*not honoured"):
    base(comet={"enabled": True})
  err({"train_batch_size": 8, "elasticity": {"enabled": True}},
      "'elasticity' (", "removed it")


def test_steps_per_print_and_communication_data_type():
  assert base(steps_per_print=10).steps_per_print == 10
  err({"train_batch_size": 8, "steps_per_print": 0}, "steps_per_print must be")
  assert base(communication_data_type="FP32").communication_data_type == "fp32"
  err({"train_batch_size": 8, "communication_data_type": "int8"},
      "Invalid communication_data_type. Supported data types: "
      "['fp16', 'bf16', 'fp32']")
