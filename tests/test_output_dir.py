"""Issue 11, cases 2, 3 and 5: one run per --output_dir, errors as one line
(exit 2), metrics in order on resume, no NaN in summary.json."""

import json

import pytest

from zero1_jax.cli import train

CONFIG = {"train_batch_size": 8, "zero_optimization": {"stage": 1,
          "overlap_comm": True},
          "fp16": {"enabled": True, "initial_scale_power": 8},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def run(tmp_path, out, *extra, config=CONFIG):
  path = tmp_path / "ds.json"
  path.write_text(json.dumps(config))
  return train.main(["--deepspeed", str(path), "--num_devices", "4",
                     "--model_name_or_path", "bert-tiny", "--seq_len", "16",
                     "--no_progress", "--output_dir", str(out), *extra])


def steps(out):
  return [json.loads(l)["step"] for l in open(out / "metrics.jsonl")]


def logged_steps(out: str) -> list[int]:
  return [int(l.split()[1]) for l in out.splitlines() if l.startswith("step ")]


def one_line_error(capsys, *needles):
  err = capsys.readouterr().err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
  for n in needles:
    assert n in err, err
  return err


def test_second_run_never_mixes_with_the_first(tmp_path, capsys):
  out = tmp_path / "out"
  assert run(tmp_path, out, "--max_steps", "3", "--save_steps", "2") == 0
  first = (out / "metrics.jsonl").read_text()
  # log lines: step 1, every 10th (neither --logging_steps nor
  # steps_per_print), and the last
  assert logged_steps(capsys.readouterr().out) == [1, 3]
  # same command again: refused, nothing touched
  assert run(tmp_path, out, "--max_steps", "3", "--save_steps", "2") == 2
  one_line_error(capsys, "is not empty", "--resume latest",
                 "--overwrite_output_dir")
  assert (out / "metrics.jsonl").read_text() == first
  # --resume: continues from the last checkpoint (3), metrics in order
  # --save_total_limit holds after the load (it once kept every step)
  assert run(tmp_path, out, "--max_steps", "5", "--save_steps", "1",
             "--resume", "latest", "--save_total_limit", "2",
             "--logging_steps", "1") == 0
  printed = capsys.readouterr().out
  assert "at step 3" in printed
  assert logged_steps(printed) == [4, 5]          # --logging_steps 1: each
  assert steps(out) == [1, 2, 3, 4, 5]
  summary = json.load(open(out / "summary.json"))
  assert summary["steps"] == 5
  # the whole run's steps, and what this invocation did in its wall_s (it
  # said "5 steps in 0.9s" for 2 steps); what ran, without reading the log
  assert summary["resumed_from"] == 3 and summary["steps_this_run"] == 2
  assert summary["run"] == {
      "model": "bert-tiny", "seq_len": 16, "dtype": "fp16", "zero_stage": 1,
      "num_devices": 4, "num_processes": 1, "train_batch_size": 8,
      "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
      "max_steps": 5}
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
      "4", "5", "latest"]     # DeepSpeed's latest: the last save
  # the last line says what ran and where the checkpoints are; each row has
  # the lr used
  last = printed.strip().splitlines()[-1]
  assert "steps 4-5 after resuming at 3 (5 in all, 0 skipped) in " in last
  assert last.endswith(f"checkpoints (steps 4, 5) in {out / 'checkpoints'}")
  assert {json.loads(l)["lr"] for l in open(out / "metrics.jsonl")} == {
      1e-3}            # no scheduler: the configured rate, as DeepSpeed's get_lr()
  # --overwrite_output_dir: a new run, none of the old one's files left
  # (and the JSON's steps_per_print sets the log period)
  assert run(tmp_path, out, "--max_steps", "3", "--save_steps", "2",
             "--overwrite_output_dir",
             config={**CONFIG, "steps_per_print": 2}) == 0
  printed = capsys.readouterr().out
  assert logged_steps(printed) == [1, 2, 3]
  # it says what it deleted (the checkpoints too: HF's flag deletes nothing)
  assert (f"--overwrite_output_dir: removed the earlier run's metrics.jsonl, "
          f"summary.json, segments.json, ds_config.json, loss_curve.png, "
          f"memory.png, "
          f"checkpoints/ from {out}") in printed, printed
  assert steps(out) == [1, 2, 3]
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
      "2", "3", "latest"]
  assert json.load(open(out / "summary.json"))["steps"] == 3
  # a resume logs its own first step (4), then every 5th and the last: a
  # user sees at once that it runs (it showed nothing until step 5)
  assert run(tmp_path, out, "--max_steps", "6", "--resume", "latest",
             config={**CONFIG, "steps_per_print": 5}) == 0
  printed = capsys.readouterr().out
  assert logged_steps(printed) == [4, 5, 6]
  # no --save_steps this time: the last line says what a resume would lose
  assert printed.strip().splitlines()[-1].endswith(
      "; steps 4-6 not saved (--save_steps): --resume latest continues "
      "from 3"), printed


