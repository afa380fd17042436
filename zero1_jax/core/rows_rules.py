"""The rules of :mod:`.rows`: the states a value of the loss's jaxpr is in
(no batch: None; one row at a time along an axis: :class:`Row`, with the
rows it picks by position; a linear sum over rows: ``SUM``; ``UNKNOWN``;
:class:`Bad`, saying what mixes rows) and how elementwise operations,
contractions, reductions, reshapes, lookups and convolutions map them.

Example:
  >>> elementwise("mul", [Row(0), None])
  Row(axis=0, part=())
  >>> print(elementwise("sub", [Row(0), SUM]).why)   # doctest: +ELLIPSIS
  `sub` combines rows with a statistic over the batch's rows ...
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

SUM, UNKNOWN = "sum", "unknown"   # a state: also None (no batch) or Row / Bad


class Row(NamedTuple):
  axis: int            # the axis along which the row varies
  part: tuple = ()     # the rows picked by position (a slice), if not all


class Bad(NamedTuple):
  why: str             # what mixes rows, in words


PAIRS = "`{p}` pairs each row with other rows (in-batch negatives, a contrastive loss)"
MEETS = ("`{p}` combines rows with a statistic over the batch's rows (batch "
         "normalization in training mode, a softmax over the batch)")
NONLINEAR = ("`{p}` of a sum over the batch's rows (a weighted mean's division "
             "by the batch's total weight, a loss normalized by the batch)")
ALONG = "`{p}` along the batch's rows"
PLACES = ("`{p}` pairs rows at different positions in the batch (a batch "
          "split into views or shifted; each device splits its own rows: "
          "pass each view as a batch argument of its own)")

_LINEAR = {"neg", "convert_element_type", "copy", "copy_p", "reduce_precision",
           "real", "imag", "conj", "add", "sub", "add_any"}
ELEMENTWISE = _LINEAR | {
    "mul", "div", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
    "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "abs", "sign", "floor", "ceil",
    "round", "is_finite", "integer_pow", "pow", "max", "min", "atan2", "rem",
    "nextafter", "and", "or", "not", "xor", "eq", "ne", "lt", "le", "gt", "ge",
    "select_n", "clamp", "erf", "erfc", "erf_inv", "lgamma", "digamma",
    "square", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "stop_gradient"}
CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
SUM_KEEPS = {"reduce_sum", "cumsum", "broadcast_in_dim", "reshape", "squeeze",
              "transpose", "slice", "pad", "rev", "dynamic_slice", "split",
              "reduce_window_sum"}


def join(states: Sequence) -> Any:
  """One state for values that may be any of ``states`` (a value with no
  batch in it is one of rows, or of a sum, as well: a carry that starts at
  zeros)."""
  bad = [s for s in states if isinstance(s, Bad)]
  if bad:
    return bad[0]
  states = [s for s in states if s is not None] or [None]
  return states[0] if all(s == states[0] for s in states) else UNKNOWN


def elementwise(p: str, states: list) -> Any:
  bad = [s for s in states if isinstance(s, Bad)]
  if bad:
    return bad[0]
  if UNKNOWN in states:
    return UNKNOWN
  rows = {s for s in states if isinstance(s, Row)}
  if len(rows) > 1:
    return Bad((PAIRS if len({r.axis for r in rows}) > 1 else PLACES).format(p=p))
  if rows:
    return Bad(MEETS.format(p=p)) if SUM in states else rows.pop()
  if SUM not in states:
    return None
  sums = [i for i, s in enumerate(states) if s == SUM]
  linear = (p in _LINEAR or (p == "mul" and len(sums) == 1)
            or (p == "div" and sums == [0])
            or (p == "select_n" and states[0] is None))
  return SUM if linear else Bad(NONLINEAR.format(p=p))


def reshape(s0: Row, old: tuple, new: tuple) -> Any:
  """``s0`` on the axis of ``new`` that its row axis of ``old`` lies in
  (merged with others), or UNKNOWN where the reshape splits it."""
  a = s0.axis
  stride = _prod(old[a + 1:])
  span = stride * old[a]
  for b in range(len(new)):
    s = _prod(new[b + 1:])
    if s <= stride and stride % s == 0 and span <= s * new[b]:
      return s0._replace(axis=b)
  return UNKNOWN


def _prod(xs) -> int:
  out = 1
  for x in xs:
    out *= int(x)
  return out


def dot(p: str, eqn, states: list) -> Any:
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  x, y = states
  if any(isinstance(s, Bad) for s in states) or UNKNOWN in states:
    return join([s for s in states if s is not None])
  if SUM in states:
    return Bad(MEETS.format(p=p)) if any(isinstance(s, Row) for s in states) \
        else (SUM if None in states else Bad(NONLINEAR.format(p=p)))
  nl, nr = (len(v.aval.shape) for v in eqn.invars)
  lfree = [d for d in range(nl) if d not in lc and d not in lb]
  rfree = [d for d in range(nr) if d not in rc and d not in rb]
  if isinstance(x, Row) and isinstance(y, Row):
    if x.part != y.part:
      return Bad(PLACES.format(p=p))
    if x.axis in lb and y.axis in rb and lb.index(x.axis) == rb.index(y.axis):
      return x._replace(axis=lb.index(x.axis))
    if x.axis in lc and y.axis in rc and lc.index(x.axis) == rc.index(y.axis):
      return SUM
    return Bad(PAIRS.format(p=p))
  if isinstance(x, Row):   # the other side has no rows
    r, c, b, free, off = x, lc, lb, lfree, len(lb)
  elif isinstance(y, Row):
    r, c, b, free, off = y, rc, rb, rfree, len(rb) + len(lfree)
  else:
    return None
  a = r.axis
  return SUM if a in c else r._replace(
      axis=b.index(a) if a in b else off + free.index(a))


def reduced(p: str, s: Any, axes: Sequence[int]) -> Any:
  """A reduction (``reduce_sum``, ``sum``, ``reduce_max``, ...) over
  ``axes`` of one operand in state ``s``."""
  linear = p in ("reduce_sum", "sum")
  if isinstance(s, Row):
    if s.axis not in axes:
      return s._replace(axis=s.axis - sum(d < s.axis for d in axes))
    return SUM if linear else Bad(ALONG.format(p=p))
  if s == SUM:
    return SUM if linear else Bad(NONLINEAR.format(p=p))
  return s


def conv(eqn, states: list) -> Any:
  """A convolution keeps its input's rows (its batch dimension), unless
  batch groups mix them."""
  x, k = states
  dn = eqn.params["dimension_numbers"]
  if (isinstance(x, Row) and k is None and x.axis == dn.lhs_spec[0]
      and eqn.params["batch_group_count"] == 1):
    return x._replace(axis=dn.out_spec[0])
  return join([s for s in states if s is not None]) if any(
      isinstance(s, Bad) for s in states) else UNKNOWN


def gather(eqn, states: list) -> Any:
  op, idx = states
  dn = eqn.params["dimension_numbers"]
  out_nd = len(eqn.outvars[0].aval.shape)
  batch_out = [d for d in range(out_nd) if d not in dn.offset_dims]
  nidx = len(eqn.invars[1].aval.shape)
  if op is None and isinstance(idx, Row) and idx.axis < nidx - 1:
    return idx._replace(axis=batch_out[idx.axis])
  obd = tuple(getattr(dn, "operand_batching_dims", ()))
  ibd = tuple(getattr(dn, "start_indices_batching_dims", ()))
  if (isinstance(op, Row) and isinstance(idx, Row) and op.axis in obd
      and ibd[obd.index(op.axis)] == idx.axis and idx.axis < nidx - 1
      and op.part == idx.part):
    return idx._replace(axis=batch_out[idx.axis])
  if isinstance(op, Row) and idx is None and op.axis not in (
      tuple(dn.collapsed_slice_dims) + tuple(dn.start_index_map) + obd):
    kept = [d for d in range(len(eqn.invars[0].aval.shape))
            if d not in tuple(dn.collapsed_slice_dims) + obd]
    return op._replace(axis=dn.offset_dims[kept.index(op.axis)])
  return join([s for s in states if s is not None]) if any(
      isinstance(s, Bad) for s in states) else UNKNOWN


def picked(s0: Row, start: int, stop: int, stride: int, size: int) -> Row:
  """Rows ``start:stop:stride`` of the ``size`` rows of ``s0``: exactly one
  operand of the concatenation ``s0`` is (that operand again), or a pick."""
  if (start, stop, stride) == (0, size, 1):
    return s0
  cat = s0.part[-1] if s0.part and s0.part[-1][0] == "cat" else None
  if cat and stride == 1:
    ends = [sum(cat[1][:i + 1]) for i in range(len(cat[1]))]
    for lo, hi, part in zip([0] + ends[:-1], ends, cat[2]):
      if (lo, hi) == (start, stop):
        return s0._replace(part=part)
  return s0._replace(part=s0.part + (("slice", size, start, stop, stride),))
