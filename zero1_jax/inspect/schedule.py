"""XLA's latency-hiding schedule of a compiled step: a timeline, and what it costs.

XLA's GPU compiler orders each program with its latency-hiding scheduler
(LHS), which estimates every instruction's time (matmuls from tables, loop
fusions from a roofline, collectives from NCCL tables: its cost model, not a
measurement) and places each async collective's start and done so that
compute runs while it is in flight. ``--xla_dump_latency_hiding_schedule``
writes that timeline as ``<module>.schedule.txt`` (a text proto: the HLO
module, then ``computation_schedules`` with each instruction's
``start_timestamp_cycles`` / ``end_timestamp_cycles``; one cycle is one
microsecond of the model). :func:`read` parses it and :func:`summary` says
what the step costs.

The step's estimate is the last end timestamp of the entry computation: the
scheduler's own makespan. The file's ``scheduler_statistics.total_cycles`` is
not used: on jaxlib 0.10.2 it replays the order *before* scheduling (for
BERT-base data parallelism 13,050 against the schedule's 10,650).
Loop bodies are scheduled apart and count 0.01 in their caller; a summary
of a program with a ``while`` says so (``loops``).

Example:
  >>> text = '''hlo_module {
  ...   computations {
  ...     instructions {
  ...       name: "fusion.1"
  ...       opcode: "fusion"
  ...       metadata {
  ...         op_name: "jit(step)/dot_general"
  ...       }
  ...       id: 1
  ...     }
  ...     instructions {
  ...       name: "all-gather-start"
  ...       opcode: "all-gather-start"
  ...       id: 2
  ...     }
  ...     instructions {
  ...       name: "all-gather-done"
  ...       opcode: "all-gather-done"
  ...       id: 3
  ...     }
  ...     id: 7
  ...   }
  ...   entry_computation_id: 7
  ... }
  ... computation_schedules {
  ...   computation_id: 7
  ...   instructions {
  ...     id: 2
  ...     start_timestamp_cycles: 0
  ...     end_timestamp_cycles: 1
  ...   }
  ...   instructions {
  ...     id: 1
  ...     start_timestamp_cycles: 1
  ...     end_timestamp_cycles: 31
  ...   }
  ...   instructions {
  ...     id: 3
  ...     start_timestamp_cycles: 50
  ...     end_timestamp_cycles: 51
  ...   }
  ... }'''
  >>> s = summary(parse(text))
  >>> s.step_us, s.compute_us, s.exposed_us
  (51.0, 30.0, 21.0)
  >>> s.collectives[0].kind, s.collectives[0].start, s.collectives[0].end
  ('all-gather', 0.0, 51.0)
"""

from __future__ import annotations

import glob
import os
import re
from typing import NamedTuple

from zero1_jax.inspect.hlo_graph import COLLECTIVES

_COMPUTATION = re.compile(r"^  computations \{$", re.M)
_INSTR = re.compile(
    r'^    instructions \{\n      name: "(?P<name>[^"]+)"\n      opcode: "(?P<op>[^"]+)"'
    r'(?P<body>.*?)\n      id: (?P<id>\d+)\n', re.S | re.M)
_OP_NAME = re.compile(r'\n      metadata \{\n(?:        [^\n]*\n)*?        op_name: "([^"]*)"')
_CALLS = re.compile(r"^    id: (\d+)$", re.M)
_ENTRY = re.compile(r"^  entry_computation_id: (\d+)$", re.M)
_BLOCK = re.compile(r"^computation_schedules \{\n  computation_id: (\d+)\n(.*?)^\}", re.S | re.M)
_SCHED = re.compile(r"  instructions \{\n    id: (\d+)\n(.*?)\n  \}", re.S)
_START = re.compile(r"start_timestamp_cycles: ([-0-9.e+]+)")
_END = re.compile(r"end_timestamp_cycles: ([-0-9.e+]+)")
# Not compute: bookkeeping, aliasing and the async pairs themselves.
_NOT_COMPUTE = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast",
    "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency"})


class Op(NamedTuple):
  """One scheduled instruction of the entry computation."""
  name: str
  opcode: str
  op_name: str    # the JAX op it came from (metadata), '' if none
  start: float    # microseconds of XLA's cost model
  end: float


class Schedule(NamedTuple):
  """The entry computation's timeline, in program order."""
  ops: tuple[Op, ...]
  loops: tuple[str, ...]   # names of `while` ops (their bodies are not in `ops`)


