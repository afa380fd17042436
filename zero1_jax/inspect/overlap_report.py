"""What each collective of a compiled step can be hidden behind.

For every collective of the optimized HLO, the compute that neither feeds it
(is not an ancestor) nor waits for it (is not a descendant): the work a
latency-hiding scheduler may run while that collective is in flight. Read
from the dataflow alone, so it needs no GPU: a collective with no independent
compute is exposed on any backend, one with plenty can be hidden if the
scheduler does so (a profile says whether it did).

Example:
  >>> import jax, jax.numpy as jnp
  >>> [r.kind for r in overlap(jax.jit(lambda x: jnp.sin(x) * 2), jnp.ones(4))]
  []
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple

from zero1_jax.inspect import hlo_graph
from zero1_jax.inspect.hlo_graph import Instruction, Module

# Bookkeeping, aliasing and copies: never counted as compute. Everything else
# is (fusion, dot, convolution, custom-call, while, call, and any unfused op).
NOT_COMPUTE = frozenset({
    "parameter", "constant", "iota", "tuple", "get-tuple-element", "bitcast",
    "bitcast-convert", "copy", "copy-start", "copy-done", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
    "send", "send-done", "recv", "recv-done", "infeed", "outfeed"})
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


class Overlap(NamedTuple):
  """One collective and the compute of its computation independent of it."""
  name: str                     # HLO name (the -start of an async pair)
  kind: str                     # 'reduce-scatter', 'all-gather', ...
  bytes: int                    # full buffer reduced or gathered (as collectives())
  computation: str              # where it is: the ENTRY computation or a loop body
  independent: tuple[str, ...]  # compute ops neither feeding nor waiting for it
  independent_bytes: int        # their output bytes, summed
  independent_flops: int        # their dots' 2*M*N*K (inside fusions too; no convs)
  feeding: int                  # compute ops it waits for (ancestors)
  waiting: int                  # compute ops that wait for it (descendants)
  total_compute: int            # compute ops: feeding + waiting + len(independent)


def _kind(instr: Instruction, module: Module) -> str | None:
  op = instr.opcode
  base = op[:-len("-start")] if op.endswith("-start") else op
  if base in hlo_graph.COLLECTIVES:
    return base
  if op == "async-start" and instr.called:   # an unsugared async wrapper
    inner = module.computations.get(instr.called[0], ())
    root = inner[-1].opcode if inner else ""
    return root if root in hlo_graph.COLLECTIVES else None
  return None


def _dot_flops(instr: Instruction, shapes: dict[str, str]) -> int:
  out = hlo_graph.shape_dims(instr.shape)
  if instr.opcode == "dot":
    contract, lhs = _CONTRACT.search(instr.attrs), instr.operands[:1]
  elif instr.opcode == "custom-call" and "gemm" in instr.attrs:   # cuBLAS
    contract, lhs = _GEMM_CONTRACT.search(instr.attrs), instr.operands[:1]
  else:
    return 0
  if not (out and contract and lhs and lhs[0] in shapes):
    return 0
  lhs_dims = hlo_graph.shape_dims(shapes[lhs[0]])[0][1]
  k = 1
  for d in re.findall(r"\d+", contract.group(1)):
    k *= lhs_dims[int(d)]
  m_n = 1
  for d in out[0][1]:
    m_n *= d
  return 2 * m_n * k


def _flops(module: Module, shapes: dict, computation: str, instr: Instruction,
           seen: frozenset = frozenset()) -> int:
  """Dot flops of ``instr`` and of the computations it calls (a loop body
  counted once: the trip count is not read)."""
  if computation not in shapes:
    shapes[computation] = {i.name: i.shape for i in module.computations[computation]}
  total = _dot_flops(instr, shapes[computation])
  for c in instr.called:
    if c in module.computations and c not in seen:
      total += sum(_flops(module, shapes, c, i, seen | {c})
                   for i in module.computations[c])
  return total


def _collective_bytes(instrs, members, kind: str) -> int:
  first, last = instrs[members[0]], instrs[members[-1]]
  shape = last.shape   # the result: the -done's output, or the sync op's
  if len(members) == 1 and first.opcode.endswith("-start") and shape.startswith("("):
    shape = hlo_graph.last_tuple_element(shape)
  size = hlo_graph.shape_bytes(shape)
  if kind == "reduce-scatter":
    size *= hlo_graph.group_size(first.attrs)   # the output is one device's piece
  return size


def _wrapped(module: Module) -> set[str]:
  """Computations an async-start wraps (their collective is reported at the start)."""
  return {c for instrs in module.computations.values() for i in instrs
          if i.opcode == "async-start" for c in i.called}


def hlo_overlap(hlo_text: str) -> list[Overlap]:
  """:func:`overlap` of optimized HLO text (``compiled.as_text()``), in
  program order (the ENTRY computation first, then loop bodies)."""
  module = hlo_graph.parse(hlo_text)
  skip, shapes = _wrapped(module), {}
  names = [module.entry] + [c for c in module.computations if c != module.entry]
  out = []
  for comp in names:
    if comp in skip:
      continue
    instrs = module.computations[comp]
    kinds = [_kind(i, module) for i in instrs]
    if not any(kinds):
      continue
    deps = hlo_graph.dependencies(instrs)
    compute = [n for n, members in enumerate(deps.nodes)
               if not kinds[members[0]] and any(
                   instrs[k].opcode not in NOT_COMPUTE for k in members)]
    cost = {n: (sum(hlo_graph.shape_bytes(instrs[k].shape) for k in deps.nodes[n]),
                sum(_flops(module, shapes, comp, instrs[k]) for k in deps.nodes[n]))
            for n in compute}
    mask = sum(1 << c for c in compute)
    for n, members in enumerate(deps.nodes):
      kind = kinds[members[0]]
      if not kind:
        continue
      anc, desc = deps.ancestors[n], deps.descendants[n]
      free_set = mask & ~anc & ~desc
      free = [c for c, bit in enumerate(bin(free_set)[:1:-1]) if bit == "1"]
      out.append(Overlap(
          name=instrs[members[0]].name, kind=kind,
          bytes=_collective_bytes(instrs, members, kind), computation=comp,
          independent=tuple(instrs[deps.nodes[c][0]].name for c in free),
          independent_bytes=sum(cost[c][0] for c in free),
          independent_flops=sum(cost[c][1] for c in free),
          feeding=(anc & mask).bit_count(), waiting=(desc & mask).bit_count(),
          total_compute=len(compute)))
  return out


def overlap(fn: Callable, *args: Any, **kwargs: Any) -> list[Overlap]:
  """Per collective of ``fn`` compiled on ``args``, the compute independent of it.

  ``fn`` is anything with ``.lower(*args)`` (a ``jax.jit`` function, what
  :func:`zero1_jax.train_step` returns), a ``Lowered`` or a ``Compiled``.
  Nodes are the instructions of one computation (a fusion, a loop, a call
  count as one each; an async ``-start``/``-done`` pair as one collective).
  Compute is every node but bookkeeping, copies and communication
  (:data:`NOT_COMPUTE`); its size is given as output bytes and as dot flops.
  Collectives inside a loop body are judged against that body's compute for
  one iteration. Print the result with :func:`overlap_summary`.

  >>> import jax, jax.numpy as jnp, zero1_jax as z1
  >>> f = jax.jit(lambda x: jnp.sin(x) @ x)
  >>> z1.inspect.overlap(f, jnp.ones((4, 4)))   # nothing to hide on one device
  []
  """
  if hasattr(fn, "lower"):
    fn = fn.lower(*args, **kwargs)
  compiled = fn.compile() if hasattr(fn, "compile") else fn   # a Lowered: compile
  if not hasattr(compiled, "as_text"):
    raise TypeError(f"overlap() needs a jitted function (with .lower(*args)), a "
                    f"Lowered or a Compiled object, got {type(fn).__name__}: wrap "
                    "it in jax.jit first")
  return hlo_overlap(compiled.as_text())


def _size(x: float, unit: str) -> str:
  for prefix in ("", "K", "M", "G", "T"):
    if abs(x) < 1000 or prefix == "T":
      return f"{x:.3g} {prefix}{unit}"
    x /= 1000
  return ""


def overlap_summary(reports: list[Overlap]) -> str:
  """A table of :func:`overlap`'s reports, one line per collective."""
  if not reports:
    return "no collectives"
  w = min(40, max(10, *(len(r.name) for r in reports)))
  rows = [f"{'collective':<{w}} {'kind':<18} {'bytes':>9}  {'independent compute':>34}"
          f"  {'feeds it':>8} {'waits':>6} {'of':>4}"]
  for r in reports:
    free = (f"{len(r.independent)} ops, {_size(r.independent_bytes, 'B')}, "
            f"{_size(r.independent_flops, 'flop')}")
    rows.append(f"{r.name[:w]:<{w}} {r.kind:<18} {_size(r.bytes, 'B'):>9}  {free:>34}"
                f"  {r.feeding:>8} {r.waiting:>6} {r.total_compute:>4}")
  exposed = sum(1 for r in reports if not r.independent)
  rows.append(f"{exposed} of {len(reports)} collectives have no independent compute. "
              "bytes: the whole buffer reduced or gathered (all N pieces); "
              "independent compute: ops neither feeding the collective nor "
              "waiting for it (their output bytes; flops of dots only); feeds "
              "it / waits: compute ops it depends on / that depend on it, of "
              "all compute ops")
  return "\n".join(rows)
