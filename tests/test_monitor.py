"""DeepSpeed's monitors (tensorboard, csv_monitor, wandb) from the JSON and
from zero1-train's --report_to / --logging_dir: DeepSpeed 0.19.8's event
names at its x-axis (samples trained), read back from the files written."""

import csv
import os
import sys
import types

import pytest

import zero1_jax as z1
from zero1_jax.deepspeed import monitor
from zero1_jax.deepspeed.schema import NotHonouredWarning
from helpers import batch, float_part, loss_fn, mesh, odd_params, train_cli

NAMES = ("Train/Samples/train_loss", "Train/Samples/lr",
         "Train/Samples/loss_scale")


def tb_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] from the event files under ``logdir``, read with
  TensorBoard's own reader."""
  ea = pytest.importorskip(
      "tensorboard.backend.event_processing.event_accumulator")
  acc = ea.EventAccumulator(str(logdir))
  acc.Reload()
  return {t: [(e.step, e.value) for e in acc.Scalars(t)]
          for t in acc.Tags()["scalars"]}


def csv_rows(path) -> list[list[str]]:
  with open(path, newline="") as f:
    return list(csv.reader(f))


def test_csv_monitor_writes_one_file_per_event_as_deepspeed():
  cfg = monitor.parse({"csv_monitor": {"enabled": True, "output_path": "",
                                       "job_name": "j"}})
  cwd = os.getcwd()
  try:
    os.chdir(pytest.importorskip("tempfile").mkdtemp())
    m = monitor.Monitors(cfg)
    m.write_events([("Train/Samples/train_loss", 2.5, 32),
                    ("Train/Samples/lr", 0.1, 32)])
    m.write_events([("Train/Samples/train_loss", 2.0, 64)])
    # DeepSpeed: <output_path>/<job_name>/<name with / as _>.csv, header
    # step,<last part>; output_path "" is the working directory
    assert sorted(os.listdir("j")) == ["Train_Samples_lr.csv",
                                       "Train_Samples_train_loss.csv"]
    assert csv_rows("j/Train_Samples_train_loss.csv") == [
        ["step", "train_loss"], ["32", "2.5"], ["64", "2.0"]]
    # a second run (a resume) appends under the same header
    monitor.Monitors(cfg).write_events([("Train/Samples/lr", 0.2, 96)])
    assert csv_rows("j/Train_Samples_lr.csv") == [
        ["step", "lr"], ["32", "0.1"], ["96", "0.2"]]
  finally:
    os.chdir(cwd)


def test_wandb_absent_is_a_warning_not_a_failure(monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)     # import wandb fails
  cfg = monitor.parse({"wandb": {"enabled": True}})
  with pytest.warns(NotHonouredWarning, match="wandb package is not "
                    "installed: nothing is logged to W&B"):
    m = monitor.Monitors(cfg)
  m.write_events([("Train/Samples/lr", 0.1, 8)])   # no error


def test_wandb_runs_offline_with_deepspeeds_arguments(monkeypatch):
  calls = []
  fake = types.SimpleNamespace(
      init=lambda **k: calls.append(("init", k)),
      log=lambda d, step=None: calls.append(("log", d, step)))
  monkeypatch.setitem(sys.modules, "wandb", fake)
  monkeypatch.delenv("WANDB_MODE", raising=False)
  m = monitor.Monitors(monitor.parse({"wandb": {
      "enabled": True, "project": "p", "group": "g", "team": "t"}}))
  m.write_events([("Train/Samples/lr", 0.1, 8)])
  assert calls == [("init", dict(project="p", group="g", entity="t",
                                 mode="offline")),
                   ("log", {"Train/Samples/lr": 0.1}, 8)]
  assert not monitor.Monitors(monitor.parse({"wandb": {"enabled": True}}),
                              process_index=1).enabled   # process 0 only


