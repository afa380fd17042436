"""zero1-train: the seed's command runs; bad input is one clear line, exit != 0."""

import json
import math
import os
import subprocess
import sys

import pytest

from zero1_jax.cli import train
from helpers import train_cli

SEED_JSON = os.path.join(os.path.dirname(__file__), "..", "experiments",
                         "configs", "ds_zero_stage1.json")


def run(tmp_path, *extra, config=SEED_JSON):
  args = ["--deepspeed", str(config), "--num_devices", "4",
          "--model_name_or_path", "bert-tiny", "--per_device_train_batch_size", "2",
          "--seq_len", "16", "--max_steps", "3", "--no_progress",
          "--output_dir", str(tmp_path / "out"), *extra]
  return train.main(args)


def run_edited(tmp_path, config, **top_level):
  """Runs ``config`` with ``top_level`` keys replaced and fp16's initial
  scale at 2^8 (the tiny model overflows less); returns the edited config."""
  cfg = json.load(open(config))
  cfg.update(top_level)
  cfg["fp16"]["initial_scale_power"] = 8
  path = tmp_path / "edited.json"
  path.write_text(json.dumps(cfg))
  assert run(tmp_path, config=path) == 0
  return cfg


def test_seed_command_trains_and_writes_outputs(tmp_path, capsys):
  run_edited(tmp_path, SEED_JSON, train_batch_size=8)   # 2 per device x 4 devices
  out, err = capsys.readouterr()
  # once: z1.initialize's own log of these lines stays quiet inside the CLI
  assert (out + err).count("Before: optimizer state") == 1, out + err
  # Rank 0's lines, as DeepSpeed (and the seed) print them; the other ranks
  # of this process hold the same bytes: one line, not 3 more blocks
  assert "[Rank 0] Zero Stage 1: optimizer state partitioned" in out
  assert "[Rank 0] After : optimizer state" in out and "(1/4)" in out
  assert "[Rank 0] AllGather bucket size: 500000000" in out
  assert "[Rank 1-3] the same as Rank 0" in out
  assert not any(f"[Rank {r}] After" in out for r in (1, 2, 3)), out
  assert "weights start random (nothing is downloaded)" in out
  o = tmp_path / "out"
  rows = [json.loads(l) for l in open(o / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert (o / "loss_curve.png").stat().st_size > 1000
  assert (o / "memory.png").stat().st_size > 1000
  used = json.load(open(o / "ds_config.json"))
  assert used["fp16"]["enabled"] is True and used["train_batch_size"] == 8
  summary = json.load(open(o / "summary.json"))
  rank_bytes = summary["memory"]["zero1_bytes_per_rank"]
  assert len(rank_bytes) == 4
  assert max(rank_bytes) * 4 <= summary["memory"]["replicated_bytes"] * 1.01
  assert summary["memory"]["fp32_params"] is False   # fp16: the state holds the master


def test_stage2_config_trains(tmp_path, capsys):
  """experiments/configs/ds_zero_stage2.json runs through zero1-train."""
  cfg = run_edited(tmp_path, os.path.join(os.path.dirname(SEED_JSON), "ds_zero_stage2.json"),
                   train_batch_size=16,   # 2 per device x 2 accumulation x 4 devices
                   gradient_accumulation_steps=2)
  assert cfg["zero_optimization"]["stage"] == 2
  out = capsys.readouterr().out
  assert "[Rank 0] Zero Stage 2: optimizer state and gradients partitioned" in out
  o = tmp_path / "out"
  # memory.png's bars are labelled by the stage that ran (it said ZeRO-1)
  assert json.load(open(o / "summary.json"))["memory"]["stage"] == 2
  rows = [json.loads(l) for l in open(o / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in rows)
  assert json.load(open(o / "ds_config.json"))["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("extra,cfg_edit,message", [
    ([], None, "Check batch related parameters"),   # 32 != 2 x 1 x 4
    ([], {"train_batch_size": 30}, "30 != 2 * 1 * 4"),   # the flag's micro-batch 2, not 30 // 4 = 7
    (["--train_batch_size", "16"], None, "--train_batch_size 16 conflicts with train_batch_size=32"),
    ([], {"optimizer": {"type": "Adamm", "params": {}}}, "Adamm"),
    ([], {"bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled"),
    (["--bf16"], {"train_batch_size": 8},   # the flag is named, and the fix
     "--bf16 set bf16.enabled and the JSON enables fp16: drop --bf16 or set "
     "fp16.enabled false in the JSON"),
    (["--num_devices", "64"], None, "--num_devices 64 but only 8"),
])
def test_bad_input_is_one_clear_error(tmp_path, capsys, extra, cfg_edit, message):
  cfg = json.load(open(SEED_JSON))
  if cfg_edit:
    cfg["train_batch_size"] = 8
    cfg.update(cfg_edit)
  path = tmp_path / "ds.json"
  path.write_text(json.dumps(cfg))
  assert run(tmp_path, *extra, config=path) == 2
  err = capsys.readouterr().err
  assert message in err, err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_and_invalid_json(tmp_path, capsys):
  assert run(tmp_path, config=tmp_path / "nope.json") == 2
  assert "nope.json" in capsys.readouterr().err
  bad = tmp_path / "bad.json"
  bad.write_text('{"train_batch_size": 8,,}')
  assert run(tmp_path, config=bad) == 2
  err = capsys.readouterr().err
  assert "invalid JSON" in err and "line 1" in err


def test_console_script_exit_code_without_traceback(tmp_path):
  """The installed entry point, as a user runs it."""
  proc = subprocess.run(
      [sys.executable, "-m", "zero1_jax.cli.train", "--deepspeed",
       str(tmp_path / "missing.json"), "--num_devices", "2"],
      capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "Traceback" not in proc.stderr and "missing.json" in proc.stderr


def test_overlap_comm_turns_on_the_latency_hiding_scheduler(tmp_path, monkeypatch):
  from zero1_jax.cli import common
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  path = tmp_path / "ds.json"
  path.write_text(json.dumps({"zero_optimization": {"stage": 1, "overlap_comm": False}}))
  common.overlap_flags(str(path))
  assert "latency_hiding" not in os.environ["XLA_FLAGS"]
  common.overlap_flags(SEED_JSON)                     # overlap_comm: true
  assert os.environ["XLA_FLAGS"].endswith(
      "--xla_gpu_enable_latency_hiding_scheduler=true")


def test_own_warnings_are_one_line_each(tmp_path, capsys):
  """A DeepSpeed key zero1_jax cannot honour warns in one line, without
  Python's file:line and source-line noise."""
  cfg = json.load(open(SEED_JSON))
  cfg.update(train_batch_size=4, comet={"enabled": True},
             memory_breakdown=True)
  assert train_cli(tmp_path, cfg, max_steps=1) == 0
  err = capsys.readouterr().err
  lines = [l for l in err.splitlines() if "not honoured" in l]
  assert len(lines) == 2, err
  assert all(l.startswith("[zero1_jax] warning: ") for l in lines), err
  assert "UserWarning" not in err and "config.py" not in err, err


def _axes_texts(monkeypatch, method: str) -> list[str]:
  """The texts memory_bars passes to ``plt.Axes.<method>``, in order."""
  pytest.importorskip("matplotlib")
  from matplotlib import pyplot as plt
  got, real = [], getattr(plt.Axes, method)

  def spy(ax, text, *a, **k):
    got.append(text)
    return real(ax, text, *a, **k)
  monkeypatch.setattr(plt.Axes, method, spy)
  return got


def test_memory_plot_of_a_multi_process_run_says_whose_ranks(tmp_path,
                                                             monkeypatch):
  """Process 0 writes the plot with its own ranks only: the title says so
  (2 bars under 'N=4' read as missing data)."""
  titles = _axes_texts(monkeypatch, "set_title")
  from zero1_jax.cli import plots
  for ranks in ([0, 1], [0, 1, 2, 3]):
    plots.memory_bars({"num_devices": 4, "ranks": ranks,
                       "replicated_bytes": 4e6,
                       "zero1_bytes_per_rank": [1e6] * len(ranks)},
                      str(tmp_path / f"m{len(ranks)}.png"))
  assert titles == ["Optimizer state per device, N=4: process 0's ranks (measured)",
                    "Optimizer state per device, N=4 (measured)"]


def test_memory_plot_says_master_only_when_there_is_one(tmp_path, monkeypatch):
  """fp32 params are their own master (the state holds none): the axis of
  an fp32 run must not say "master incl."; a 16-bit run's state holds it."""
  labels = _axes_texts(monkeypatch, "set_ylabel")
  from zero1_jax.cli import plots
  for fp32 in (True, False):
    plots.memory_bars({"num_devices": 2, "replicated_bytes": 4e6,
                       "zero1_bytes_per_rank": [2e6] * 2,
                       "fp32_params": fp32}, str(tmp_path / f"{fp32}.png"))
  assert labels == ["optimizer state (MiB)",
                    "optimizer state, fp32 master incl. (MiB)"]


def test_one_cpu_device_by_default_says_nothing_is_sharded():
  """Without --num_devices a CPU has one device: the run trained without a
  word that nothing was sharded ("Default: all" in --help)."""
  note = train._one_cpu_device_note
  assert "nothing is sharded; --num_devices 4" in note(1, None, False, "cpu")
  assert note(1, 1, False, "cpu") is None        # asked for one: fine
  assert note(8, None, False, "cpu") is None     # XLA_FLAGS gave 8
  assert note(1, None, True, "cpu") is None      # one per process, by design
  assert note(1, None, False, "gpu") is None


def test_step_lines_say_when_a_step_was_skipped():
  """A skipped step's line says so, with the loss scale it goes to (it
  showed the loss and scale as if the step had been taken); without fp16
  there is no loss scale to show (it printed "scale 1")."""
  from types import SimpleNamespace
  from zero1_jax.cli import reports
  row = dict(step=3, loss=5.5, skipped=False, loss_scale=1.0, samples_per_s=9.0)
  assert reports.step_line(row, False, None) == \
      "step     3 loss 5.5000 9.0 samples/s"
  fp16 = {**row, "skipped": True, "loss_scale": 256.0}
  halved, kept = SimpleNamespace(loss_scale=128.0), SimpleNamespace(loss_scale=256.0)
  assert reports.step_line(fp16, True, halved) == (
      "step     3 loss 5.5000 scale 256 9.0 samples/s  SKIPPED (gradient "
      "overflow: weights and optimizer state unchanged; loss scale 256 -> 128)")
  assert reports.step_line(fp16, True, kept).endswith(
      "loss scale stays 256 (hysteresis))")
  nan = {**row, "skipped": True, "loss": None}
  assert reports.step_line(nan, False, None) == (
      "step     3 loss nan 9.0 samples/s  SKIPPED (inf/nan gradients: "
      "weights and optimizer state unchanged)")


def test_a_config_without_a_batch_names_the_flag_that_gives_it(tmp_path, capsys):
  """No batch key at all and no batch flag: DeepSpeed's message, plus the
  zero1-train flag that fixes it (it named neither). "train_batch_size":
  "auto" alone takes HF's default micro batch (8), as the HF Trainer does
  (it failed the same way)."""
  from zero1_jax.cli import hf_auto
  raw = {"train_batch_size": "auto"}
  hf_auto.fill(raw, flags={}, max_steps=1, hidden_size=8)
  assert raw == {"train_micro_batch_size_per_gpu": 8}    # tb derived: 8 x ws
  path = tmp_path / "ds.json"
  path.write_text(json.dumps({"optimizer": {
      "type": "AdamW", "params": {"lr": 1e-3}}}))
  assert train.main(["--deepspeed", str(path), "--num_devices", "2",
                     "--model_name_or_path", "bert-tiny", "--max_steps", "1",
                     "--output_dir", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert "needs to be provided; zero1-train's --per_device_train_batch_size " \
         "gives the micro batch" in err, err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1
