"""Why a compiled peak differs: live bytes at the peak vs heap fragmentation.

``memory_analysis()`` reports the memory XLA allocates, which is the bytes
live at the worst point of the schedule *plus* what allocation adds: the
gaps its heap packing leaves, and buffers kept apart (outputs, constants). Issue #10 compares ZeRO-1's compiled peak with
GSPMD's; this script separates the two parts for one model and N, from XLA's
own dumps of the compiled step (each method compiled in a subprocess with
``--xla_dump_to``):

* ``heap``: ``Total bytes`` of the memory-usage report (= argument + output -
  alias + temp of ``memory_analysis``, within a few KB);
* ``live at peak``: the memory the values XLA's live-range analysis lists at
  its peak instruction occupy (placed by the buffer assignment; a value that
  an in-place fusion writes over its operand's buffer is counted once);
* the buffers of at least ``--min_kb`` KiB live at the peak, each with its
  HLO op, where the two methods differ.

Run: ``python -m experiments.probes.peak_breakdown [--size s] [--n 8]
[--dtypes fp32 bf16] [--out FILE]`` (a markdown report).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

# zero1_in_place: zero1_rs with inplace_bytes=64 KiB (the GPU/TPU default):
# the same program but for the bucket copies, so what differs from zero1_rs
# is what the packing costs.
METHODS = ("zero1_rs", "zero1_in_place", "gspmd")
IN_PLACE_BYTES = 1 << 16
ARGUMENT = "(argument)"


def _compile_and_dump(method: str, size: str, dtype: str, n: int, dump: str) -> None:
  """In this (fresh) process: compile ``method``'s step with the dump on."""
  del dump   # XLA_FLAGS (set by the parent) already says where
  from experiments.bench import plan as bs
  m = bs.model(size, dtype, 64)
  b = bs.device_batch(bs.batch(2 * n, 64), n)
  if method == "zero1_in_place":
    bs._build("zero1_rs", m, n, b, bs.DEFAULT_BUCKET, IN_PLACE_BYTES)
  else:
    bs._build(method, m, n, b, bs.DEFAULT_BUCKET, bs.DEFAULT_INPLACE)


def _files(dump: str) -> tuple[str, str, str]:
  def one(suffix):
    hits = sorted(glob.glob(os.path.join(dump, f"*jit_step*{suffix}")))
    if not hits:
      raise SystemExit(f"peak_breakdown: no *jit_step*{suffix} in {dump}: this "
                       f"XLA does not write that dump")
    return hits[-1]
  return (one("cpu_after_optimizations-memory-usage-report.txt"),
          one("cpu_after_optimizations-live-range.txt"),
          one("cpu_after_optimizations.txt"),
          one("cpu_after_optimizations-buffer-assignment.txt"))


def placement(assignment: str) -> dict[str, tuple[int, int, int]]:
  """HLO value (``name{index}``) -> (allocation, offset, size) it occupies."""
  out, alloc = {}, -1
  for line in assignment.splitlines():
    m = re.match(r"allocation (\d+):", line)
    if m:
      alloc = int(m.group(1))
      continue
    m = re.match(r" value: <\d+ ([\w.\-]+)(\{[^}]*\})? @\d+> "
                 r"\(size=(\d+),offset=(\d+)\)", line)
    if m:
      out[m.group(1) + (m.group(2) or "{}")] = (alloc, int(m.group(4)),
                                                int(m.group(3)))
  return out


def distinct_bytes(values: list[str], placement: dict) -> int:
  """Bytes of memory the values occupy, counting once what several share
  (an in-place fusion writes its output over an operand's buffer)."""
  spans = collections.defaultdict(list)
  for v in values:
    alloc, off, size = placement[v]
    spans[alloc].append((off, off + size))
  total = 0
  for ivs in spans.values():
    end = -1
    for a, b in sorted(ivs):
      total += max(0, b - max(a, end))
      end = max(end, b)
  return total


def temp_live_at_peak(dump: str, temp_bytes: int | None = None) -> int:
  """The most bytes of XLA's temp heap that values live at one point of the
  schedule occupy (shared buffers counted once), from the dump of one
  compiled module in ``dump``: with ``memory_analysis()``'s argument +
  output - alias, what the step holds at its peak; its temp size less this
  is what the heap's packing leaves unused. (The live-range dump's own
  "peak" counts an argument only until its last read, though its buffer
  stays allocated.) ``temp_bytes``: the temp size ``memory_analysis()``
  reports for the compile; a dump whose temp heap differs is another
  compile's, and raises."""
  def one(suffix):
    hits = [f for f in glob.glob(os.path.join(dump, f"*after_optimizations-{suffix}"))
            if "-clone" not in f]
    if len(hits) != 1:
      raise ValueError(f"expected one *{suffix} in {dump}, found {hits}")
    return open(hits[0]).read()
  live, assignment = one("live-range.txt"), one("buffer-assignment.txt")
  temp = {int(a): int(b) for a, b in re.findall(
      r"^allocation (\d+): size (\d+), [^\n]*preallocated-temp", assignment, re.M)}
  if temp_bytes is not None and sum(temp.values()) != temp_bytes:
    raise ValueError(f"the dump in {dump} has a temp heap of {sum(temp.values())} B, "
                     f"the compile {temp_bytes} B: another compile's dump")
  where = placement(assignment)
  block = live[live.index("BufferLiveRange:"):]
  spans = [(int(a), int(b), v) for v, a, b in re.findall(
      r"^\s+([\w.\-]+\{[^}]*\}):(\d+)-(\d+)$", block, re.M)
      if where.get(v, (None,))[0] in temp]
  # the bytes live change only where a value starts: the most is at a start
  return max((distinct_bytes([v for a, b, v in spans if a <= t <= b], where)
              for t in sorted({a for a, _, _ in spans})), default=0)


