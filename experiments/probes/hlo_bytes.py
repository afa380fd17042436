"""Bytes a compiled step writes, read from its optimized HLO text.

Every instruction of the ENTRY computation that produces a buffer (a fusion,
a collective, a copy, a dot, a concatenate ...) writes its output once per
step; parameters, constants, tuples, get-tuple-elements and bitcasts write
nothing. The bodies of while loops (gradient accumulation) are counted once
per loop, not per trip. Fusion internals stay in registers/cache and are not
counted: this is what the step writes to memory, the measure that bucket
copies, padded copies and unpacking slices inflate.

Example::

    c = jax.jit(f).lower(x).compile()
    written(c.as_text()).total          # bytes per step, per device
"""
from __future__ import annotations

import re
from typing import NamedTuple

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
             "c128": 16}
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
         "after-all", "partition-id", "replica-id", "iota"}
_CALLS = re.compile(r"body=%?([\w.\-]+)")


class Written(NamedTuple):
  total: int                   # bytes written per step (one device)
  by_op: dict[str, int]        # the same, per HLO opcode (fusions by kind name)
  large: list[tuple[str, str, int]]   # (name, op, bytes) of the biggest writes


def _bytes(shape: str) -> int:
  total = 0
  for dt, dims in _ARRAY.findall(shape):
    size = 1
    for d in dims.split(","):
      if d:
        size *= int(d)
    total += size * _ITEMSIZE.get(dt, 4)
  return total


def _split_shape(rest: str) -> tuple[str, str]:
  """``'(f32[2], s32[]) all-reduce(...'`` -> (shape text, opcode)."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        shape, tail = rest[:i + 1], rest[i + 1:]
        break
  else:
    shape, _, tail = rest.partition(" ")
  op = tail.strip().split("(", 1)[0].strip()
  return shape, op


def _computations(hlo: str) -> dict[str, list[str]]:
  comps, name, body = {}, None, []
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      name = "ENTRY" if line.startswith("ENTRY") else name
      body = []
    elif line.startswith("}"):
      if name is not None:
        comps[name] = body
      name = None
    elif name is not None:
      body.append(line)
  return comps


def written(hlo_text: str, top: int = 8) -> Written:
  """What the ENTRY computation (and the bodies of its while loops) writes."""
  comps = _computations(hlo_text)
  todo, seen, rows = ["ENTRY"], set(), []
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for line in comps[c]:
      m = _HEAD.match(line)
      if not m:
        continue
      shape, op = _split_shape(line[m.end():])
      if op == "while":
        todo += _CALLS.findall(line)
      if op in _FREE or op == "while":
        continue
      kind = op
      if op == "fusion":
        kind = "fusion:" + m.group(1).rsplit(".", 1)[0]
      rows.append((m.group(1), kind, _bytes(shape)))
  by_op: dict[str, int] = {}
  for _, kind, b in rows:
    key = kind.split(":")[0] if not kind.startswith("fusion") else kind
    by_op[key] = by_op.get(key, 0) + b
  rows.sort(key=lambda r: -r[2])
  return Written(sum(r[2] for r in rows), by_op, rows[:top])
