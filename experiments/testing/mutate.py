"""Mutation check: plant one plausible bug at a time and show the tests catch it.

Each mutant is a textual replacement in one source file, asserted to match
exactly once (so this script fails loudly when the code it mutates changes).
For each mutant the repository's files (``git ls-files``: tracked and
untracked-but-not-ignored, as they are in the working tree) are copied to a
temporary directory, the replacement is applied there, and the test files
that should catch it run there with ``-x -q``: the copy's ``zero1_jax`` is
imported, never the installed one. A mutant is caught when pytest exits
non-zero.

Usage (from the repository root):
  python -m experiments.testing.mutate                 # all mutants
  python -m experiments.testing.mutate --only NAME ... # some of them
  python -m experiments.testing.mutate --baseline      # also run each selection unmutated
  python -m experiments.testing.mutate --list

Prints a table ``mutant | tests run | caught | seconds`` and exits 1 if any
mutant survives (or a baseline run fails).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  why: str          # the bug, in words
  path: str         # file the replacement applies to
  old: str
  new: str
  tests: tuple[str, ...]   # pytest arguments (files, -k selections)


MUTANTS = [
    Mutant(
        "all_reduce_neighbour_shard",
        "all-reduce path hands each device its neighbour's shard",
        "zero1_jax/core/collectives.py",
        "mine = jax.lax.dynamic_index_in_dim(total, me, axis=0, keepdims=False)",
        "mine = jax.lax.dynamic_index_in_dim(total, (me + 1) % n, axis=0, "
        "keepdims=False)",
        ("tests/test_equivalence.py", "-k", "all_reduce")),
    Mutant(
        "loss_scale_not_divided_out",
        "gradients are divided by N but never by the loss scale",
        "zero1_jax/core/apply.py",
        "denom = (scale * (layout.num_shards if grads_are == LOCAL else 1)\n"
        "           ).astype(jnp.float32)",
        "denom = jnp.asarray(layout.num_shards if grads_are == LOCAL else 1,\n"
        "                    jnp.float32)",
        ("tests/test_precision.py",)),
    Mutant(
        "reduce_scatter_wrong_shard",
        "reduce-scatter flattens the bucket column-major: wrong columns per device",
        "zero1_jax/core/collectives.py",
        "mine = jax.lax.psum_scatter(buf.reshape(-1), axis_name,",
        "mine = jax.lax.psum_scatter(buf.T.reshape(-1), axis_name,",
        ("tests/test_equivalence.py", "-k", "bitwise")),
    Mutant(
        "scalar_grads_not_reduced",
        "replicated (scalar) leaves skip the all-reduce",
        "zero1_jax/core/collectives.py",
        "total = jax.lax.psum(predivide(flat, n) if pre else flat, axis_name)",
        "total = flat",
        ("tests/test_equivalence.py", "-k", "bitwise")),
    Mutant(
        "overflow_step_not_skipped",
        "an overflowing fp16 step still updates master and moments",
        "zero1_jax/core/inner_update.py",
        "    new_view = keep(view, new_view)\n"
        "    new_inner = keep(inner_state, new_inner)\n",
        "    pass\n",
        ("tests/test_precision.py",)),
    Mutant(
        "accumulation_not_averaged",
        "micro-batch gradients are summed, not averaged",
        "zero1_jax/core/local_grads.py",
        "return (loss * scale.astype(loss.dtype) / accum).astype(loss.dtype)",
        "return (loss * scale.astype(loss.dtype)).astype(loss.dtype)",
        ("tests/test_step.py", "-k", "micro")),
    Mutant(
        "clip_coefficient_inverted",
        "clip_by_global_norm scales by 1/(norm * c) instead of c/norm",
        "zero1_jax/core/grad_norm.py",
        "denom * (g_norm / jnp.float32(cfg.max_grad_norm)))",
        "denom * (g_norm * jnp.float32(cfg.max_grad_norm)))",
        ("tests/test_step.py", "-k", "clip")),
    Mutant(
        "deepspeed_clip_without_epsilon",
        "DeepSpeed's clip rule loses its + 1e-6 (becomes optax's)",
        "zero1_jax/core/grad_norm.py",
        "(g_norm + jnp.float32(1e-6))",
        "g_norm",
        ("tests/test_step.py", "-k", "clip")),
    Mutant(
        "gather_sends_stale_shard",
        "the all-gather sends the pre-update master shard",
        "zero1_jax/core/inner_update.py",
        "  return pairs, Zero1State(",
        "  return [(v, u) for v, (_, u) in zip(view, pairs)], Zero1State(",
        ("tests/test_equivalence.py", "-k", "bitwise")),
    Mutant(
        "in_place_reduce_on_wrong_dim",
        "an in-place leaf is reduce-scattered along the dim after its shard dim",
        "zero1_jax/core/collectives.py",
        "scatter_dimension=spec.dim, tiled=True)",
        "scatter_dimension=(spec.dim + 1) % g.ndim, tiled=True)",
        ("tests/test_equivalence.py", "-k", "bitwise and in_place")),
    Mutant(
        "in_place_gather_unpadded_wrongly",
        "an in-place all-gather keeps the padding rows at the front",
        "zero1_jax/core/collectives.py",
        "return jax.lax.slice_in_dim(full, 0, spec.shape[spec.dim], axis=spec.dim)",
        "return jax.lax.slice_in_dim(full, full.shape[spec.dim] - spec.shape[spec.dim], "
        "full.shape[spec.dim], axis=spec.dim)",
        ("tests/test_equivalence.py", "-k", "bitwise and in_place")),
    Mutant(
        "committed_batch_rows_on_wrong_device",
        "a batch committed off the mesh lands one device's rows further on",
        "zero1_jax/core/on_mesh.py",
        "      return jax.device_put(x, self._sharding)",
        "      return jax.device_put(jnp.roll(x, x.shape[0] // "
        "len(self._devices), axis=0), self._sharding)",
        ("tests/test_step.py", "-k", "rows or committed")),
    Mutant(
        "norm_skips_model_axes",
        "2-D mesh: the grad norm sums each block over the data axis only",
        "zero1_jax/core/param_axes.py",
        "    axes = tuple(a for dims in self.leaves[i] for a in dims)",
        "    axes = ()",
        ("tests/test_mesh2d.py",)),
    Mutant(
        "shard_dim_ignores_model_axes",
        "2-D mesh: a block is split over data on a dim the model axis shards",
        "zero1_jax/core/layout.py",
        "  free = [d for d in range(len(shape)) if d not in taken]",
        "  free = list(range(len(shape)))",
        ("tests/test_mesh2d.py",)),
    Mutant(
        "data_axis_major_in_state_spec",
        "2-D mesh: the state's data axis is placed before the model axis",
        "zero1_jax/core/param_axes.py",
        "      dims[spec.dim] = dims[spec.dim] + (self.data_axis,)",
        "      dims[spec.dim] = (self.data_axis,) + dims[spec.dim]",
        ("tests/test_mesh2d.py",)),
    Mutant(
        "ctrl_c_stops_where_it_is_read",
        "multi-process Ctrl-C: a process stops at the step where it publishes",
        "zero1_jax/cli/agreed_stop.py",
        'self.client.key_value_set(f"{PREFIX}/{self.rank}", str(step + 1))',
        'self.client.key_value_set(f"{PREFIX}/{self.rank}", str(step))',
        ("tests/test_agreed_stop.py",)),
]


def repo_files() -> list[str]:
  out = subprocess.run(
      ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
      cwd=ROOT, check=True, capture_output=True).stdout
  return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def copy_repo(dest: pathlib.Path, files: list[str]) -> None:
  for f in files:
    (dest / f).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / f, dest / f)


def check(m: Mutant) -> str:
  """The source text; AssertionError unless ``m.old`` occurs exactly once."""
  text = (ROOT / m.path).read_text()
  count = text.count(m.old)
  assert count == 1, (f"mutant {m.name}: {m.old!r} occurs {count} times in "
                      f"{m.path} (expected once): update experiments/testing/mutate.py")
  return text


def run_tests(where: pathlib.Path, tests: tuple[str, ...], python: str
              ) -> tuple[int, float, str]:
  env = {**os.environ, "PYTHONPATH": str(where)}
  env.pop("ZERO1_TOL_LOG", None)
  # Make sure the copy's package is the one imported.
  probe = subprocess.run(
      [python, "-c", "import zero1_jax; print(zero1_jax.__file__)"],
      cwd=where, env=env, capture_output=True, text=True, check=True)
  assert probe.stdout.strip().startswith(str(where)), probe.stdout
  t = time.perf_counter()
  r = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                      *tests], cwd=where, env=env, capture_output=True, text=True)
  tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-3:])
  return r.returncode, time.perf_counter() - t, tail


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", nargs="+", metavar="NAME")
  ap.add_argument("--baseline", action="store_true",
                  help="first run each test selection on the unmutated copy")
  ap.add_argument("--list", action="store_true")
  ap.add_argument("--python", default=sys.executable)
  ap.add_argument("-v", "--verbose", action="store_true",
                  help="print the last lines of each pytest run")
  args = ap.parse_args(argv)

  mutants = MUTANTS
  if args.only:
    unknown = set(args.only) - {m.name for m in MUTANTS}
    if unknown:
      ap.error(f"unknown mutants {sorted(unknown)}")
    mutants = [m for m in MUTANTS if m.name in args.only]
  if args.list:
    for m in mutants:
      print(f"{m.name:38s} {m.path}: {m.why}")
    return 0
  sources = {m.name: check(m) for m in mutants}   # all match before any runs
  files = repo_files()

  rows, ok = [], True
  with tempfile.TemporaryDirectory(prefix="zero1-mutate-") as tmp:
    if args.baseline:
      base = pathlib.Path(tmp) / "baseline"
      copy_repo(base, files)
      for sel in dict.fromkeys(m.tests for m in mutants):
        rc, secs, tail = run_tests(base, sel, args.python)
        print(f"baseline {' '.join(sel)}: exit {rc} ({secs:.0f} s)", flush=True)
        if rc != 0:
          print(tail)
          ok = False
    for m in mutants:
      where = pathlib.Path(tmp) / m.name
      copy_repo(where, files)
      (where / m.path).write_text(sources[m.name].replace(m.old, m.new))
      rc, secs, tail = run_tests(where, m.tests, args.python)
      # pytest's 1: a test failed. 2 (collection error, e.g. the mutant does
      # not import), 4 or 5 (no tests) would hide a surviving mutant
      caught = rc == 1
      ok &= caught
      verdict = ("yes" if caught else "NO (survived)" if rc == 0
                 else f"ERROR (pytest exit {rc})")
      rows.append((m.name, " ".join(m.tests), verdict, f"{secs:.0f}"))
      print(f"{m.name}: {'caught' if caught else verdict} ({secs:.0f} s)",
            flush=True)
      if args.verbose or not caught:
        print("  " + tail.replace("\n", "\n  "))
      shutil.rmtree(where)

  print()
  print("| mutant | tests run | caught (a test failed) | seconds |")
  print("|---|---|---|---|")
  for r in rows:
    print("| " + " | ".join(r) + " |")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
