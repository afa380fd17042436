"""``zero1-train``'s command line: the flags (HF Trainer and DeepSpeed names),
their checks, and hints for the launch flags it takes differently.

Every number is checked before anything starts: a bad value is one line and
exit 2, never a traceback after compiling.

Example:
  >>> args = parse_args(["--deepspeed", "ds.json", "--logging_steps", "1"])
  >>> args.logging_steps, args.max_steps, args.save_total_limit
  (1, 100, None)
"""

from __future__ import annotations

import argparse
import difflib
import sys

from zero1_jax.cli.common import UsageError

DEFAULT_LOGGING_STEPS = 10   # without --logging_steps or steps_per_print

# Flags of DeepSpeed's launcher and the HF Trainer that zero1-train does not
# take: what to write instead.
_INSTEAD = {
    "--local_rank": "zero1-train is its own launcher: one process drives all "
                    "of a host's devices. Run `zero1-train --num_devices N ...` "
                    "instead of `deepspeed --num_gpus N train.py ...`",
    "--num_gpus": "use --num_devices N",
    "--num_nodes": "use --num_processes (one per host) with "
                   "--coordinator_address, or --distributed_auto",
    "--resume_from_checkpoint": "use --resume latest|latest-valid|STEP (the "
                                "checkpoints in OUTPUT_DIR/checkpoints)",
    "--num_train_epochs": "zero1-train counts optimizer steps: use --max_steps",
    "--warmup_ratio": "use --warmup_steps N (the HF Trainer's ceil(ratio x "
                      "max_steps))",
    "--save_strategy": "zero1-train saves every --save_steps N steps (HF's "
                       "'steps'); --save_steps 0 saves none",
    "--do_eval": "zero1-train does not evaluate: drop --do_eval",
    "--eval_strategy": "zero1-train does not evaluate: drop it",
    "--evaluation_strategy": "zero1-train does not evaluate: drop it",
}


# Flags that fill (or set) one DeepSpeed key each: (flag, type, the key).
_BATCH_AND_LR = (
    ("--per_device_train_batch_size", int,
     "train_micro_batch_size_per_gpu (fills an 'auto')"),
    ("--gradient_accumulation_steps", int,
     "gradient_accumulation_steps (fills an 'auto')"),
    ("--train_batch_size", int,
     "train_batch_size: micro batch x accumulation x devices"),
    ("--learning_rate", float, "optimizer.params.lr (fills an 'auto')"))
_HF_OPTIMIZER = (
    ("--max_grad_norm", "gradient_clipping"),
    ("--weight_decay", "optimizer.params.weight_decay"),
    ("--adam_beta1", "optimizer.params.betas[0]"),
    ("--adam_beta2", "optimizer.params.betas[1]"),
    ("--adam_epsilon", "optimizer.params.eps"))


def _parser() -> argparse.ArgumentParser:
  """zero1-train's flags, in the order ``--help`` lists them."""
  p = argparse.ArgumentParser(
      prog="zero1-train", description="Train a Flax BERT-MLM with ZeRO stage 1 "
      "or 2 from a DeepSpeed JSON config.")
  _training_flags(p)
  _run_flags(p)
  _logging_flags(p)
  _checkpoint_flags(p)
  _multiprocess_flags(p)
  return p


def _training_flags(p: argparse.ArgumentParser) -> None:
  """The config, the devices, the model, and the flags that fill or set a
  key of the JSON (HF Trainer names)."""
  p.add_argument("--deepspeed", required=True, metavar="JSON",
                 help="DeepSpeed config file")
  p.add_argument("--do_train", action="store_true",
                 help="accepted from HF Trainer commands: zero1-train always "
                 "trains")
  p.add_argument("--num_devices", type=int, default=None,
                 help="data-parallel devices (CPU: simulated). Default: all")
  p.add_argument("--model_name_or_path", default="bert-tiny",
                 help="bert-tiny, bert-mini, bert-small, bert-medium, "
                 "bert-base-uncased or bert-large-uncased (architecture only, "
                 "random init; zero1_jax.models.bert.SIZES). Default: %(default)s")
  for flag, kind, key in _BATCH_AND_LR:
    p.add_argument(flag, type=kind, default=None, help=key)
  h = p.add_argument_group(
      "HF Trainer flags", "each fills its key's 'auto' in the JSON, or sets "
      "the key; a JSON value that differs is an error naming both")
  for flag, key in _HF_OPTIMIZER:
    h.add_argument(flag, type=float, default=None, help=key)
  p.add_argument("--warmup_steps", type=int, default=None,
                 help="fills scheduler.params.warmup_num_steps='auto' (as the "
                 "HF Trainer does)")
  p.add_argument("--fp16", action="store_const", const=True, default=None,
                 help="fp16 on (sets fp16.enabled; fills an 'auto' there)")
  p.add_argument("--bf16", action="store_const", const=True, default=None,
                 help="bf16 on (sets bf16.enabled; fills an 'auto' there)")


