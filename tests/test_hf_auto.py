"""``"auto"`` in a DeepSpeed JSON (the HF Trainer's configs): zero1-train fills
each one as transformers' ``HfTrainerDeepSpeedConfig`` does, from the flag when
given, else from ``TrainingArguments``' default; the library's own
``load_config`` keeps DeepSpeed's rule (an error)."""

import copy
import json
import logging
import os

import pytest

from zero1_jax.cli import hf_auto
from zero1_jax.deepspeed.config import load_config
from zero1_jax.deepspeed.schema import ConfigError
from helpers import train_cli

# An HF-Trainer style config, as the transformers docs print it for ZeRO-1/2.
HF_CONFIG = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                              "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 1, "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
}
NO_FLAGS = dict(train_micro_batch_size_per_gpu=None, gradient_accumulation_steps=None,
                train_batch_size=None, lr=None, fp16=None, bf16=None, warmup_steps=3)


def filled(flags=None, ws=2, raw=None, **kw):
  raw = copy.deepcopy(raw or HF_CONFIG)
  notes = hf_auto.fill(raw, flags={**NO_FLAGS, **(flags or {})}, max_steps=50,
                       hidden_size=kw.get("hidden_size", 128))
  assert not hf_auto.has_auto(raw), raw
  return load_config(raw, world_size=ws), raw, notes


def test_the_library_keeps_deepspeeds_rule():
  with pytest.raises(ConfigError, match="HF Trainer"):
    load_config(HF_CONFIG, world_size=2)


def test_every_auto_takes_the_hf_trainer_default():
  cfg, raw, notes = filled()
  # TrainingArguments defaults: per_device_train_batch_size 8, accumulation 1,
  # max_grad_norm 1.0, learning_rate 5e-5, betas (0.9, 0.999), eps 1e-8,
  # weight_decay 0.0, fp16 False; warmup_min_lr 0, warmup_max_lr = lr.
  assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
          cfg.train_batch_size) == (8, 1, 16)
  assert cfg.gradient_clipping == 1.0
  assert raw["optimizer"]["params"] == {"lr": 5e-5, "betas": [0.9, 0.999],
                                        "eps": 1e-8, "weight_decay": 0.0}
  assert raw["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 5e-5,
                                        "warmup_num_steps": 3}
  assert raw["fp16"]["enabled"] is False
  assert raw["zero_optimization"]["reduce_bucket_size"] == 128 * 128   # hidden^2
  assert cfg.zero.reduce_bucket_size == 128 * 128
  assert any(n.startswith("gradient_clipping=1.0 (HF default max_grad_norm)")
             for n in notes)


def test_flags_fill_their_autos():
  cfg, raw, _ = filled(dict(train_micro_batch_size_per_gpu=4,
                            gradient_accumulation_steps=2, lr=1e-3, fp16=True), ws=4)
  assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
          cfg.train_batch_size) == (4, 2, 32)
  assert raw["optimizer"]["params"]["lr"] == 1e-3
  assert raw["scheduler"]["params"]["warmup_max_lr"] == 1e-3
  assert raw["fp16"]["enabled"] is True


def test_batch_autos_follow_deepspeeds_rule_from_what_is_given():
  cfg, _, _ = filled(dict(train_batch_size=32), ws=4)   # micro derived: 32/4
  assert (cfg.train_micro_batch_size_per_gpu, cfg.train_batch_size) == (8, 32)
  explicit = dict(HF_CONFIG, train_batch_size=12)       # no flag: micro derived
  cfg, _, _ = filled(raw=explicit, ws=2)
  assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
          cfg.train_batch_size) == (6, 1, 12)


def test_an_explicit_lr_drives_an_auto_warmup_max_lr():
  raw = copy.deepcopy(HF_CONFIG)
  raw["optimizer"]["params"]["lr"] = 2e-4
  _, raw, _ = filled(raw=raw)
  assert raw["scheduler"]["params"]["warmup_max_lr"] == 2e-4


@pytest.mark.parametrize("warmup,want", [(None, 1), (0, 1), (5, 5)])
def test_auto_warmup_is_max_1_warmup_steps_as_transformers_5(warmup, want):
  """transformers 5.x trainer_config_finalize fills max(1, warmup_steps):
  DeepSpeed >= 0.19.6 rejects 0 (integrations/deepspeed.py)."""
  cfg, raw, notes = filled(dict(warmup_steps=warmup))
  assert raw["scheduler"]["params"]["warmup_num_steps"] == want
  assert f"scheduler.params.warmup_num_steps={want} (HF: max(1, " \
         "--warmup_steps))" in notes


def test_a_config_without_auto_is_left_alone():
  raw = {"train_batch_size": 8, "gradient_clipping": 0.5}
  before = copy.deepcopy(raw)
  assert hf_auto.fill(raw, flags=NO_FLAGS, max_steps=5, hidden_size=4) == []
  assert raw == before


# ------------------------------------------------------------------ the CLI
def _cli(tmp_path, config, *extra):
  return train_cli(tmp_path, config, *extra, num_devices=2, max_steps=2)


