"""experiments/gpu/measure.py, the steps run on a real GPU beside XLA's
estimate, exercised here on one CPU device: each kind of step gets concrete
arguments it accepts (its outputs fed back as its donated inputs), and the
table sets a measured step against an estimate only where the per-device
work does not depend on N (the floor, DDP).
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
  assert r["xla_peak_bytes"] > 3.7e6 * 4   # at least the fp32 params


def test_the_table_compares_only_work_that_does_not_depend_on_n():
  row = lambda f, us: {"form": f, "model": MODEL, "dtype": "fp32", "device": "H200",
                       "step_us": us, "min_us": us, "max_us": us,
                       "xla_peak_bytes": 2 ** 30, "device_peak_bytes": 2 ** 30}
  est = lambda f, us: {"form": f, "model": MODEL, "dtype": "fp32", "gpus": 8,
                       "compute_us": us}
  md = measure.table([row("floor", 900), row("ddp", 1000), row("train_step", 1100)],
                     [est("floor", 1000), est("ddp", 800), est("train_step", 500)])
  lines = {ln.split(" | ")[1]: ln for ln in md.splitlines()[2:]}
  assert "| 0.90 |" in lines["floor"] and "| 1.25 |" in lines["ddp"]
  assert "| 1.100 |" in lines["train_step"] and "| — |" in lines["train_step"]
  assert len(lines["floor"].split(" | ")) == 9   # a row has every column


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
  assert [x["form"] for x in rows] == ["floor", "train_step"], rows
  assert "train_step: ok" in (tmp_path / "measure.log").read_text()
