"""experiments/gpu/measure.py, the steps run on a real GPU beside XLA's
estimate, exercised here on one CPU device: each kind of step gets concrete
arguments it accepts (its outputs fed back as its donated inputs), and the
table sets a measured step against an estimate only where the per-device
work does not depend on N (the floor, DDP); a compiler-flag variant of a
plan entry runs with its flags and is its own row.
"""

import math

import jax
import pytest

from experiments.gpu import measure

MODEL = "small-bert"


@pytest.mark.parametrize("form", ["floor", "train_step", "jit_ts"])
def test_a_step_runs_on_the_arguments_made_for_it(form):
  r = measure.one(form, MODEL, "fp32", iters=1, repeats=1, warmup=1)
  assert r["form"] == form and r["gpus"] == 1 and r["device"] == jax.devices()[0].device_kind
  assert 0 < r["min_us"] <= r["step_us"] <= r["max_us"] and math.isfinite(r["step_us"])
  assert 0 < r["dispatch_us"] and math.isfinite(r["dispatch_us"])
  # the host's pace: the queued calls return before (or as) they have run
  assert 0 < r["queued_us"] <= r["step_us"] * 1.01
  assert len(r["host_probe_us"]) == 2 and min(r["host_probe_us"]) > 0
  assert r["xla_peak_bytes"] > 3.7e6 * 4   # at least the fp32 params


def test_the_table_compares_only_work_that_does_not_depend_on_n():
  row = lambda f, us: {"form": f, "model": MODEL, "dtype": "fp32", "device": "H200",
                       "step_us": us, "min_us": us, "max_us": us,
                       "xla_peak_bytes": 2 ** 30, "device_peak_bytes": 2 ** 30}
  est = lambda f, us: {"form": f, "model": MODEL, "dtype": "fp32", "gpus": 8,
                       "compute_us": us}
  nocb = lambda r: {**r, "variant": "nocb", "queued_us": 700.0}
  md = measure.table([row("floor", 900), row("ddp", 1000), row("train_step", 1100),
                      nocb(row("ddp", 1200)), nocb(row("train_step", 1800))],
                     [est("floor", 1000), est("ddp", 800), est("train_step", 500)])
  lines = {ln.split(" | ")[1]: ln for ln in md.splitlines()[2:]}
  assert "| 0.90 |" in lines["floor"] and "| 1.25 |" in lines["ddp"]
  assert "| 1.100 |" in lines["train_step"] and "| — |" in lines["train_step"]
  # a variant is its own row, set against DDP's step in the same variant
  assert "| 1.500 |" in lines["train_step (nocb)"] and "| 700 |" in lines["ddp (nocb)"]
  assert {len(ln.split(" | ")) for ln in lines.values()} == {10}   # every column


def test_a_form_is_set_against_the_ddp_timed_beside_it():
  """Rows from several runs (a ``run`` field) keep their order and their
  run; each is set against DDP of its own run, the nearest before it."""
  row = lambda run, f, us: {"run": run, "form": f, "model": MODEL, "dtype": "fp32",
                            "device": "H200", "step_us": us, "min_us": us, "max_us": us,
                            "xla_peak_bytes": 2 ** 30}
  md = measure.table([row(1, "ddp", 1000), row(1, "train_step", 1100),
                      row(2, "train_step", 900), row(2, "ddp", 1800), row(2, "ddp", 1200),
                      row(2, "train_step", 600)], [])
  rows = [ln.split(" | ") for ln in md.splitlines()[2:]]
  assert [(r[0], r[2]) for r in rows] == [("| 1", "ddp"), ("| 1", "train_step"),
                                          ("| 2", "train_step"), ("| 2", "ddp"),
                                          ("| 2", "ddp"), ("| 2", "train_step")]
  ratio = [r[7] for r in rows]   # / DDP's
  assert ratio[1] == "1.100"   # run 1's DDP
  assert ratio[2] == "0.500"   # none before it in run 2: the first after
  assert ratio[5] == "0.500"   # the nearest before: 1,200, not 1,800 or run 1's


@pytest.mark.slow
def test_check_sh_steps_dry_run_on_the_cpu(tmp_path):
  """The device phase as the lent GPU runs it (bash experiments/gpu/check.sh
  steps), dry-run on one CPU device: each form in its own process, a line
  of measured.jsonl for each."""
  import json
  import os
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_DRY": "1"}
  env.pop("XLA_FLAGS", None)
  r = subprocess.run(["bash", "experiments/gpu/check.sh", "steps"], cwd=root, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  rows = [json.loads(x) for x in (tmp_path / "measured.jsonl").read_text().splitlines()]
  assert [(x["form"], x["variant"]) for x in rows] == [("floor", ""), ("train_step", "nocb")]
  assert "command_buffer" not in rows[0]["xla_flags"]
  assert rows[1]["xla_flags"].endswith(measure.VARIANTS["nocb"])   # its process got them
  assert "train_step (nocb): ok" in (tmp_path / "measure.log").read_text()