def test_zero1_train_runs_an_hf_config_and_says_what_it_filled(tmp_path, capsys, caplog):
  caplog.set_level(logging.INFO, logger="zero1_jax")
  assert _cli(tmp_path, HF_CONFIG, "--per_device_train_batch_size", "2",
              "--warmup_steps", "1", "--learning_rate", "1e-4",
              "--adam_beta2", "0.95", "--max_grad_norm", "0.5") == 0
  used = json.load(open(tmp_path / "out" / "ds_config.json"))
  assert used["train_batch_size"] == 4 and used["gradient_clipping"] == 0.5
  assert used["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.95],
                                         "eps": 1e-8, "weight_decay": 0.0}
  assert used["scheduler"]["params"]["warmup_num_steps"] == 1
  assert used["zero_optimization"]["reduce_bucket_size"] == 128 * 128   # bert-tiny
  text = capsys.readouterr().err + caplog.text
  assert "filled as the HF Trainer does" in text
  assert "train_micro_batch_size_per_gpu=2 (flag)" in text


@pytest.mark.parametrize("extra,message", [
    (("--warmup_steps", "5"), "--warmup_steps 5 fills"),
])
def test_zero1_train_auto_errors_are_one_line(tmp_path, capsys, extra, message):
  cfg = copy.deepcopy(HF_CONFIG)
  if extra:
    cfg["scheduler"]["params"]["warmup_num_steps"] = 10
  assert _cli(tmp_path, cfg, *extra) == 2
  err = capsys.readouterr().err
  assert message in err and "Traceback" not in err, err
  assert len(err.strip().splitlines()) == 1, err


def test_hf_optimizer_flags_fill_their_autos():
  _, raw, notes = filled({"gradient_clipping": 0.5, hf_auto.WEIGHT_DECAY: 0.1,
                          hf_auto.EPS: 1e-6, hf_auto.BETAS: [0.9, 0.95]})
  assert raw["gradient_clipping"] == 0.5
  assert raw["optimizer"]["params"] == {"lr": 5e-5, "betas": [0.9, 0.95],
                                        "eps": 1e-6, "weight_decay": 0.1}
  assert "gradient_clipping=0.5 (flag)" in notes


SEED = {"train_batch_size": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 2e-5, "betas": [0.9, 0.999],
                                                 "eps": 1e-8, "weight_decay": 0.01}}}


@pytest.mark.parametrize("config,extra,message", [
    # each error names the flag as typed, not the config path it sets
    (SEED, ("--weight_decay", "0.1"), "--weight_decay 0.1 conflicts with "
     "optimizer.params.weight_decay=0.01"),
    (SEED, ("--adam_beta2", "0.95"), "--adam_beta1/--adam_beta2 [0.9, 0.95] "
     "conflicts with optimizer.params.betas=[0.9, 0.999]"),
    (dict(SEED, gradient_clipping=1.0), ("--max_grad_norm", "0.5"),
     "--max_grad_norm 0.5 conflicts with gradient_clipping=1.0"),
    (SEED, ("--learning_rate", "1e-3"), "--learning_rate 0.001 conflicts with "
     "optimizer.params.lr=2e-05"),
    # no optimizer section: the HF Trainer's AdamW, which exempts biases and
    # LayerNorm weights from decay: refused, before the parameters exist
    ({"train_batch_size": 4}, ("--weight_decay", "0.1"),
     "--weight_decay 0.1 with no 'optimizer' section: the HF Trainer's AdamW "
     "leaves biases and LayerNorm weights undecayed"),
])
def test_hf_flags_that_disagree_with_the_json_are_one_line_errors(
    tmp_path, capsys, config, extra, message):
  assert _cli(tmp_path, config, *extra) == 2
  out, err = capsys.readouterr()
  assert message in err and len(err.strip().splitlines()) == 1, err
  assert "initialising the parameters" not in out, out


def test_hf_flags_set_keys_the_json_leaves_out(tmp_path):
  from zero1_jax.cli import config_flags
  from zero1_jax.deepspeed import config as zconfig
  path = tmp_path / "ds.json"
  path.write_text(json.dumps(SEED))
  flags = {k: None for k in NO_FLAGS}
  flags.update(gradient_clipping=0.5, adam_beta1=None, adam_beta2=0.999)
  cfg = config_flags.load(zconfig, str(path), 1, flags, max_steps=5,
                           hidden_size=lambda: 16)
  assert cfg.gradient_clipping == 0.5                       # DeepSpeed's default: 1.0
  assert cfg.optimizer.params["betas"] == [0.9, 0.999]      # the JSON's, beta2 agreeing


# ------------------------------------------- no optimizer: the Trainer's own
def _load(tmp_path, raw, max_steps=10, **flags):
  from zero1_jax.cli import config_flags
  from zero1_jax.deepspeed import config as zconfig
  path = tmp_path / "ds.json"
  path.write_text(json.dumps(raw))
  given = {k: None for k in NO_FLAGS}
  given.update(flags)
  return config_flags.load(zconfig, str(path), 1, given, max_steps=max_steps,
                           hidden_size=lambda: 16)


