"""``zero1-export``: consolidate a zero1 checkpoint's fp32 master weights into
a plain parameter checkpoint (DeepSpeed's ``zero_to_fp32.py``).

  zero1-export --checkpoint_dir runs/ckpt --output_dir runs/fp32 [--step 1000]
  zero1-export runs/ckpt runs/fp32      # positional, as zero_to_fp32.py takes them

The output is an orbax PyTree checkpoint of the parameter tree:
``zero1_jax.checkpoint.load_params(out)`` or
``orbax.checkpoint.StandardCheckpointer().restore(out)`` loads it.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="zero1-export",
      description="Write the consolidated fp32 master weights of a zero1_jax "
                  "checkpoint as a plain orbax parameter checkpoint.")
  p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT_DIR",
                 help="as --checkpoint_dir (DeepSpeed's zero_to_fp32.py order)")
  p.add_argument("output", nargs="?", metavar="OUTPUT_DIR", help="as --output_dir")
  p.add_argument("--checkpoint_dir", default=None,
                 help="directory given to zero1_jax.checkpoint.Checkpointer")
  p.add_argument("--output_dir", default=None,
                 help="new directory for the exported parameters")
  p.add_argument("--step", type=int, default=None,
                 help="step to export (default: the latest committed step)")
  p.add_argument("--tag", default=None,
                 help="as --step, in DeepSpeed's zero_to_fp32.py form: "
                      "global_stepN or N")
  p.add_argument("--overwrite", action="store_true",
                 help="replace --output_dir if it exists")
  return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
  p = _parser()
  args = p.parse_args(argv)
  for name, pos in (("checkpoint_dir", "checkpoint"), ("output_dir", "output")):
    flag, given = getattr(args, name), getattr(args, pos)
    if flag is not None and given is not None and flag != given:
      p.error(f"--{name} {flag} and the positional {given} disagree: give one")
    if flag is None and given is None:
      p.error(f"the {name.replace('_', ' ')} is required: zero1-export "
              "CHECKPOINT_DIR OUTPUT_DIR (or --checkpoint_dir, --output_dir)")
    setattr(args, name, flag if flag is not None else given)
  if args.tag is not None:
    m = re.fullmatch(r"(?:global_step)?(\d+)", args.tag)
    if not m:
      p.error(f"--tag {args.tag}: give a step, as global_stepN or N")
    if args.step is not None and args.step != int(m.group(1)):
      p.error(f"--tag {args.tag} and --step {args.step} disagree: give one")
    args.step = int(m.group(1))
  return args


def main(argv: list[str] | None = None) -> int:
  args = _parse(argv)
  # orbax logs through absl at INFO/WARNING; keep the terminal to one line.
  logging.getLogger("absl").setLevel(logging.ERROR)
  try:
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)
  except ImportError:  # pragma: no cover
    pass
  out = os.path.abspath(os.path.expanduser(args.output_dir))
  if os.path.isdir(out) and os.listdir(out) and not args.overwrite:
    print(f"zero1-export: error: --output_dir {out} already exists and is not "
          f"empty (--overwrite replaces it)", file=sys.stderr)
    return 2
  try:
    from zero1_jax import checkpoint
    step = checkpoint.export_params(args.checkpoint_dir, args.output_dir,
                                    args.step, overwrite=args.overwrite)
  except KeyboardInterrupt:
    print("zero1-export: interrupted", file=sys.stderr)
    return 130
  except Exception as e:  # one line, no traceback: the message says it all
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    bad_input = isinstance(e, (ValueError, OSError))   # as zero1-train: exit 2
    if not bad_input:
      msg = f"{type(e).__name__}: {msg}"
    print(f"zero1-export: error: {msg}", file=sys.stderr)
    return 2 if bad_input else 1
  print(f"zero1-export: wrote the fp32 parameters of step {step} of "
        f"{args.checkpoint_dir} to {args.output_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
