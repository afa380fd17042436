"""zero1-train's flags: every bad number is argparse's one-line usage error
(exit 2) before anything starts; the launch flags it takes differently say
what to write instead; --help names every model and default."""

import pytest

from zero1_jax.cli import train_args
from zero1_jax.models import bert

BASE = ["--deepspeed", "ds.json"]


def usage_error(capsys, *argv) -> str:
  with pytest.raises(SystemExit) as e:
    train_args.parse_args([*BASE, *argv])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,message", [
    (["--logging_steps", "0"], "--logging_steps 0: must be at least 1"),
    (["--max_steps", "0"], "--max_steps 0: must be at least 1"),
    (["--save_steps", "-5"], "--save_steps -5: must be 0 or more"),
    (["--seq_len", "0"], "--seq_len 0: must be at least 1"),
    (["--per_device_train_batch_size", "0"],
     "--per_device_train_batch_size 0: must be at least 1"),
    (["--local_rank=0"], "--local_rank is not a zero1-train flag: zero1-train "
     "is its own launcher"),
    (["--resume_from_checkpoint", "x"], "use --resume latest|latest-valid|STEP"),
    (["--num_train_epochs", "3"], "use --max_steps"),
    # an HF Trainer command's flags
    (["--warmup_ratio", "0.1"], "use --warmup_steps N"),
    (["--save_strategy", "steps"], "saves every --save_steps N steps"),
    (["--report_to", "mlflow"], "--report_to mlflow: zero1-train reports to "
     "tensorboard, wandb, csv, all, none (DeepSpeed's monitors)"),
    (["--do_eval"], "does not evaluate"),
    (["--no_such_flag"], "unrecognized arguments: --no_such_flag"),
])
def test_bad_flags_are_usage_errors(capsys, argv, message):
  assert message in usage_error(capsys, *argv)


def test_do_train_from_an_hf_command_is_accepted():
  assert train_args.parse_args([*BASE, "--do_train"]).do_train


def test_save_total_limit_of_zero_or_less_keeps_all_as_hf_does():
  """The HF Trainer skips rotation for save_total_limit <= 0; it once made
  zero1-train delete every checkpoint, the last included."""
  for value in ("0", "-1"):
    assert train_args.parse_args([*BASE, "--save_total_limit", value]
                                 ).save_total_limit is None
  assert train_args.parse_args([*BASE, "--save_total_limit", "2"]
                               ).save_total_limit == 2


def test_logging_interval_flag_then_steps_per_print_then_ten():
  args = train_args.parse_args(BASE)
  assert train_args.logging_interval(args, None) == 10
  assert train_args.logging_interval(args, 2000) == 2000
  args = train_args.parse_args([*BASE, "--logging_steps", "1"])
  assert train_args.logging_interval(args, 2000) == 1


def test_help_names_every_model_and_shows_defaults():
  text = "".join(train_args._parser().format_help().split())  # unwrapped
  for name in bert.SIZES:
    assert name in text, name
  for default in ("Default:bert-tiny", "Default:100", "Default:128",
                  "Default:./output"):
    assert default in text, default



def test_report_to_all_is_the_installed_monitors(monkeypatch):
  """HF's "all": every integration whose package is installed."""
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda n, *a: None if n == "wandb" else real(n, *a))
  assert train_args.report_sections(["all"]) == (
      ["tensorboard"] if real("tensorboardX") else [])
  assert train_args.report_sections(["wandb", "csv"]) == ["wandb", "csv_monitor"]
  assert train_args.report_sections(["none"]) == []


@pytest.mark.parametrize("argv,message", [
    (["--lerning_rate", "1e-4"], "unrecognized argument --lerning_rate: did "
     "you mean --learning_rate?"),
    (["--per_device_batch_size=8"], "did you mean --per_device_train_batch_size?"),
    (["--output-dir", "o"], "did you mean --output_dir?"),      # HF's dashes
    (["--fp61"], "did you mean --fp16?"),
    # a typo of a launch flag zero1-train takes differently: that flag's hint
    (["--num_gpu", "2"], "--num_gpu is not a zero1-train flag (nor is "
     "--num_gpus): use --num_devices N"),
])
def test_a_typo_d_flag_gets_a_suggestion_in_one_line(capsys, argv, message):
  """A typo printed the 22-line usage and 'unrecognized arguments', with no
  suggestion (argparse has none for flags, up to 3.14): now one line, still
  exit 2."""
  with pytest.raises(SystemExit) as e:
    train_args.parse_args([*BASE, *argv])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and message in err[0], err
  assert err[0].endswith("(zero1-train --help lists the flags)")


def test_a_typo_of_the_required_flag_is_suggested_too(capsys):
  """--deepspeed is required: argparse's 'the following arguments are
  required' came first and hid the typo."""
  with pytest.raises(SystemExit):
    train_args.parse_args(["--deepsped", "ds.json"])
  assert "did you mean --deepspeed?" in capsys.readouterr().err


def test_abbreviations_and_far_names_keep_argparse_s_behaviour(capsys):
  """An abbreviation argparse accepts is no typo; a name close to nothing
  keeps the usage and 'unrecognized arguments'."""
  assert train_args.parse_args([*BASE, "--max_step", "3"]).max_steps == 3
  with pytest.raises(SystemExit):
    train_args.parse_args([*BASE, "--zzz_qqq"])
  err = capsys.readouterr().err
  assert err.startswith("usage:") and "unrecognized arguments: --zzz_qqq" in err
