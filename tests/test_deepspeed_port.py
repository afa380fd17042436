"""experiments/examples/deepspeed_port/train.py, a DeepSpeed script ported
to zero1_jax, run as a user runs it: train with a checkpoint, resume from
it in a new process, and continue exactly where the uninterrupted run went."""

import importlib.util
import json
import logging
import math
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


def test_prints_decimal_losses_and_deepspeeds_memory_lines(tmp_path, capsys,
                                                           caplog):
  """What a user reads: the losses as decimals (``2.3656...``, not
  float.hex's ``0x1.2ecd7a0000000p+1``), each the shortest one that reads
  back as the same float, and first, as DeepSpeed prints them, the optimizer
  state's memory before and after sharding, once (in-process: this
  session's 8 devices)."""
  mod = _load()
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    assert mod.main(["--deepspeed", str(PORT / "ds_config.json"),
                     "--per_device_train_batch_size", "2", "--max_steps", "2",
                     "--output_dir", str(tmp_path / "out")]) == 0
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
  assert len(lines) == 2, lines
  for line in lines:
    loss = json.loads(line)["loss"]
    assert type(loss) is float and math.isfinite(loss), line
    assert f'"loss": {loss!r},' in line and "0x" not in line, line
  msgs = [r.getMessage() for r in caplog.records]
  assert sum("[Rank 0] Before: optimizer state" in m for m in msgs) == 1, msgs
  assert sum("[Rank 0] After : optimizer state" in m and m.endswith("(1/8)")
             for m in msgs) == 1, msgs


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
  assert whole[-1]["loss"] < whole[0]["loss"]
  step6 = tmp_path / "whole" / "checkpoints" / "6"
  assert step6.is_dir()
  resumed = _train(tmp_path / "resumed", "--resume_from_checkpoint", str(step6))
  assert [l["step"] for l in resumed] == list(range(7, 13))
  # loss (a decimal that reads back as the same float), lr, skipped: equal
  assert resumed == whole[6:]
