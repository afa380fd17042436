"""The offload and monitor sections, checked as DeepSpeed 0.19.8 checks them,
and when a config's notes and warnings are said: only once it is valid.

The expected words are pydantic's for DeepSpeed 0.19.8's models
(runtime/zero/offload_config.py, runtime/zero/config.py offload_ratio_check,
monitor/config.py; extra="forbid" in runtime/config_utils.py)."""

import logging
import warnings

import pytest

from zero1_jax.deepspeed.schema import ConfigError, UnknownKeyWarning
from helpers import config_error as err, fresh_ds_notes, load  # noqa: F401


def zero(stage=1, **section):
  return {"train_batch_size": 8, "zero_optimization": {"stage": stage, **section}}


@pytest.mark.parametrize("section,words", [
    ({"device": "gpu"}, "offload_optimizer.device='gpu': Input should be "
     "'none', 'cpu' or 'nvme'"),
    ({"device": "auto"}, "Input should be 'none', 'cpu' or 'nvme'"),
    ({"device": "cpu", "pin_memroy": True}, "offload_optimizer.pin_memroy: "
     "Extra inputs are not permitted"),
    ({"device": "cpu", "ratio": 0.3}, "Partial offloading only supported for "
     "ZeRO Stage 3."),
    ({"device": "cpu", "ratio": 1.5}, "Input should be less than or equal to 1"),
    ({"device": "cpu", "buffer_count": -1},
     "Input should be greater than or equal to 0"),
    ({"device": "cpu", "buffer_count": 2.5}, "Input should be a valid integer"),
    ({"device": "cpu", "pin_memory": "maybe"}, "Input should be a valid boolean"),
    ({"device": "cpu", "nvme_path": 3}, "Input is not a valid path"),
])
def test_offload_optimizer_rejected_as_deepspeed_rejects(section, words):
  msg = err(zero(offload_optimizer=section), words)
  assert "DeepSpeed 0.19.8" in msg


def test_extra_key_names_the_close_one():
  err(zero(offload_optimizer={"device": "cpu", "pin_memroy": True}),
      "did you mean 'pin_memory'?")


def test_nvme_and_parameter_offload_refused_with_the_reason():
  err(zero(offload_optimizer={"device": "nvme", "nvme_path": "/x"}),
      "device='nvme' is not supported by zero1_jax", "or \"cpu\"")
  err(zero(offload_param={"device": "cpu"}), "parameter offload is ZeRO "
      "stage 3's", "Remove offload_param")
  err(zero(offload_param={"device": "cpu", "max_in_cpu": -1}),  # 0.19.8's first
      "offload_param.max_in_cpu=-1: Input should be greater than or equal to 0")
  # switched off: nothing to refuse
  assert load(zero(offload_param={"device": "none"})).zero.stage == 1


def test_cpu_offload_is_honoured_without_a_warning(recwarn, caplog):
  """offload_optimizer device cpu (and DeepSpeed's deprecated cpu_offload:
  true, zero/config.py's new_param_fn) turns zero1's offload on: nothing is
  warned; pin_memory: false says once that the state is pinned anyway."""
  import logging
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    cfg = load(zero(offload_optimizer={"device": "cpu", "pin_memory": True,
                                       "ratio": 1.0, "buffer_count": 4}))
  assert cfg.zero.offload_optimizer == "cpu"
  assert not [w for w in recwarn if "offload" in str(w.message)]
  assert "offload" not in caplog.text
  assert load(zero(cpu_offload=True)).zero.offload_optimizer == "cpu"
  assert load(zero(cpu_offload=False)).zero.offload_optimizer == "none"
  assert load(zero()).zero.offload_optimizer == "none"
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    load(zero(offload_optimizer={"device": "cpu", "pin_memory": False}))
  assert "pinned host memory all the same" in caplog.text
  from zero1_jax.deepspeed.engine import build_tx
  tx = build_tx(load({"train_batch_size": 8, "optimizer": {
      "type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {
          "stage": 2, "offload_optimizer": {"device": "cpu"}}}))
  assert tx.config.offload == "pinned_host" and tx.config.stage == 2


@pytest.mark.parametrize("section,words", [
    ({"tensorboard": {"enabled": True, "output_dir": "x"}},
     "tensorboard.output_dir: Extra inputs are not permitted"),
    ({"csv_monitor": {"enabled": "yes please"}}, "Input should be a valid boolean"),
    ({"wandb": {"enabled": True, "project": 3}}, "Input should be a valid string"),
    ({"tensorboard": []}, "Input should be a valid dictionary"),
])
def test_monitor_sections_rejected_as_deepspeed_rejects(section, words):
  err({"train_batch_size": 8, **section}, words)


def test_monitor_sections_read_with_deepspeed_defaults():
  cfg = load({"train_batch_size": 8, "tensorboard": {"enabled": True},
              "wandb": "auto"})
  assert cfg.monitor.enabled and cfg.monitor.tensorboard.output_path == ""
  assert cfg.monitor.tensorboard.job_name == "DeepSpeedJobName"
  assert not cfg.monitor.wandb.enabled and cfg.monitor.wandb.project == "deepspeed"


def _said(config):
  """(error or None, warnings, zero1_jax log records) of loading ``config``."""
  from zero1_jax.deepspeed import config as zconfig
  zconfig._NOTED.clear()   # info lines are said once per process
  records = []

  class Catch(logging.Handler):
    def emit(self, record):
      records.append(record.getMessage())
  h = Catch(logging.DEBUG)
  log = logging.getLogger("zero1_jax")
  log.addHandler(h)
  old = log.level
  log.setLevel(logging.DEBUG)
  try:
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      try:
        load(config)
        error = None
      except ConfigError as e:
        error = str(e)
  finally:
    log.removeHandler(h)
    log.setLevel(old)
  return error, [str(x.message) for x in w], records


@pytest.mark.parametrize("bad", [
    {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2},   # batch rule
    {"optimizer": {"type": "NoSuchOpt"}},                           # optimizer
    {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"},
                           "reduce_bucket_size": 0}},               # zero section
])
def test_nothing_is_said_about_a_config_that_is_then_rejected(bad):
  """12 of 134 public configs printed 'not honoured' before the error that
  rejected the same config."""
  config = {"train_batch_size": 8, "cuda_visible_devices": "0",
            "wall_clock_breakdown": True, "vocabulary_size": 8,
            "data_efficiency": {"enabled": True},
            "memory_breakdown": True,
            "zero_optimization": {"stage": 1, "overlap_comm": True,
                                  "offload_optimizer": {"device": "cpu"},
                                  "stage3_prefetch_bucket_size": "auto"}}
  error, warned, logged = _said({**config, **bad})
  assert error is not None
  assert warned == [] and logged == [], (warned, logged)
  error, warned, logged = _said(config)       # valid: each is said
  assert error is None
  assert len(warned) == 4 and len(logged) == 3, (warned, logged)


def test_a_section_is_named_not_dumped():
  nested = {"enabled": True, "seed": 1234, "data_sampling": {
      "enabled": True, "curriculum_learning": {"enabled": True,
                                               "curriculum_type": "seqlen"}}}
  _, warned, _ = _said({"train_batch_size": 8, "data_efficiency": nested})
  assert warned == ["section 'data_efficiency' (enabled) is recognised but "
                    "not honoured by zero1_jax: feature not implemented by "
                    "zero1_jax"], warned


def test_unknown_top_level_key_is_a_warning_of_its_own_kind():
  with pytest.warns(UnknownKeyWarning):
    load({"train_batch_size": 8, "trian_batch_size": 8})
