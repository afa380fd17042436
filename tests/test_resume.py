"""Crash and resume: a zero1-train process killed with SIGKILL, once after a
save and once while a save is being written, then restarted with --resume,
ends with exactly the parameters of a run that never stopped."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from zero1_jax import checkpoint

CONFIG = {"train_batch_size": 8, "zero_optimization": {"stage": 1},
          "fp16": {"enabled": True, "initial_scale_power": 8},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
STEPS = 8
# kill -9 and Ctrl-C of real zero1-train processes: `make test-slow` (CI).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def cmd(tmp, out, *extra):
  cfg = tmp / "ds.json"
  cfg.write_text(json.dumps(CONFIG))
  return [sys.executable, "-m", "zero1_jax.cli.train", "--deepspeed", str(cfg),
          "--num_devices", "2", "--model_name_or_path", "bert-tiny",
          "--seq_len", "16", "--max_steps", str(STEPS), "--save_steps", "2",
          "--no_progress", "--output_dir", str(tmp / out), *extra]


ENV = {**os.environ, "XLA_FLAGS": ""}


def finished_params(tmp, out):
  dest = tmp / f"{out}-export"
  checkpoint.export_params(tmp / out / "checkpoints", dest, STEPS)
  return checkpoint.load_params(dest)


def kill_when(tmp, out, ready) -> None:
  """Starts a run and SIGKILLs it as soon as ``ready(ckpt_dir)`` holds."""
  proc = subprocess.Popen(cmd(tmp, out), env=ENV, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
  ckpt = tmp / out / "checkpoints"
  deadline = time.monotonic() + 600   # startup hang guard (loaded hosts: minutes)
  while not ready(ckpt):
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    assert time.monotonic() < deadline
    time.sleep(0.005)
  proc.send_signal(signal.SIGKILL)
  proc.wait()


def committed(ckpt, step):
  return (ckpt / str(step)).is_dir()


def writing(ckpt):
  """A save in progress: orbax's temporary directory exists (steps >= 4)."""
  return any(int(os.path.basename(p).split(".")[0]) >= 4
             for p in glob.glob(str(ckpt / "*.orbax-checkpoint-tmp*")))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
  """One uninterrupted run: its output dir and its final params."""
  tmp = tmp_path_factory.mktemp("ref")
  run = subprocess.run(cmd(tmp, "ref"), env=ENV, capture_output=True,
                       text=True, timeout=240)
  assert run.returncode == 0, run.stderr[-2000:]
  return tmp / "ref", finished_params(tmp, "ref")


@pytest.mark.parametrize("when", ["after_save", "during_save"])
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path, when, ref):
  ref_dir, want = ref
  if when == "after_save":
    kill_when(tmp_path, "crash", lambda c: committed(c, 4))
  else:
    kill_when(tmp_path, "crash",
              lambda c: writing(c) or committed(c, 6))   # best effort: mid-save
  resumed = subprocess.run(cmd(tmp_path, "crash", "--resume", "latest"), env=ENV,
                           capture_output=True, text=True, timeout=240)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "resumed from" in resumed.stdout
  got = finished_params(tmp_path, "crash")
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  rows = [json.loads(l) for l in open(tmp_path / "crash" / "metrics.jsonl")]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  ref_rows = [json.loads(l) for l in open(ref_dir / "metrics.jsonl")]
  assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]
  assert [r["loss_scale"] for r in rows] == [r["loss_scale"] for r in ref_rows]


def test_a_save_cut_short_is_named_once_and_replaced(tmp_path, ref):
  """The newest step's save was cut short (orbax's temporary directory is
  left): --resume says so in one line, continues from the step before, and
  saving that step again replaces it without orbax's own warning."""
  ref_dir, want = ref
  shutil.copytree(ref_dir, tmp_path / "run")
  ckpt = tmp_path / "run" / "checkpoints"
  os.rename(ckpt / str(STEPS), ckpt / f"{STEPS}.orbax-checkpoint-tmp")
  resumed = subprocess.run(cmd(tmp_path, "run", "--resume", "latest"), env=ENV,
                           capture_output=True, text=True, timeout=240)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert (f"step {STEPS} in {ckpt}: a save cut short, never loaded; replaced "
          f"when saved again") in resumed.stdout
  assert f"at step {STEPS - 2}" in resumed.stdout
  assert "not finalized" not in resumed.stderr, resumed.stderr[-2000:]
  assert checkpoint.committed_steps(ckpt)[-1] == STEPS
  got = finished_params(tmp_path, "run")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_the_first_save_cut_short_is_named_too(tmp_path, ref):
  """Killed while writing its first checkpoint (no summary, only orbax's
  temporary directory): --resume starts again from step 0 and names the
  cut save in its own line, not in orbax's "not finalized" warning."""
  shutil.copytree(ref[0], tmp_path / "run")
  ckpt = tmp_path / "run" / "checkpoints"
  for p in ckpt.iterdir():
    if p.name != "2":
      shutil.rmtree(p) if p.is_dir() else p.unlink()
  os.rename(ckpt / "2", ckpt / "2.orbax-checkpoint-tmp")
  (tmp_path / "run" / "summary.json").unlink()
  resumed = subprocess.run(cmd(tmp_path, "run", "--resume", "latest"), env=ENV,
                           capture_output=True, text=True, timeout=240)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "stopped before its first checkpoint" in resumed.stdout
  assert (f"step 2 in {ckpt}: a save cut short, never loaded; replaced "
          f"when saved again") in resumed.stdout
  assert "not finalized" not in resumed.stderr, resumed.stderr[-2000:]
  assert checkpoint.committed_steps(ckpt)[-1] == STEPS


