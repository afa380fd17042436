"""experiments/examples/deepspeed_port/train.py, a DeepSpeed script ported
to zero1_jax, run as a user runs it: train with a checkpoint, resume from
it in a new process, and continue exactly where the uninterrupted run went."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PORT = ROOT / "experiments" / "examples" / "deepspeed_port"


def _load():
  spec = importlib.util.spec_from_file_location("port_train", PORT / "train.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_auto_values_are_filled_from_the_flags_as_the_hf_trainer_does():
  mod = _load()
  args = mod.parse_args(["--deepspeed", str(PORT / "ds_config.json"),
                         "--per_device_train_batch_size", "8",
                         "--learning_rate", "3e-3", "--max_steps", "12",
                         "--output_dir", "out", "--resume_from_checkpoint"])
  assert args.resume_from_checkpoint == "latest"
  cfg = mod.fill_auto(json.loads((PORT / "ds_config.json").read_text()), args)
  assert "auto" not in json.dumps(cfg)
  assert cfg["train_micro_batch_size_per_gpu"] == 8
  assert cfg["optimizer"]["params"]["lr"] == 3e-3
  assert cfg["scheduler"]["params"]["warmup_max_lr"] == 3e-3
  assert cfg["scheduler"]["params"]["total_num_steps"] == 12
  import zero1_jax as z1   # and DeepSpeed's rules accept the result
  resolved = z1.load_config(cfg, world_size=4)
  assert resolved.train_batch_size == 8 * 2 * 4


def _train(out, *flags) -> list[dict]:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(ROOT)
  proc = subprocess.run(
      [sys.executable, str(PORT / "train.py"), "--num_devices", "4",
       "--deepspeed", str(PORT / "ds_config.json"),
       "--per_device_train_batch_size", "8", "--learning_rate", "3e-3",
       "--max_steps", "12", "--output_dir", str(out), *flags],
      env=env, capture_output=True, text=True, timeout=600,
      cwd=out.parent)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "nothing is sharded" not in proc.stderr
  return [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]


@pytest.mark.slow   # two training processes: 18-25 s on 2 cores
def test_resumed_run_continues_bitwise(tmp_path):
  """Steps 7-12 after a resume from step 6 give the uninterrupted run's
  losses bit for bit. Bitwise, not a tolerance: the resumed process compiles
  the same program (same shapes, config, device count), restores params,
  fp32 master, Adam moments, loss scale and counters exactly as they were
  (orbax stores the arrays' bits), and reads the same batches (a pure
  function of the step), and XLA:CPU runs a program deterministically; any
  difference is a state that was not saved or not restored."""
  whole = _train(tmp_path / "whole", "--save_steps", "6")
  assert [l["step"] for l in whole] == list(range(1, 13))
  assert not any(l["skipped"] for l in whole)   # fp16 at 2^12: no overflow
  assert float.fromhex(whole[-1]["loss"]) < float.fromhex(whole[0]["loss"])
  step6 = tmp_path / "whole" / "checkpoints" / "6"
  assert step6.is_dir()
  resumed = _train(tmp_path / "resumed", "--resume_from_checkpoint", str(step6))
  assert [l["step"] for l in resumed] == list(range(7, 13))
  assert resumed == whole[6:]      # loss (as float.hex), lr, skipped: equal