def hf_linear(step, warmup, total):
  """transformers 5.x optimization.py _get_linear_schedule_with_warmup_lr_lambda."""
  if step < warmup:
    return step / max(1, warmup)
  return max(0.0, (total - step) / max(1, total - warmup))


@pytest.mark.parametrize("warmup", [None, 3])
def test_no_optimizer_section_takes_the_hf_trainers_adamw_and_schedule(
    tmp_path, caplog, warmup):
  """integrations/deepspeed.py deepspeed_optim_sched: no 'optimizer' ->
  trainer.create_optimizer() (AdamW from the TrainingArguments) and, no
  'scheduler' either, the Trainer's linear schedule over max_steps."""
  from zero1_jax.deepspeed import schedules
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    cfg = _load(tmp_path, {"train_batch_size": 4}, lr=1e-3, adam_beta2=0.95,
                warmup_steps=warmup, **{hf_auto.EPS: 1e-6})
  assert (cfg.optimizer.type, cfg.optimizer.params) == (
      "AdamW", {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-6,
                "weight_decay": 0.0})
  w = warmup or 0
  assert (cfg.scheduler.type, cfg.scheduler.params) == (
      "HFLinear", {"num_warmup_steps": w, "num_training_steps": 10})
  lr = schedules.build_schedule(cfg.scheduler, 1e-3)
  for c in range(12):   # update c uses lr_lambda(c) (torch LambdaLR)
    # the schedule computes in float32: one rounding of the ratio and one
    # of the product, each <= 2^-24 relative
    assert float(lr(c)) == pytest.approx(1e-3 * hf_linear(c, w, 10),
                                         rel=2 * 2.0**-24, abs=1e-12), c
  lines = [r.getMessage() for r in caplog.records
           if "no 'optimizer' in the JSON" in r.getMessage()]
  assert len(lines) == 1, caplog.text
  assert ("the HF Trainer's AdamW(lr=0.001, betas=(0.9, 0.95), eps=1e-06, "
          "weight_decay=0.0) from --learning_rate") in lines[0]
  assert f"--warmup_steps {w}, then down to 0 at --max_steps 10" in lines[0]


def test_no_optimizer_but_a_scheduler_keeps_the_scheduler(tmp_path):
  sched = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
  cfg = _load(tmp_path, {"train_batch_size": 4, "scheduler": sched})
  assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params["lr"] == 5e-5
  assert cfg.scheduler.type == "WarmupLR"


def test_zero1_train_without_optimizer_trains_with_hf_adamw(tmp_path, capsys):
  assert _cli(tmp_path, {"train_batch_size": 4}, "--learning_rate", "1e-3") == 0
  out, err = capsys.readouterr()
  assert "no 'optimizer' in the JSON: the HF Trainer's AdamW(lr=0.001" in err
  assert "2 steps (0 skipped)" in out, out
  written = json.load(open(tmp_path / "out" / "ds_config.json"))
  assert written["optimizer"]["type"] == "AdamW"


def test_report_to_sections_and_their_directories(tmp_path):
  from zero1_jax.cli import config_flags
  raw = {"csv_monitor": {"enabled": True, "output_path": "mine"}}
  got = config_flags.monitor_flags(raw, ["tensorboard", "wandb"], None, "OUT")
  where = got.pop("tensorboard__output_path")
  # the HF Trainer's default: OUTPUT_DIR/runs/<Mon DD_HH-MM-SS>_<host>
  assert where.startswith(os.path.join("OUT", "runs", "")), where
  assert got == {"tensorboard__enabled": True, "wandb__enabled": True,
                 "tensorboard__job_name": ""}
  # --logging_dir goes to every enabled directory monitor, the JSON's too
  got = config_flags.monitor_flags(raw, None, "D", "OUT")
  assert got == {"csv_monitor__output_path": "D", "csv_monitor__job_name": ""}
  # through config_flags.load, as zero1-train calls it
  from zero1_jax.deepspeed import monitor
  cfg = _load(tmp_path, {"train_batch_size": 4, "optimizer": {
      "type": "SGD", "params": {"lr": 1}}}, report_to=["tensorboard", "csv"],
              logging_dir="D", output_dir="O")
  assert cfg.monitor.tensorboard == monitor.TensorBoardConfig(True, "D", "")
  assert cfg.monitor.csv_monitor == monitor.CSVConfig(True, "D", "")
  assert not cfg.monitor.wandb.enabled
  # a JSON that turns the monitor off, and a flag that turns it on: an error
  with pytest.raises(ConfigError, match=r"--report_to/--logging_dir "
                     r"\(tensorboard.enabled\) True conflicts with "
                     r"tensorboard.enabled=False"):
    _load(tmp_path, {"train_batch_size": 4, "tensorboard": {"enabled": False},
                     "optimizer": {"type": "SGD", "params": {"lr": 1}}},
          report_to=["tensorboard"], logging_dir="D", output_dir="O")