def test_engine_writes_deepspeeds_events_at_samples(tmp_path):
  """fp16 (so loss_scale is written too), 3 steps of 16 samples: each event
  at 16, 32, 48; the values are the step's loss, the next update's lr
  (DeepSpeed writes get_lr() after the scheduler stepped) and the scale."""
  pytest.importorskip("tensorboardX")
  cfg = {"train_batch_size": 16, "zero_optimization": {"stage": 1},
         "fp16": {"enabled": True, "initial_scale_power": 4},   # no skips
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
         "scheduler": {"type": "WarmupLR", "params": {
             "warmup_max_lr": 1e-2, "warmup_num_steps": 4,
             "warmup_type": "linear"}},
         "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"),
                         "job_name": "run"},
         "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"),
                         "job_name": "run"}}
  engine = z1.initialize(cfg, loss_fn=loss_fn,
                         params=float_part(odd_params()), mesh=mesh(4))
  want = {n: [] for n in NAMES}
  for _ in range(3):
    m = engine.train_batch(batch(16))
    n = 16 * engine.global_steps
    want[NAMES[0]].append((n, float(m["loss"])))
    want[NAMES[1]].append((n, engine.get_lr()[0]))
    want[NAMES[2]].append((n, engine.loss_scale))
  assert engine.global_samples == 48 and engine.skipped_steps == 0
  got = tb_scalars(tmp_path / "tb" / "run")
  assert sorted(got) == sorted(NAMES)
  for name in NAMES:
    # tensorboard stores float32: the value rounded once (relative 2^-24)
    assert [s for s, _ in got[name]] == [16, 32, 48], name
    for (_, g), (_, w) in zip(got[name], want[name]):
      assert g == pytest.approx(w, rel=2.0**-23, abs=0), name
    rows = csv_rows(tmp_path / "csv" / "run" / (name.replace("/", "_") + ".csv"))
    assert rows[0] == ["step", name.split("/")[-1]]
    # csv holds Python's repr of the float: exact
    assert [(int(s), float(v)) for s, v in rows[1:]] == want[name], name
  assert want[NAMES[1]][0][1] != want[NAMES[1]][1][1]   # the lr moved


def test_no_monitor_enabled_writes_nothing(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  cfg = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
         "tensorboard": {"enabled": False}}
  engine = z1.initialize(cfg, loss_fn=loss_fn, params=float_part(odd_params()),
                         mesh=mesh(2))
  engine.train_batch(batch(8))
  assert not engine.monitor.enabled and os.listdir(tmp_path) == []


@pytest.mark.slow   # a zero1-train run: ~35 s on a loaded 2-core host
def test_zero1_train_report_to_writes_tensorboard_and_csv(tmp_path, capsys):
  """--report_to tensorboard csv --logging_dir D: both monitors on, writing
  into D (job_name ''), fp32 so no loss_scale; the loss written is the one
  in metrics.jsonl."""
  pytest.importorskip("tensorboardX")
  import json
  logdir = tmp_path / "logs"
  cfg = {"train_batch_size": 4, "zero_optimization": {"stage": 1},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
  assert train_cli(tmp_path, cfg, "--report_to", "tensorboard", "csv",
                   "--logging_dir", str(logdir), max_steps=2) == 0
  got = tb_scalars(logdir)
  assert sorted(got) == sorted(NAMES[:2])
  rows = [json.loads(l) for l in open(tmp_path / "out" / "metrics.jsonl")]
  assert [s for s, _ in got[NAMES[0]]] == [4, 8]
  for (_, g), r in zip(got[NAMES[0]], rows):
    assert g == pytest.approx(r["loss"], rel=2.0**-23, abs=0)
  assert csv_rows(logdir / "Train_Samples_lr.csv")[1:] == [["4", "0.001"],
                                                            ["8", "0.001"]]
  written = json.load(open(tmp_path / "out" / "ds_config.json"))
  assert written["tensorboard"] == {"enabled": True, "output_path": str(logdir),
                                    "job_name": ""}


def test_zero1_train_logging_dir_alone_is_refused(tmp_path, capsys):
  cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
  assert train_cli(tmp_path, cfg, "--logging_dir", str(tmp_path / "l")) == 2
  assert "--logging_dir" in capsys.readouterr().err
