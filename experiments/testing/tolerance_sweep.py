"""Run the numerical tests under other XLA:CPU code generation and record the
worst error each tolerance saw (docs/tolerances.md).

XLA:CPU's code depends on the CPU it compiles for (vector width, FMA
contraction, fusion), so the same test rounds differently on another
machine. This runs the numerical test files once per target:

- ``native``: this CPU as it is;
- ``AVX2`` / ``AVX``: ``--xla_cpu_max_isa=...``, the code an older or an AMD
  CPU gets (256-bit vectors; AVX has no FMA);
- ``fast_math``: ``--xla_cpu_enable_fast_math=true``, reassociation and
  approximate transcendental functions that a user's XLA_FLAGS may turn on.

(``SSE4_2`` cannot compile fp16 conversions on jaxlib 0.10.2: "Symbols not
found: [ __extendhfsf2 ]", so it is left out.)

Each assert_close / assert_ulps call logs (test, what, bound, measured) when
ZERO1_TOL_LOG is set (tests/helpers.py); this collects the logs and writes
one row per bound site with the worst measured value per target.

  python -m experiments.testing.tolerance_sweep --out docs/tolerances.md
  python -m experiments.testing.tolerance_sweep --targets AVX2,fast_math \
      --recorded native=/tmp/native.tsv     # native from a `make test` log
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile

FILES = [
    "tests/test_equivalence.py", "tests/test_precision.py", "tests/test_step.py",
    "tests/test_step_errors.py",
    "tests/test_jit_mode.py", "tests/test_zero2.py", "tests/test_mesh2d.py",
    "tests/test_flax.py", "tests/test_inner_state.py", "tests/test_checkpoint.py",
    "tests/test_engine.py", "tests/test_elementwise.py", "tests/test_config_optim.py",
    "tests/test_ds_parity.py", "tests/test_fp32_master.py",
]
TARGETS = {
    "native": "",
    "AVX2": "--xla_cpu_max_isa=AVX2",
    "AVX": "--xla_cpu_max_isa=AVX",
    "fast_math": "--xla_cpu_enable_fast_math=true",
}


def run_target(name: str, flag: str, files: list[str]) -> tuple[str, str]:
  """Runs the files under one target; returns (pytest's last line, log path)."""
  log = tempfile.mktemp(prefix=f"tol_{name}_", suffix=".tsv")
  env = {**os.environ, "ZERO1_TOL_LOG": log, "XLA_FLAGS": flag}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)   # each target compiles afresh
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "-m", "not slow", *files], env=env, capture_output=True, text=True)
  lines = [l for l in proc.stdout.splitlines() if l.strip()]
  failed = [l for l in lines if l.startswith("FAILED")]
  return "\n".join(failed + lines[-1:]), log


def site(test: str) -> str:
  """A bound site: the test function without its parameters."""
  return re.sub(r"\[.*\]$", "", test)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="docs/tolerances.md")
  ap.add_argument("--targets", default=",".join(TARGETS))
  ap.add_argument("--recorded", action="append", default=[], metavar="NAME=LOG",
                  help="a ZERO1_TOL_LOG written by another run (e.g. "
                       "native=log of `ZERO1_TOL_LOG=log make test`)")
  ap.add_argument("files", nargs="*", default=FILES)
  a = ap.parse_args(argv)
  worst = collections.defaultdict(dict)     # (site, what, bound) -> target -> err
  summary = {}
  logs = []
  for item in a.recorded:
    name, log = item.split("=", 1)
    summary[name] = f"recorded from another run ({os.path.basename(log)})"
    logs.append((name, log, False))
  for name in a.targets.split(","):
    print(f"== {name}", flush=True)
    summary[name], log = run_target(name, TARGETS[name], a.files)
    print(summary[name], flush=True)
    logs.append((name, log, True))
  for name, log, remove in logs:
    if not os.path.exists(log):
      continue
    for row in open(log):
      test, what, bound, err = row.rstrip("\n").split("\t")
      what = re.sub(r"N=\d+|\d+->\d+", "N", what).strip()
      key = (site(test), what, float(bound))
      worst[key][name] = max(worst[key].get(name, 0.0), float(err))
    if remove:
      os.remove(log)
  names = list(summary)
  out = [
      "# Tolerances and the worst error each saw on other CPU code",
      "",
      "Each row is one bound in the tests (`assert_close`: per leaf, max |error| "
      "over max |leaf|; `(ulps)`: units in the last place), the worst error it "
      "measured under each XLA:CPU target, and the ratio of bound to worst. The "
      "reason for each bound is written beside it in the test or in "
      "`tests/tolerances.py`.",
      "",
      f"Command: `python -m experiments.testing.tolerance_sweep`; "
      f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} cores, jax {_jax_version()}.",
      "",
      "| test | what | bound | " + " | ".join(names) + " | headroom |",
      "|---|---|---|" + "---|" * len(names) + "---|",
  ]
  for (test, what, bound), errs in sorted(worst.items()):
    top = max(errs.values(), default=0.0)
    room = "inf" if top == 0 else f"{bound / top:.1f}x"
    cells = [f"{errs[n]:.2g}" if n in errs else "-" for n in names]
    out.append(f"| `{test.split('::')[-1]}` | {what} | {bound:g} | "
               + " | ".join(cells) + f" | {room} |")
  out += ["", "Test outcomes per target (pytest's summary):", ""]
  for n in names:
    out.append(f"- {n} (`XLA_FLAGS={TARGETS.get(n, '')}`): "
               + summary[n].replace("\n", "; "))
  with open(a.out, "w") as f:
    f.write("\n".join(out) + "\n")
  print(f"wrote {a.out}")


def _jax_version() -> str:
  import jax
  return jax.__version__


if __name__ == "__main__":
  main()
