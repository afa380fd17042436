"""A new user's first contact (issue 30, items 4 and 5): nothing sharded
silently on a lone CPU device, and zero1-train's console (the demo config's
notes, fp16 warm-up skips, a typo'd flag, steps_per_print)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import jax
import optax
import pytest

import zero1_jax as z1
from zero1_jax.core import one_device

from helpers import SEED_CONFIG, mesh

# What a first run on a laptop does: one process, one CPU device (no
# XLA_FLAGS), and each of the three ways in: z1.init, tx.init under plain jit
# (jax.set_mesh), z1.initialize. Each says it (the once-per-process flag is
# reset between them); a second call says nothing.
_ONE_CPU = r"""
import warnings
import jax, jax.numpy as jnp, optax
import zero1_jax as z1
from zero1_jax.core import one_device
assert jax.device_count() == 1 and jax.default_backend() == "cpu"
warnings.simplefilter("always")
m = jax.make_mesh((1,), ("data",))
params = {"w": jnp.ones((4, 3))}
tx = z1.zero1(optax.sgd(0.1), axis_name="data", check_elementwise=False)

def said(f):
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    f()
    f()      # once per process: the second call says nothing
  return [str(x.message) for x in w
          if issubclass(x.category, one_device.OneDeviceWarning)]

def plain_jit():
  with jax.set_mesh(m):
    tx.init(jax.device_put(params, jax.sharding.NamedSharding(
        m, jax.sharding.PartitionSpec())))

cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
       "zero_allow_untested_optimizer": True}
ways = {"z1.init": lambda: z1.init(tx, params, m),
        "tx.init": plain_jit,
        "z1.initialize": lambda: z1.initialize(
            cfg, lambda p, b: jnp.sum(p["w"]), params, m)}
for name, f in ways.items():
  one_device._said = False
  print(name, said(f))
"""


def test_a_lone_cpu_device_says_once_that_nothing_is_sharded():
  """The README's examples exited 0 on one CPU device with nothing sharded
  and not a word: each way in now warns once, naming XLA_FLAGS."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run([sys.executable, "-c", _ONE_CPU], env=env,
                     capture_output=True, text=True, timeout=300,
                     cwd=os.path.dirname(__file__))
  assert r.returncode == 0, r.stderr[-3000:]
  lines = r.stdout.strip().splitlines()
  assert [l.split(" ", 1)[0] for l in lines] == [
      "z1.init", "tx.init", "z1.initialize"], r.stdout
  for line in lines:
    msgs = eval(line.split(" ", 1)[1])   # noqa: S307 - our own repr of a list
    assert len(msgs) == 1, line          # once, not once per call
    assert "nothing is sharded" in msgs[0]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in msgs[0]
    assert "before jax is imported" in msgs[0]


def test_one_device_chosen_of_eight_says_nothing():
  """One device picked out of eight (as many tests do) is the user's choice:
  no warning, and it does not use up the once-per-process flag."""
  tx = z1.zero1(optax.sgd(0.1), axis_name="data", check_elementwise=False)
  with warnings.catch_warnings():
    warnings.simplefilter("error", one_device.OneDeviceWarning)
    z1.init(tx, {"w": jax.numpy.ones(3)}, mesh(1))
  assert not one_device._said


# --- zero1-train's console (item 5) ---------------------------------------

class _Engine:
  """Stands in for the DeepSpeed engine in zero1-train's step loop: a
  dynamic fp16 loss scale that overflows at the given steps (halving, no
  hysteresis)."""

  def __init__(self, overflow=(), scale=2.0 ** 16):
    self.global_steps = self.skipped_steps = 0
    self.loss_scale, self.overflow = scale, set(overflow)

  def get_lr(self):
    return [1e-3]

  def train_batch(self, batch):
    del batch
    self.global_steps += 1
    skipped = self.global_steps in self.overflow
    scale = self.loss_scale
    if skipped:
      self.skipped_steps += 1
      self.loss_scale /= 2
    return {"loss": 5.0, "grad_norm": 1.0, "skipped": skipped,
            "loss_scale": scale}


class _Batches:
  def batch_at(self, step):
    return step