class Window(NamedTuple):
  """One async collective: from its start op to its done op."""
  name: str         # the -start op
  kind: str         # 'reduce-scatter', 'all-gather', ...
  start: float
  end: float
  overlapped: float  # microseconds of the window during which compute ran


class Summary(NamedTuple):
  step_us: float       # the last end timestamp: XLA's estimate of one step
  compute_us: float    # time during which some compute op runs
  exposed_us: float    # time a collective is in flight and no compute runs
  exposed_by_kind: dict[str, float]
  collectives: tuple[Window, ...]
  loops: tuple[str, ...]


def parse(text: str) -> Schedule:
  """The entry computation's schedule from a ``*.schedule.txt`` text."""
  module, _, schedules = text.partition("\ncomputation_schedules {")
  schedules = "computation_schedules {" + schedules
  entry = int(_ENTRY.search(module).group(1))
  info = {}
  for m in _INSTR.finditer(module):
    op_name = _OP_NAME.search(m.group("body"))
    info[int(m.group("id"))] = (m.group("name"), m.group("op"),
                                op_name.group(1) if op_name else "")
  ops, loops = [], []
  for block in _BLOCK.finditer(schedules):
    if int(block.group(1)) != entry:
      continue
    for m in _SCHED.finditer(block.group(2)):
      name, opcode, op_name = info.get(int(m.group(1)), ("?", "?", ""))
      start, end = _START.search(m.group(2)), _END.search(m.group(2))
      if end is None:
        continue
      end = float(end.group(1))
      ops.append(Op(name, opcode, op_name,
                    float(start.group(1)) if start else end, end))
      if opcode == "while":
        loops.append(name)
    break   # a rerun under memory pressure appends another block: the first is kept
  if not ops:
    raise ValueError("no schedule of the entry computation in this file")
  return Schedule(tuple(ops), tuple(loops))


def read(path: str) -> Schedule:
  """:func:`parse` of a file, or of the only ``*.schedule.txt`` in a directory."""
  if os.path.isdir(path):
    found = sorted(glob.glob(os.path.join(path, "*.schedule.txt")))
    found = [f for f in found if "-clone" not in f] or found
    if len(found) != 1:
      raise ValueError(f"expected one *.schedule.txt in {path}, found {found}")
    path = found[0]
  with open(path) as f:
    return parse(f.read())


def collective_kind(opcode: str, name: str) -> str | None:
  """``'all-gather'`` for ``all-gather-start`` (or an ``async-start`` named
  ``reduce-scatter-start.3``); None for anything else."""
  for k in COLLECTIVES:
    if opcode in (f"{k}-start", f"{k}-done") or (
        opcode.startswith("async-") and name.startswith(k)):
      return k
  return None


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
  out: list[list[float]] = []
  for s, e in sorted(intervals):
    if out and s <= out[-1][1]:
      out[-1][1] = max(out[-1][1], e)
    else:
      out.append([s, e])
  return [(s, e) for s, e in out]


def _covered(a: float, b: float, busy: list[tuple[float, float]]) -> float:
  return sum(max(0.0, min(b, e) - max(a, s)) for s, e in busy)


def is_compute(op: Op) -> bool:
  return (op.end > op.start and op.opcode not in _NOT_COMPUTE
          and collective_kind(op.opcode, op.name) is None)


def summary(schedule: Schedule) -> Summary:
  """Step estimate, compute time, and the collectives' windows and exposure."""
  busy = _union([(o.start, o.end) for o in schedule.ops if is_compute(o)])
  starts: dict[str, tuple[str, float]] = {}
  windows = []
  for o in schedule.ops:
    kind = collective_kind(o.opcode, o.name)
    if kind is None:
      continue
    if o.opcode.endswith("-start"):
      starts[o.name.replace("-start", "", 1)] = (o.name, o.start)
    elif o.opcode.endswith("-done"):
      name, s = starts.pop(o.name.replace("-done", "", 1), (o.name, o.start))
      windows.append(Window(name, kind, s, o.end, _covered(s, o.end, busy)))
  exposed_by_kind: dict[str, float] = {}
  for kind in sorted({w.kind for w in windows}):
    spans = _union([(w.start, w.end) for w in windows if w.kind == kind])
    exposed_by_kind[kind] = sum(e - s - _covered(s, e, busy) for s, e in spans)
  spans = _union([(w.start, w.end) for w in windows])
  exposed = sum(e - s - _covered(s, e, busy) for s, e in spans)
  return Summary(max(o.end for o in schedule.ops), sum(e - s for s, e in busy),
                 exposed, exposed_by_kind, tuple(windows), schedule.loops)