def _run_flags(p: argparse.ArgumentParser) -> None:
  """How long, on what data, from which seed, and where the outputs go."""
  p.add_argument("--max_steps", type=int, default=100,
                 help="optimizer steps to run. Default: %(default)s")
  p.add_argument("--seq_len", type=int, default=128,
                 help="tokens per sequence. Default: %(default)s")
  p.add_argument("--train_file", default=None,
                 help="any text file; default: the Python stdlib's sources")
  p.add_argument("--seed", type=int, default=0,
                 help="parameter init and data order. Default: %(default)s")
  p.add_argument("--output_dir", default="./output", help="must be empty or "
                 "new, unless --resume or --overwrite_output_dir. "
                 "Default: %(default)s")
  p.add_argument("--overwrite_output_dir", action="store_true",
                 help="replace the earlier run in --output_dir")
  p.add_argument("--ignore_memory_estimate", action="store_true",
                 help="run even if the step's estimated memory exceeds what "
                 "the devices have")


def _logging_flags(p: argparse.ArgumentParser) -> None:
  """Step lines, the progress bar and the DeepSpeed monitors."""
  p.add_argument("--logging_steps", type=int, default=None,
                 help="print a log line at step 1, every K steps and the last "
                 "(above the progress bar, if any). Default: the JSON's "
                 f"steps_per_print; without either, log lines every "
                 f"{DEFAULT_LOGGING_STEPS} steps only with --no_progress, "
                 f"without tqdm or with stdout not a terminal (> train.log)")
  p.add_argument("--no_progress", action="store_true",
                 help="no progress bar (log lines instead)")
  p.add_argument("--report_to", nargs="+", default=None, metavar="NAME",
                 help="tensorboard, wandb (offline), csv, all (those "
                 "installed) or none: turns "
                 "on the JSON's DeepSpeed monitor section of that name "
                 "(Train/Samples/train_loss, lr, loss_scale per sample "
                 "count). Default: none (metrics.jsonl is always written)")
  p.add_argument("--logging_dir", default=None, help="where --report_to "
                 "tensorboard / csv write (sets the section's output_path; "
                 "job_name ''). Default: OUTPUT_DIR/runs/<time>_<host>, "
                 "the HF Trainer's")


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
  """--save_steps, --save_total_limit, --resume."""
  c = p.add_argument_group("checkpoints (orbax)")
  c.add_argument("--save_steps", type=int, default=0, help="save every K "
                 "optimizer steps (and at the end) to OUTPUT_DIR/checkpoints. "
                 "Default: 0 (no checkpoints)")
  c.add_argument("--save_total_limit", type=int, default=None,
                 help="keep only the newest this many checkpoints (0 or "
                 "less, or unset: keep all, as the HF Trainer)")
  c.add_argument("--resume", default=None, metavar="latest|latest-valid|STEP",
                 help="continue from a checkpoint in OUTPUT_DIR/checkpoints; "
                 "latest-valid falls back past a damaged newest one")


def _multiprocess_flags(p: argparse.ArgumentParser) -> None:
  """The job's processes and how they find each other."""
  g = p.add_argument_group("multi-process (jax.distributed)")
  g.add_argument("--num_processes", type=int, default=None,
                 help="processes in the job; without --process_id, spawns "
                 "them locally on 127.0.0.1 (--num_devices each)")
  g.add_argument("--process_id", type=int, default=None,
                 help="this process's index in the job (0 .. num_processes-1)")
  g.add_argument("--coordinator_address", default=None, help="host:port of "
                 "process 0")
  g.add_argument("--distributed_auto", action="store_true", help="detect the "
                 "process coordinates from the cluster (SLURM, Open MPI, ...)")
  g.add_argument("--heartbeat_timeout", type=int, default=100, help="seconds "
                 "before a silent process makes the others fail. "
                 "Default: %(default)s")