def _loop(tmp_path, config: dict, *flags, overflow=(), bar=True,
          max_steps=6, tty=True) -> str:
  """zero1-train's step loop (cli/train.py _train) on a stub engine: what
  it prints, with the progress bar on (tqdm) or off (--no_progress), to a
  terminal or not (``tty``)."""
  from zero1_jax.cli import common, train, train_args
  from zero1_jax.deepspeed import config as zconfig
  cfg = zconfig.load_config(config, world_size=2)
  args = train_args.parse_args(["--deepspeed", "ds.json", "--max_steps",
                                str(max_steps), "--output_dir",
                                str(tmp_path), *flags])
  log_lines = common.step_lines(args.no_progress, tty=tty)
  progress = common.progress(max_steps, disable=args.no_progress)
  train._train(_Engine(overflow), _Batches(), args, cfg, [], progress,
               log_lines, True, str(tmp_path / "checkpoints"))
  progress.close()
  return progress


def _step_lines(out: str) -> list[int]:
  return [int(l.split()[1]) for l in out.splitlines() if l.startswith("step ")]


FP32 = {"train_batch_size": 8, "optimizer": {"type": "Adam",
                                            "params": {"lr": 1e-3}}}
FP16 = {**FP32, "fp16": {"enabled": True}}
WARMUP = (
    "[zero1-train] fp16: step 1 skipped, as expected in the first steps: the "
    "dynamic loss scale starts at 2^16 (DeepSpeed's default), too high for "
    "these gradients in fp16; each overflow skips its step (weights and "
    "optimizer state unchanged) and halves the scale until they fit. Skipped "
    "steps count toward --max_steps, as in DeepSpeed")


@pytest.mark.parametrize("flags", [(), ("--no_progress",)])
def test_the_first_fp16_skip_is_explained_once(tmp_path, capsys, flags):
  """"3 skipped" was explained only in a plot legend: the first skipped
  step says why, once, with the bar or with step lines."""
  pytest.importorskip("tqdm")
  _loop(tmp_path, FP16, *flags, overflow=(1, 2, 4))
  said = [l for l in capsys.readouterr().out.splitlines()
          if l.startswith("[zero1-train] fp16:")]
  assert said == [WARMUP]


def test_other_skips_and_powers_say_their_own(tmp_path, capsys):
  """fp32 / bf16 skips are inf/nan gradients, and a static loss scale does
  not warm up: nothing to explain. Another initial_scale_power: named."""
  from zero1_jax.cli import reports
  from zero1_jax.deepspeed import config as zconfig
  _loop(tmp_path, FP32, overflow=(1,))
  assert "[zero1-train] fp16:" not in capsys.readouterr().out
  static = zconfig.load_config({**FP32, "fp16": {"enabled": True,
                                                 "loss_scale": 128}}, 2)
  assert reports.fp16_skip_note(static.fp16, 1) is None
  p20 = zconfig.load_config({**FP32, "fp16": {"enabled": True,
                                              "initial_scale_power": 20}}, 2)
  assert "starts at 2^20 (fp16.initial_scale_power)" in \
      reports.fp16_skip_note(p20.fp16, 3)
  # A resumed run's first skip, tried at the scale it had come down to, is
  # no warm-up: its step line says why (a fresh clone's resume said "as
  # expected in the first steps ... starts at 2^16" at step 24, scale 32768).
  assert reports.fp16_skip_note(p20.fp16, 24, 2.0 ** 15) is None
  assert reports.fp16_skip_note(p20.fp16, 1, 2.0 ** 20) is not None


def test_steps_per_print_prints_step_lines_above_the_bar(tmp_path, capsys):
  """`"steps_per_print": 2` printed nothing: step lines came only with
  --no_progress or without tqdm. A period asked for (the JSON's
  steps_per_print, or --logging_steps) now prints them above the bar, as the
  HF Trainer prints every logging_steps; without one, the bar alone, as
  before (DeepSpeed 0.19.8's default is no step line)."""
  pytest.importorskip("tqdm")
  _loop(tmp_path, {**FP32, "steps_per_print": 2})
  assert _step_lines(capsys.readouterr().out) == [1, 2, 4, 6]
  _loop(tmp_path, FP32, "--logging_steps", "3")
  assert _step_lines(capsys.readouterr().out) == [1, 3, 6]
  _loop(tmp_path, FP32)                                    # the bar alone
  assert _step_lines(capsys.readouterr().out) == []
  _loop(tmp_path, FP32, "--no_progress")                   # as before: 10
  assert _step_lines(capsys.readouterr().out) == [1, 6]