def test_output_dir_that_is_a_file(tmp_path, capsys):
  f = tmp_path / "out"
  f.write_text("not a directory")
  assert run(tmp_path, f, "--max_steps", "1") == 2
  one_line_error(capsys, "is a file")


def test_resume_without_any_checkpoint_is_an_error(tmp_path, capsys):
  """A typo in --output_dir must not silently restart training."""
  assert run(tmp_path, tmp_path / "typo", "--max_steps", "1",
             "--resume", "latest") == 2
  one_line_error(capsys, "no checkpoint in", "--output_dir")
  assert not (tmp_path / "typo" / "metrics.jsonl").exists()


def test_resume_of_a_finished_run_without_checkpoints_is_an_error(tmp_path, capsys):
  """It did not stop early: it ran to the end without --save_steps. Resuming
  must not silently start it again over its metrics."""
  out = tmp_path / "out"
  assert run(tmp_path, out, "--max_steps", "1") == 0
  metrics = (out / "metrics.jsonl").read_text()
  capsys.readouterr()
  assert run(tmp_path, out, "--max_steps", "2", "--resume", "latest") == 2
  one_line_error(capsys, "finished without saving a checkpoint",
                 "no --save_steps", "--overwrite_output_dir")
  assert (out / "metrics.jsonl").read_text() == metrics


def test_batch_error_shows_the_numbers_the_flags_gave(tmp_path, capsys):
  cfg = {**CONFIG, "train_batch_size": 30}
  assert run(tmp_path, tmp_path / "o", "--per_device_train_batch_size", "2",
             config=cfg) == 2
  err = one_line_error(capsys, "30 != 2 * 3 * 4")   # not the JSON's 7 * 1 * 4
  assert "has no effect" not in err     # no notes before an error


def test_all_steps_skipped_gives_valid_json(tmp_path, capsys):
  cfg = {**CONFIG, "fp16": {"enabled": True, "initial_scale_power": 60}}
  out = tmp_path / "o"
  assert run(tmp_path, out, "--max_steps", "2", config=cfg) == 0
  text = capsys.readouterr().out
  assert "nan" not in text and "all 2 steps were skipped" in text
  # each skipped step says so as it happens (DeepSpeed: "OVERFLOW! Skipping
  # step"); the step lines showed only the loss and the scale
  skipped = [l for l in text.splitlines() if l.startswith("step ")]
  assert len(skipped) == 2 and all(
      "SKIPPED (gradient overflow: weights and optimizer state unchanged; "
      "loss scale " in l for l in skipped), text
  summary = json.loads((out / "summary.json").read_text(),
                       parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
  assert summary["first_loss"] is None and summary["skipped_steps"] == 2
  for line in open(out / "metrics.jsonl"):
    json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))


def test_memory_lines_say_gib(tmp_path, capsys):
  assert run(tmp_path, tmp_path / "o", "--max_steps", "1") == 0
  out = capsys.readouterr().out
  # simulated CPU devices are not GPUs ("per GPU" on a GPU, as the seed)
  assert "GiB per device (1/4)" in out and " GB " not in out
  assert "per GPU" not in out
  assert "[zero1-train] 1 step (" in out.strip().splitlines()[-1]   # not "1 steps"


def test_missing_config_is_named_before_a_used_output_dir(tmp_path, capsys):
  """A mistyped --deepspeed path in a reused output directory: the error is
  the path, not the directory (fixing the directory first would not help)."""
  out = tmp_path / "out"
  out.mkdir()
  (out / "metrics.jsonl").write_text("{}\n")
  assert train.main(["--deepspeed", str(tmp_path / "missing.json"),
                     "--output_dir", str(out)]) == 2
  one_line_error(capsys, "missing.json", "no such file")