def _typo(p: argparse.ArgumentParser, argv) -> str | None:
  """``--lerning_rate: did you mean --learning_rate?`` for the first flag
  that is neither one of ``p``'s nor an abbreviation argparse accepts, when
  one of its flags is close. argparse suggests nothing for a flag: 3.11-3.13
  never (checked on 3.11.7, 3.12.1, 3.13.0), 3.14's ``suggest_on_error``
  only for a ``choices`` value or a subcommand name."""
  flags = [o for a in p._actions for o in a.option_strings if o.startswith("--")]
  for arg in argv:
    if arg == "--":      # what follows is not a flag
      return None
    name = arg.split("=", 1)[0]
    if (not name.startswith("--") or name in _INSTEAD
        or any(f.startswith(name) for f in flags)):
      continue
    # compared without the dashes: "--" in both would make any short pair close
    close = difflib.get_close_matches(
        name[2:], [f[2:] for f in flags + list(_INSTEAD)], n=1, cutoff=0.7)
    if close and "--" + close[0] in _INSTEAD:   # e.g. --num_gpu: that hint
      return (f"{name} is not a zero1-train flag (nor is --{close[0]}): "
              f"{_INSTEAD['--' + close[0]]}")
    if close:
      return f"unrecognized argument {name}: did you mean --{close[0]}?"
  return None


def parse_args(argv=None) -> argparse.Namespace:
  """The flags, checked (argparse's usage error, exit 2, on a bad one)."""
  p = _parser()
  argv = list(sys.argv[1:] if argv is None else argv)
  typo = _typo(p, argv)
  if typo:   # one line, not the usage (22 lines) that hides it; exit 2 still
    p.exit(2, f"{p.prog}: error: {typo} (zero1-train --help lists the "
           f"flags)\n")
  args, unknown = p.parse_known_args(argv)
  for arg in unknown:
    name = arg.split("=", 1)[0]
    if name in _INSTEAD:
      p.error(f"{name} is not a zero1-train flag: {_INSTEAD[name]}")
  if unknown:
    p.error(f"unrecognized arguments: {' '.join(unknown)}")
  try:
    check(args)
  except UsageError as e:
    p.error(str(e))
  if args.save_total_limit is not None and args.save_total_limit <= 0:
    args.save_total_limit = None     # the HF Trainer's rule: keep all
  return args


def check(args: argparse.Namespace) -> None:
  """UsageError naming the first flag whose value cannot work."""
  at_least = {"max_steps": 1, "logging_steps": 1, "save_steps": 0,
              "seq_len": 1, "num_devices": 1, "num_processes": 1,
              "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1,
              "train_batch_size": 1, "warmup_steps": 0, "heartbeat_timeout": 1,
              "process_id": 0}
  bad = sorted(set(args.report_to or ()) - set(REPORT_TO))
  if bad:
    raise UsageError(f"--report_to {' '.join(bad)}: zero1-train reports to "
                     f"{', '.join(REPORT_TO)} (DeepSpeed's monitors)")
  for name, low in at_least.items():
    value = getattr(args, name)
    if value is not None and value < low:
      what = "0 or more" if low == 0 else f"at least {low}"
      raise UsageError(f"--{name} {value}: must be {what}")


# --report_to names -> DeepSpeed monitor sections ("all": HF's word for every
# integration whose package is installed, transformers 5.x
# integrations/integration_utils.py get_available_reporting_integrations).
REPORT_TO = {"tensorboard": ("tensorboard",), "wandb": ("wandb",),
             "csv": ("csv_monitor",), "all": ("tensorboard", "wandb"),
             "none": ()}
_PACKAGE = {"tensorboard": "tensorboardX", "wandb": "wandb"}


def report_sections(names) -> list[str]:
  """The monitor sections ``--report_to`` turns on, in order, once each.

  >>> report_sections(["tensorboard", "csv", "tensorboard"])
  ['tensorboard', 'csv_monitor']
  """
  import importlib.util
  out: list[str] = []
  for n in names or ():
    out += [s for s in REPORT_TO[n] if s not in out and (
        n != "all" or importlib.util.find_spec(_PACKAGE[s]) is not None)]
  return out


def period_given(args: argparse.Namespace, steps_per_print: int | None) -> bool:
  """Whether a log period was asked for (--logging_steps or the JSON's
  steps_per_print): step lines are printed then even with a progress bar, as
  the HF Trainer prints its logs every logging_steps above its bar."""
  return bool(args.logging_steps or steps_per_print)


def logging_interval(args: argparse.Namespace, steps_per_print: int | None) -> int:
  """--logging_steps, else the DeepSpeed JSON's steps_per_print, else 10."""
  return args.logging_steps or steps_per_print or DEFAULT_LOGGING_STEPS