def test_output_to_a_file_gets_step_lines_with_the_bar(tmp_path, capsys):
  """`zero1-train ... > train.log` with tqdm installed wrote no step line
  to the file (the bar, on stderr, was all): stdout that is not a terminal
  gets the lines --no_progress prints, and tqdm's bar stays on stderr."""
  pytest.importorskip("tqdm")
  _loop(tmp_path, FP32, tty=False)
  out = capsys.readouterr()
  assert _step_lines(out.out) == [1, 6]
  assert "6/6" in out.err                                   # the bar


@pytest.fixture
def fresh_notes(monkeypatch):
  """The config notes are said once per process: as a fresh zero1-train."""
  from zero1_jax.deepspeed import config as zconfig
  monkeypatch.setattr(zconfig, "_NOTED", set())


DEMO_NOTE = (
    "[zero1_jax] 3 keys of this config are accepted; each has no effect "
    "here: zero_optimization.allgather_partitions, "
    "zero_optimization.overlap_comm, zero_optimization.contiguous_gradients "
    "(why, key by key: docs/deepspeed_config.md)")


def test_no_effect_notes_collapse_into_one_line(fresh_notes):
  """The filter zero1-train puts on the config's notes: the per-key lines
  are kept back, their keys said in one line; other INFO lines pass."""
  import logging
  from zero1_jax.cli import reports
  from zero1_jax.deepspeed import config as zconfig
  notes, said = reports.NoEffectNotes(), []
  log = logging.getLogger("zero1_jax")
  seen = logging.Handler(logging.INFO)
  seen.emit = lambda r: said.append(r.getMessage())
  level = log.level
  log.addFilter(notes)
  log.addHandler(seen)
  log.setLevel(logging.INFO)
  try:
    zconfig.load_config({**SEED_CONFIG, "fp16": {"enabled": "auto"}}, 4)
  finally:
    log.removeFilter(notes)
    log.removeHandler(seen)
    log.setLevel(level)
  assert "[zero1_jax] " + notes.summary() == DEMO_NOTE
  assert said == ["fp16.enabled='auto' dropped; DeepSpeed's default applies"]
  one = reports.NoEffectNotes()
  one.keys = ["zero_optimization.overlap_comm"]
  assert one.summary().startswith("1 key of this config is "
                                  "accepted and has no effect here: ")


@pytest.mark.slow   # a zero1-train run: ~40 s on a loaded 2-core host
def test_make_demo_s_console(tmp_path, capsys, fresh_notes):
  """`make demo`'s own JSON (the seed tutorial's) opened with three "has no
  effect" lines, one 230 characters long: now one line naming the keys."""
  from zero1_jax.cli import train
  config = os.path.join(os.path.dirname(__file__), "..", "experiments",
                        "configs", "ds_zero_stage1.json")
  assert train.main(["--deepspeed", config, "--num_devices", "4",
                     "--per_device_train_batch_size", "8",
                     "--model_name_or_path", "bert-tiny", "--seq_len", "16",
                     "--max_steps", "2",
                     "--output_dir", str(tmp_path / "out")]) == 0
  cap = capsys.readouterr()
  assert [l for l in cap.err.splitlines() if "no effect" in l] == [
      DEMO_NOTE], cap.err
  assert "what overlaps" not in cap.err          # overlap_comm's long line
  rows = [json.loads(l) for l in open(tmp_path / "out" / "metrics.jsonl")]
  assert rows[0]["skipped"]   # its first gradients x 2^16 overflow fp16
  assert [l for l in cap.out.splitlines() if "[zero1-train] fp16:" in l] == [
      WARMUP]