@pytest.mark.slow   # five zero1-train runs into one directory (~35 s)
def test_resume_with_another_global_batch_says_so(tmp_path, capsys):
  """train_batch_size derived from the micro batch and the devices: resumed
  at 2 devices instead of 4, the global batch halves. It trains on (as
  DeepSpeed and the HF Trainer do) and one line says what changed; resumed
  as it was, nothing is said."""
  cfg = {k: v for k, v in CONFIG.items() if k != "train_batch_size"}
  cfg["train_micro_batch_size_per_gpu"] = 2
  out = tmp_path / "o"
  assert run(tmp_path, out, "--max_steps", "2", "--save_steps", "2",
             config=cfg) == 0
  assert run(tmp_path, out, "--max_steps", "3", "--save_steps", "3",
             "--resume", "latest", config=cfg) == 0
  assert "global batch changes" not in capsys.readouterr().out
  path = tmp_path / "ds.json"
  assert train.main(["--deepspeed", str(path), "--num_devices", "2",
                     "--model_name_or_path", "bert-tiny", "--seq_len", "16",
                     "--no_progress", "--output_dir", str(out), "--max_steps",
                     "4", "--save_steps", "4", "--resume", "latest"]) == 0
  printed = capsys.readouterr().out
  assert ("note: the global batch changes at step 3 from 8 to 4 sequences "
          "(2 per device x 1 accumulation x 2 devices)") in printed, printed
  assert ("note: from step 3 this run trains with num_devices 4 -> 2; "
          "summary.json keeps each segment's settings") in printed, printed
  assert steps(out) == [1, 2, 3, 4]
  # resumed where it ended: says there is nothing to train (it said
  # "4 steps (0 skipped) in 0.0s"), and --do_train from an HF command is fine
  assert train.main(["--deepspeed", str(path), "--num_devices", "2",
                     "--model_name_or_path", "bert-tiny", "--seq_len", "16",
                     "--no_progress", "--output_dir", str(out), "--max_steps",
                     "4", "--resume", "latest", "--do_train"]) == 0
  last = capsys.readouterr().out.strip().splitlines()[-1]
  assert last.startswith("[zero1-train] nothing to train: the run is at step 4 "
                         "(--max_steps 4; a larger one continues it)"), last
  assert steps(out) == [1, 2, 3, 4]
  # each stretch's settings are kept: the resume at 2 devices did not
  # overwrite the first segment's
  segs = json.load(open(out / "summary.json"))["segments"]
  assert [(g["from_step"], g["num_devices"]) for g in segs] == [
      (0, 4), (2, 4), (3, 2)]
  # a resume with nothing to train leaves every file as it was (it cut
  # metrics.jsonl back to the checkpoint and rewrote summary, config, plots)
  with open(out / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n")  # an unsaved step
  before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
  assert train.main(["--deepspeed", str(path), "--num_devices", "2",
                     "--model_name_or_path", "bert-tiny", "--seq_len", "16",
                     "--no_progress", "--output_dir", str(out), "--max_steps",
                     "3", "--resume", "latest"]) == 0
  assert capsys.readouterr().out.strip().splitlines()[-1].endswith(
      f"{out} left as it was")
  assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_a_used_output_dir_without_checkpoints_does_not_suggest_resume(tmp_path):
  """A finished run without --save_steps cannot be continued: the refusal
  offered --resume latest, which then failed ("nothing to continue from")."""
  from zero1_jax.cli import common, rundir
  d = tmp_path / "out"
  d.mkdir()
  (d / "metrics.jsonl").write_text("{}\n")
  with pytest.raises(common.UsageError) as e:
    rundir.check(str(d), overwrite=False, resume=None)
  assert "--resume" not in str(e.value)
  assert "saved no checkpoint (no --save_steps)" in str(e.value)
  assert "--overwrite_output_dir" in str(e.value)
  (d / "checkpoints" / "3").mkdir(parents=True)
  with pytest.raises(common.UsageError, match="Pass --resume latest to continue it"):
    rundir.check(str(d), overwrite=False, resume=None)


def test_a_stretch_stopped_before_its_summary_keeps_its_settings(tmp_path, capsys):
  """A run stopped by Ctrl-C or kill -9 writes no summary.json, where
  resumes read the earlier stretches' settings from: each invocation
  records its own in segments.json as it starts. Here: 2 steps on 4
  devices, 2 more on 2 devices whose summary is lost (as if killed after
  its save at step 4), then a resume on 2 devices. Before: the segments
  began at step 4 (the first two stretches lost), and a resume after a
  stopped stretch compared its settings with the last summarised one's
  (a note "4 -> 2" for steps already trained on 2)."""
  cfg = {k: v for k, v in CONFIG.items() if k != "train_batch_size"}
  cfg["train_micro_batch_size_per_gpu"] = 2
  out = tmp_path / "o"
  assert run(tmp_path, out, "--max_steps", "2", "--save_steps", "2",
             config=cfg) == 0
  (tmp_path / "ds.json").write_text(json.dumps(cfg))
  on_2 = ["--deepspeed", str(tmp_path / "ds.json"), "--num_devices", "2",
          "--model_name_or_path", "bert-tiny", "--seq_len", "16",
          "--no_progress", "--output_dir", str(out), "--resume", "latest"]
  assert train.main(on_2 + ["--max_steps", "4", "--save_steps", "2"]) == 0
  assert "num_devices 4 -> 2" in capsys.readouterr().out
  (out / "summary.json").unlink()          # the stretch ends unsummarised
  assert train.main(on_2 + ["--max_steps", "5"]) == 0
  assert "num_devices" not in capsys.readouterr().out   # 2 -> 2: no note
  segs = json.load(open(out / "summary.json"))["segments"]
  assert [(g["from_step"], g["num_devices"]) for g in segs] == [
      (0, 4), (2, 2), (4, 2)]
  assert json.load(open(out / "segments.json")) == segs
