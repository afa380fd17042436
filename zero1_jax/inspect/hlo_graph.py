"""HLO text as a graph: computations, instructions, operands, shapes, sizes.

Reads the text of an optimized module (``compiled.as_text()``): each
computation is a list of instructions ``[ROOT] %name = SHAPE opcode(operands),
attributes``; an operand is a ``%name`` of the same computation (the text may
print its shape before it), and ``control-predecessors={...}`` are edges too.
Async pairs (``all-reduce-start`` / ``-done``, ``async-start`` / ``-update`` /
``-done``) are joined into one node by :func:`dependencies`.

Example:
  >>> m = parse('''ENTRY %main (p: f32[4]) -> f32[4] {
  ...   %p = f32[4]{0} parameter(0)
  ...   %e = f32[4]{0} exponential(%p)
  ...   ROOT %s = f32[4]{0} add(%p, %e)
  ... }''')
  >>> m.entry, [(i.name, i.operands) for i in m.computations[m.entry]]
  ('main', [('p', ()), ('e', ('p',)), ('s', ('p', 'e'))])
  >>> shape_bytes(m.computations["main"][2].shape)
  16
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

ITEMSIZE = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1,
            "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
            "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
            "c128": 16}
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
               "collective-permute")   # opcodes (async forms add -start/-done)
_SHAPE = re.compile(r"([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-_.]*)\(")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|"
                     r"true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)")
_CONTROL = re.compile(r"control-predecessors=\{([^}]*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_OPEN, _CLOSE = "([{", ")]}"
_OUTPUT = re.compile(r"#\d+$")


class Instruction(NamedTuple):
  name: str                    # without the leading '%'
  opcode: str                  # 'fusion', 'dot', 'all-reduce-start', ...
  shape: str                   # the output shape text, e.g. 'f32[8,16]{1,0}'
  operands: tuple[str, ...]    # names of operands in this computation, in order
  control: tuple[str, ...]     # names of control predecessors
  called: tuple[str, ...]      # computations it calls (calls=, body=, to_apply=, ...)
  attrs: str                   # everything after the operand list


class Module(NamedTuple):
  computations: dict[str, tuple[Instruction, ...]]   # name -> instructions, text order
  entry: str                                         # name of the ENTRY computation


def _match(text: str, start: int) -> int:
  """Index just past the bracket that closes the one at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in _OPEN:
      depth += 1
    elif text[i] in _CLOSE:
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced brackets in HLO line: {text!r}")


def _split_top(text: str) -> list[str]:
  """``text`` split at commas outside brackets."""
  parts, depth, cut = [], 0, 0
  for i, ch in enumerate(text):
    if ch in _OPEN:
      depth += 1
    elif ch in _CLOSE:
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(text[cut:i])
      cut = i + 1
  parts.append(text[cut:])
  return [p.strip() for p in parts if p.strip()]


_COMMENT = re.compile(r"/\*.*?\*/")


def _names(text: str) -> list[str]:
  # XLA marks every 5th operand with a comment, glued to its name:
  # ``concatenate(%a, %b, %c, %d, %e, /*index=5*/%f)``; jax 0.12's XLA names
  # one output of a multi-output instruction ``%a#0`` (its dumps mid-pipeline).
  return [_OUTPUT.sub("", p.split()[-1].lstrip("%"))
          for p in _split_top(_COMMENT.sub(" ", text))]


def _instruction(name: str, rest: str) -> Instruction | None:
  rest = rest.strip()
  cut = _match(rest, 0) if rest.startswith("(") else len(rest.split()[0])
  shape, tail = rest[:cut], rest[cut:]
  m = _OPCODE.match(tail)
  if not m:
    return None
  open_at = m.end() - 1
  close_at = _match(tail, open_at)
  operands, attrs = tail[open_at + 1:close_at - 1], tail[close_at:]
  called = []
  for c in _CALLED.findall(attrs):
    called += _names(c.strip("{}")) if c.startswith("{") else [c.lstrip("%")]
  control = _CONTROL.search(attrs)
  return Instruction(name, m.group(1), shape, tuple(_names(operands)),
                     tuple(_names(control.group(1))) if control else (),
                     tuple(called), attrs)