def _op_names(hlo: str) -> dict[str, str]:
  """HLO instruction -> the jax op that made it (its metadata op_name)."""
  out = {}
  for m in re.finditer(r"%([\w.\-]+) = [^\n]*?op_name=\"([^\"]+)\"", hlo):
    out[m.group(1)] = m.group(2)
  for m in re.finditer(r"%([\w.\-]+) = [^\n=]*? parameter\(\d+\)", hlo):
    out[m.group(1)] = ARGUMENT
  # XLA's copy insertion may copy an argument that is read after its donated
  # buffer is written (no metadata): the copy holds the argument's bytes.
  for m in re.finditer(r"%([\w.\-]+) = [^\n=]*? copy\(%([\w.\-]+)\)\n", hlo):
    if out.get(m.group(2)) == ARGUMENT and m.group(1) not in out:
      out[m.group(1)] = ARGUMENT
  return out


def parse(dump: str) -> dict:
  report, live, hlo, assignment = (open(p).read() for p in _files(dump))
  heap = int(re.search(r"Total bytes: (\d+)", report).group(1))
  block = live[live.index("(peak):"):]
  block = block[:block.index("Stack trace")] if "Stack trace" in block else block
  vals = re.findall(r"^\s+([\w.\-]+)(\{[^}]*\}): (\d+) bytes", block, re.M)
  names = _op_names(hlo)
  return dict(heap=heap,
              live=distinct_bytes([n + i for n, i, _ in vals], placement(assignment)),
              buffers=[(n, int(b), _label(n, names)) for n, _, b in vals])


def _label(name: str, names: dict[str, str]) -> str:
  """What made buffer ``name``: "(argument)" for the step's inputs, else the
  jax op (without the jit/shard_map prefix the two methods differ by)."""
  if names.get(name) == ARGUMENT:
    return ARGUMENT
  return re.sub(r"^jit\(step\)/(shard_map/)?", "", names.get(name, "?"))


def measure(size: str, dtype: str, n: int) -> dict[str, dict]:
  out = {}
  for method in METHODS:
    with tempfile.TemporaryDirectory() as dump:
      env = {**os.environ, "XLA_FLAGS": (
          f"--xla_force_host_platform_device_count={n} --xla_dump_to={dump} "
          f"--xla_dump_hlo_module_re=.*jit_step.* --xla_dump_hlo_as_text")}
      subprocess.run([sys.executable, "-m", "experiments.probes.peak_breakdown",
                      "--_child", json.dumps([method, size, dtype, n, dump])],
                     env=env, check=True)
      out[method] = parse(dump)
  return out


def report(size: str, n: int, dtypes: list[str], min_kb: float) -> str:
  lines = [f"### Compiled peak of the step: live bytes vs heap (model `{size}`, "
           f"N={n}, `python -m experiments.probes.peak_breakdown`)", "",
           "heap = what `memory_analysis()` reports (argument + output - alias "
           "+ temp); live at peak = the memory occupied by the values XLA's "
           "live-range analysis lists at its peak instruction (shared buffers "
           "counted once); heap - live = what allocation adds on top: the "
           "gaps heap packing leaves, and buffers kept apart from the heap "
           "(outputs, constants).", "",
           "| dtype | method | heap B | live at peak B | heap - live B |",
           "|---|---|---|---|---|"]
  diffs = []
  for dtype in dtypes:
    got = measure(size, dtype, n)
    for method, r in got.items():
      lines.append(f"| {dtype} | {method} | {r['heap']:,} | {r['live']:,} | "
                   f"{r['heap'] - r['live']:,} |")
    big = {m: collections.Counter((s, op) for _, s, op in got[m]["buffers"]
                                  if s >= min_kb * 1024) for m in METHODS}
    for m in METHODS[:-1]:     # each ZeRO-1 form against GSPMD
      a, b = big[m], big[METHODS[-1]]
      for (s, op), k in sorted(((a - b) + (b - a)).items(),
                               key=lambda t: -t[0][0]):
        who = m if (s, op) in (a - b) else METHODS[-1]
        diffs.append(f"| {dtype} | {m} vs {METHODS[-1]} | {who} only | "
                     f"{s:,} x {k} | `{op}` |")
  lines += ["", f"Buffers of at least {min_kb:g} KiB live at the peak in one "
            f"method and not the other (matched by size and op):", "",
            "| dtype | pair | where | bytes x count | made by |",
            "|---|---|---|---|---|"]
  lines += diffs or ["| - | - | - | - | - |"]
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size", default="s")
  p.add_argument("--n", type=int, default=8)
  p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
  p.add_argument("--min_kb", type=float, default=64)
  p.add_argument("--out")
  p.add_argument("--_child", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a._child:
    _compile_and_dump(*json.loads(a._child))
    return
  text = report(a.size, a.n, a.dtypes, a.min_kb)
  print(text)
  if a.out:
    with open(a.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