def test_corrupt_latest_checkpoint_falls_back_only_when_asked(tmp_path, ref):
  ref_dir, want = ref
  shutil.copytree(ref_dir, tmp_path / "run")      # a finished run to corrupt
  files = [p for p in (tmp_path / "run" / "checkpoints" / str(STEPS)).rglob("*")
           if p.is_file() and "state" in p.parts]
  biggest = max(files, key=lambda p: p.stat().st_size)
  biggest.write_bytes(biggest.read_bytes()[:10])             # truncate it

  latest = subprocess.run(cmd(tmp_path, "run", "--resume", "latest"), env=ENV,
                          capture_output=True, text=True, timeout=240)
  assert latest.returncode == 2
  assert f"step {STEPS}" in latest.stderr and biggest.name in latest.stderr
  assert "--resume latest-valid continues from the newest step that is " \
         "readable" in latest.stderr                 # the way out, named
  assert "Traceback" not in latest.stderr

  valid = subprocess.run(cmd(tmp_path, "run", "--resume", "latest-valid"),
                         env=ENV, capture_output=True, text=True, timeout=240)
  assert valid.returncode == 0, valid.stderr[-2000:]
  assert f"skipping step {STEPS}" in valid.stderr
  assert f"at step {STEPS - 2}" in valid.stdout
  dest = tmp_path / "again"
  checkpoint.export_params(tmp_path / "run" / "checkpoints", dest, STEPS)
  got = checkpoint.load_params(dest)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_ctrl_c_says_how_to_continue_and_resume_does(tmp_path):
  """Ctrl-C (SIGINT) mid-run: exit 130 with one line naming the last
  committed checkpoint, no traceback; --resume latest continues from it, even
  with a metrics line cut short (as a kill -9 mid-write leaves it)."""
  # Python ignores SIGINT if it starts with SIGINT ignored (as a CI shell's
  # background job does): the child gets the terminal's default, since a
  # handler (unlike SIG_IGN) is reset at exec.
  old = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    proc = subprocess.Popen(
        cmd(tmp_path, "int", "--max_steps", "100000"), env=ENV,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  finally:
    signal.signal(signal.SIGINT, old)
  ckpt = tmp_path / "int" / "checkpoints"
  deadline = time.monotonic() + 600   # startup hang guard (loaded hosts: minutes)
  while not committed(ckpt, 4):
    assert proc.poll() is None, proc.stderr.read()[-2000:]
    assert time.monotonic() < deadline
    time.sleep(0.005)
  proc.send_signal(signal.SIGINT)
  err = proc.communicate(timeout=120)[1]
  assert proc.returncode == 130, err[-2000:]
  assert "Traceback" not in err, err[-2000:]
  last = checkpoint.Checkpointer(ckpt, create=False).latest_step()
  assert last >= 4
  assert (f"the last checkpoint is step {last} in {ckpt}: --resume latest "
          f"continues from it") in err.splitlines()[-1], err[-2000:]
  rows = [json.loads(l) for l in open(tmp_path / "int" / "metrics.jsonl")]
  assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
  assert f"interrupted after step {len(rows)} " in err

  with open(tmp_path / "int" / "metrics.jsonl", "a") as f:
    f.write('{"step": 99999, "lo')                  # cut short
  resumed = subprocess.run(
      cmd(tmp_path, "int", "--resume", "latest", "--max_steps", str(last + 2)),
      env=ENV, capture_output=True, text=True, timeout=240)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f"at step {last} " in resumed.stdout
  rows = [json.loads(l) for l in open(tmp_path / "int" / "metrics.jsonl")]
  assert [r["step"] for r in rows] == list(range(1, last + 3))
