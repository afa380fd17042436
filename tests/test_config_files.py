"""The DeepSpeed config as a file and as a value (zero1_jax.deepspeed):
read as DeepSpeed reads it (JSON or Hjson, duplicate keys refused), round
trips through ``raw`` / ``to_dict``, ``with_overrides``, and every key it
accepts documented in docs/deepspeed_config.md. The sections' rules are
tests/test_config.py's.
"""
import dataclasses
import json
import pathlib

import pytest

from zero1_jax.deepspeed.config import load_config
from zero1_jax.deepspeed.schema import (BF16Config, ConfigError, FP16Config,
                                        ZeroConfig)
from helpers import SEED_CONFIG, fresh_ds_notes, load

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEED = SEED_CONFIG


fresh_ds_notes = fresh_ds_notes   # autouse fixture (helpers.py)


# ----------------------------------------------------------------- files
def test_file_errors(tmp_path):
  missing = tmp_path / "nope.json"
  with pytest.raises(ConfigError, match="nope.json"):
    load_config(missing, world_size=1)
  bad = tmp_path / "bad.json"
  # (unquoted keys and comments are Hjson, which DeepSpeed reads: see below)
  bad.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,,}\n}')
  with pytest.raises(ConfigError) as e:
    load_config(bad, world_size=1)
  assert "bad.json" in str(e.value) and "line 3 column 28" in str(e.value)
  dup = tmp_path / "dup.json"
  dup.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
  with pytest.raises(ConfigError, match="Duplicate keys in DeepSpeed config: "
                     r"\['train_batch_size'\]"):
    load_config(dup, world_size=1)


def test_hjson_that_deepspeed_reads_loads_as_its_json(tmp_path):
  """DeepSpeed 0.19.8 reads a config file with hjson (runtime/config.py:444):
  comments, unquoted keys and strings, no commas at line ends. Such a file
  must give the same config as its plain JSON (it once was 'invalid JSON')."""
  text = """{
    // comments, as people annotate their ds_config.json
    train_batch_size: 8   # global
    "zero_optimization": {"stage": 1, reduce_bucket_size: 5e8},
    optimizer: {
      type: AdamW
      params: {lr: 1e-3, betas: [0.9, 0.999]}
    }
  }"""
  (tmp_path / "ds.hjson").write_text(text)
  plain = {"train_batch_size": 8,
           "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3,
                                                    "betas": [0.9, 0.999]}}}
  got = load_config(tmp_path / "ds.hjson", world_size=1)
  assert got.raw == plain
  assert got.to_dict() == load_config(plain, world_size=1).to_dict()


def test_raw_and_to_dict_round_trip():
  cfg = load(SEED, 4)
  assert cfg.raw == SEED and cfg.raw is not SEED
  d = cfg.to_dict()
  assert d["train_micro_batch_size_per_gpu"] == 8
  assert d["zero_optimization"]["allgather_bucket_size"] == 500_000_000
  assert load_config(d, world_size=4) == cfg
  json.dumps(d)


# ----------------------------------------------------------------- overrides
def test_with_overrides():
  cfg = load(SEED, 4)
  new = cfg.with_overrides(train_micro_batch_size_per_gpu=8, steps_per_print=5,
                           gradient_clipping=None, fp16=True)
  assert new.steps_per_print == 5 and cfg.steps_per_print is None
  assert new.gradient_clipping == 1.0
  assert cfg.with_overrides(**{"fp16.loss_scale": 64}).fp16.loss_scale == 64
  assert cfg.with_overrides(zero_optimization__reduce_bucket_size=10
                            ).zero.reduce_bucket_size == 10
  with pytest.raises(ConfigError) as e:
    cfg.with_overrides(lr=1e-3)
  assert "lr=0.001" in str(e.value) and "optimizer.params.lr=2e-05" in str(e.value)
  with pytest.raises(ConfigError, match="gradient_accumulation_steps=2 "
                     "conflicts with gradient_accumulation_steps=1"):
    cfg.with_overrides(gradient_accumulation_steps=2)
  with pytest.raises(ConfigError, match="fp16=False conflicts with "
                     "fp16.enabled=True"):
    cfg.with_overrides(fp16=False)
  with pytest.raises(ConfigError, match="Check batch related parameters"):
    cfg.with_overrides(train_micro_batch_size_per_gpu=4)  # 32 != 4*1*4


def test_every_accepted_key_is_documented():
  from zero1_jax.deepspeed import keys as dskeys, optim, schedules
  doc = (ROOT / "docs" / "deepspeed_config.md").read_text()
  keys = set(dskeys.TOP_LEVEL) | {k.split(".", 1)[1] for k in dskeys.NOTES
                                  if "." in k}
  for cls in (FP16Config, BF16Config, ZeroConfig):
    keys |= {f.name for f in dataclasses.fields(cls)}
  keys |= optim.known_params()
  for spec in schedules.PARAMS.values():
    keys |= set(spec)
  keys |= {"torch_adam", "adam_w_mode", "decoupled_weight_decay",
           "legacy_fusion", "last_batch_iteration"}
  missing = sorted(k for k in keys if f"`{k}`" not in doc)
  assert not missing, missing