def parse(hlo_text: str) -> Module:
  """Computations of an HLO module's text; operands that name no instruction
  of the same computation (literals) are dropped."""
  comps: dict[str, tuple[Instruction, ...]] = {}
  entry, current, body = "", None, []
  for line in hlo_text.splitlines():
    if current is None:
      h = _HEADER.match(line) if line.rstrip().endswith("{") else None
      if h and not line.startswith((" ", "\t")) and " = " not in line.split("(")[0]:
        current, body = h.group(2), []
        if h.group(1):
          entry = current
      continue
    if line.strip() == "}":
      names = {i.name for i in body}
      comps[current] = tuple(
          i._replace(operands=tuple(o for o in i.operands if o in names),
                     control=tuple(o for o in i.control if o in names))
          for i in body)
      current = None
      continue
    m = _INSTR.match(line)
    if m:
      instr = _instruction(m.group(2).lstrip("%"), m.group(3))
      if instr is not None:
        body.append(instr)
  if not entry:
    raise ValueError("no ENTRY computation in this HLO text: pass the text of a "
                     "whole module, e.g. jitted.lower(*args).compile().as_text()")
  return Module(comps, entry)


# -- shapes and sizes ---------------------------------------------------------

def shape_dims(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """``[(dtype, dims), ...]`` of every array in a shape text (tuples flattened)."""
  return [(dt, tuple(int(d) for d in dims.split(",") if d))
          for dt, dims in _SHAPE.findall(shape)]


def shape_bytes(shape: str) -> int:
  """Bytes of every array in a shape text (tuples summed; unknown dtypes 4)."""
  return sum(math.prod(d) * ITEMSIZE.get(dt, 4) for dt, d in shape_dims(shape))


def last_tuple_element(shape: str) -> str:
  """The last top-level element of a tuple shape ``(a, (b, c))``."""
  parts = _split_top(shape.strip()[1:-1])
  return parts[-1] if parts else shape


def group_size(attrs: str) -> int:
  """Devices in one replica group of a collective (1 if none is printed)."""
  m = _GROUPS_LIST.search(attrs)
  if m:
    return len([x for x in m.group(1).split(",") if x])
  m = _GROUPS_IOTA.search(attrs)
  if m:
    return int(m.group(2))
  m = _GROUPS_MESH.search(attrs)   # mesh['a'=4,'b'=2] {'a'}: the named axes
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
  return 1


# -- dependencies -------------------------------------------------------------

class Dependencies(NamedTuple):
  nodes: list[list[int]]   # node -> indices (text order) of the instructions it joins
  node_of: list[int]       # instruction index -> its node
  ancestors: list[int]     # node -> bitset of the nodes it transitively depends on
  descendants: list[int]   # node -> bitset of the nodes that transitively depend on it


def _async_parent(instr: Instruction, index: dict[str, int],
                  instrs: tuple[Instruction, ...]) -> int | None:
  """The ``-start`` an ``-update``/``-done`` instruction completes, if any."""
  if not instr.opcode.endswith(("-done", "-update")) or not instr.operands:
    return None
  j = index[instr.operands[0]]
  if instrs[j].opcode.endswith(("-start", "-update")):
    return j
  return None


def dependencies(instrs: tuple[Instruction, ...]) -> Dependencies:
  """Ancestors and descendants of every node of one computation, where a
  ``-start`` and the ``-update``/``-done`` that complete it are one node."""
  index = {i.name: k for k, i in enumerate(instrs)}
  node_of: list[int] = []
  nodes: list[list[int]] = []
  for k, instr in enumerate(instrs):
    parent = _async_parent(instr, index, instrs)
    if parent is None:
      node_of.append(len(nodes))
      nodes.append([k])
    else:
      node_of.append(node_of[parent])
      nodes[node_of[parent]].append(k)
  preds: list[set[int]] = [set() for _ in nodes]
  for k, instr in enumerate(instrs):
    for o in instr.operands + instr.control:
      if node_of[index[o]] != node_of[k]:
        preds[node_of[k]].add(node_of[index[o]])
  order = _topological(preds)
  anc = [0] * len(nodes)
  for n in order:
    for p in preds[n]:
      anc[n] |= anc[p] | (1 << p)
  succs: list[set[int]] = [set() for _ in nodes]
  for n, ps in enumerate(preds):
    for p in ps:
      succs[p].add(n)
  desc = [0] * len(nodes)
  for n in reversed(order):
    for s in succs[n]:
      desc[n] |= desc[s] | (1 << s)
  return Dependencies(nodes, node_of, anc, desc)


def _topological(preds: list[set[int]]) -> list[int]:
  waiting = [len(p) for p in preds]
  succs: list[list[int]] = [[] for _ in preds]
  for n, ps in enumerate(preds):
    for p in ps:
      succs[p].append(n)
  ready = [n for n, w in enumerate(waiting) if w == 0]
  order = []
  while ready:
    n = ready.pop()
    order.append(n)
    for s in succs[n]:
      waiting[s] -= 1
      if waiting[s] == 0:
        ready.append(s)
  if len(order) != len(preds):
    raise ValueError("the HLO computation has a dependency cycle")
  return order
