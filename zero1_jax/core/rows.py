"""Whether a loss mixes the batch's rows: what ``z1.value_and_grad`` cannot
split over devices.

``z1.value_and_grad`` runs the loss on each device's rows and averages the
devices' losses. That is ``jax.value_and_grad``'s loss on the whole batch
exactly when the loss is a mean of per-row terms. A loss that mixes rows
computes something else on 1/N of them, with no error: in-batch negatives
(a contrastive loss, ``z @ z.T``), statistics over the batch applied back to
its rows (batch normalization in training mode, a softmax over the batch),
a nonlinear function of a sum over rows (a weighted mean ``sum(w * l) /
sum(w)``: each device divides by its own rows' weight).

:func:`mixing` reads the loss's jaxpr, traced on the batch's shapes, and
follows what each value depends on: nothing in the batch, one row at a time
along one axis (``ROW``), or a linear sum over rows (``SUM``, as a mean is).
Each operation the module knows maps these (elementwise ones, contractions,
reductions, reshapes, lookups, convolutions and pooling, pads, calls,
scans from a zero carry, conds). A slice, split, reversal or concatenation
of rows picks them by position (``Row.part``), which each device does on
its own rows: two different picks meeting pair rows the whole batch does
not (two views stacked in one batch). One it does not know, or a row axis
it cannot follow (a reshape that splits it), stops the trail there
(``UNKNOWN``): the check says only what it can show, so a loss it cannot
read is let through, never refused by guess.

Example:
  >>> import jax, jax.numpy as jnp
  >>> x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
  >>> w = jnp.ones((4, 3))
  >>> per_row = jax.make_jaxpr(lambda x: jnp.mean((x @ w) ** 2))(x)
  >>> mixing(per_row, [True]) is None
  True
  >>> pairs = jax.make_jaxpr(lambda x: jnp.mean(x @ x.T))(x)
  >>> print(mixing(pairs, [True]))   # doctest: +ELLIPSIS
  `dot_general` pairs each row with other rows ...
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Sequence

import jax

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
_ELEMENTWISE = _LINEAR | {
    "mul", "div", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
    "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "abs", "sign", "floor", "ceil",
    "round", "is_finite", "integer_pow", "pow", "max", "min", "atan2", "rem",
    "nextafter", "and", "or", "not", "xor", "eq", "ne", "lt", "le", "gt", "ge",
    "select_n", "clamp", "erf", "erfc", "erf_inv", "lgamma", "digamma",
    "square", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "stop_gradient"}
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_SUM_KEEPS = {"reduce_sum", "cumsum", "broadcast_in_dim", "reshape", "squeeze",
              "transpose", "slice", "pad", "rev", "dynamic_slice", "split",
              "reduce_window_sum"}


def _join(states: Sequence) -> Any:
  """One state for values that may be any of ``states`` (a value with no
  batch in it is one of rows, or of a sum, as well: a carry that starts at
  zeros)."""
  bad = [s for s in states if isinstance(s, Bad)]
  if bad:
    return bad[0]
  states = [s for s in states if s is not None] or [None]
  return states[0] if all(s == states[0] for s in states) else UNKNOWN


def _elementwise(p: str, states: list) -> Any:
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


def _reshape(s0: Row, old: tuple, new: tuple) -> Any:
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


def _dot(p: str, eqn, states: list) -> Any:
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  x, y = states
  if any(isinstance(s, Bad) for s in states) or UNKNOWN in states:
    return _join([s for s in states if s is not None])
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


def _reduced(p: str, s: Any, axes: Sequence[int]) -> Any:
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


def _conv(eqn, states: list) -> Any:
  """A convolution keeps its input's rows (its batch dimension), unless
  batch groups mix them."""
  x, k = states
  dn = eqn.params["dimension_numbers"]
  if (isinstance(x, Row) and k is None and x.axis == dn.lhs_spec[0]
      and eqn.params["batch_group_count"] == 1):
    return x._replace(axis=dn.out_spec[0])
  return _join([s for s in states if s is not None]) if any(
      isinstance(s, Bad) for s in states) else UNKNOWN


def _gather(eqn, states: list) -> Any:
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
  return _join([s for s in states if s is not None]) if any(
      isinstance(s, Bad) for s in states) else UNKNOWN


def _one(eqn, states: list) -> list:
  """The states of ``eqn``'s results from its operands' ``states``."""
  p, prm = eqn.primitive.name, eqn.params
  outs = len(eqn.outvars)
  if all(s is None for s in states):
    return [None] * outs
  bad = [s for s in states if isinstance(s, Bad)]
  if bad:
    return [bad[0]] * outs
  s0 = states[0]
  if p in _ELEMENTWISE:
    return [_elementwise(p, states)] * outs
  if p == "dot_general":
    return [_dot(p, eqn, states)]
  if p == "gather":
    return [_gather(eqn, states)]
  if p == "scan":
    return _scan(eqn, states)
  sub = next((prm[k] for k in _CALLS if k in prm), None)
  if sub is not None and len(getattr(sub, "jaxpr", sub).invars) == len(states):
    return _run(sub, states)
  if p == "cond":
    if states[0] is not None:
      return [UNKNOWN] * outs
    return [_join(list(s)) for s in zip(*(_run(b, states[1:])
                                           for b in prm["branches"]))]
  if p == "conv_general_dilated":
    return [_conv(eqn, states)]
  if p in ("psum", "pmax", "pmin") and all(
      isinstance(d, int) for d in prm["axes"]):
    # over positional axes: a vmapped lax.pmean (Equinox's BatchNorm)
    return [_reduced(p[1:], s, prm["axes"]) for s in states]
  if p in ("pad", "dynamic_slice") and all(s is None for s in states[1:]):
    states = states[:1]   # the padding value, the starts: no batch
  rows = {s.axis for s in states if isinstance(s, Row)}
  if p in ("concatenate", "sort", "optimization_barrier"):
    along = prm.get("dimension")
    if p == "sort" and along in rows:
      return [Bad(ALONG.format(p=p))] * outs
    if p == "optimization_barrier":
      return list(states)
    if p == "concatenate" and rows == {along} and all(
        isinstance(s, Row) for s in states):   # rows after rows: by position
      sizes = tuple(v.aval.shape[along] for v in eqn.invars)
      return [Row(along, (("cat", sizes, tuple(s.part for s in states)),))]
    joined = _join([s for s in states if s is not None])
    return [UNKNOWN if along in rows else joined] * outs
  if len(states) != 1:
    return [UNKNOWN] * outs
  if s0 == SUM:   # a sum moved, summed or cut: still one
    return [SUM if p in _SUM_KEEPS else Bad(NONLINEAR.format(p=p))] * outs
  if not isinstance(s0, Row):
    return [UNKNOWN] * outs
  a, shape = s0.axis, eqn.invars[0].aval.shape
  if p == "broadcast_in_dim":
    return [s0._replace(axis=prm["broadcast_dimensions"][a])]
  if p == "reshape":
    return [_reshape(s0, tuple(shape), tuple(prm["new_sizes"]))]
  if p == "transpose":
    return [s0._replace(axis=list(prm["permutation"]).index(a))]
  if p == "squeeze":
    dims = prm["dimensions"]
    return [UNKNOWN if a in dims else s0._replace(axis=a - sum(d < a for d in dims))]
  if p.startswith(("reduce_", "arg")) and "axes" in prm:
    return [_reduced(p, s0, prm["axes"])] * outs
  if p.startswith("cum"):
    along = prm.get("axis", prm.get("dimension"))
    return [Bad(ALONG.format(p=p)) if along == a else s0] * outs
  if p == "top_k":   # the k largest along one axis (hardest examples)
    along = prm.get("axis", -1) % len(shape)
    return [Bad(ALONG.format(p=p)) if along == a else s0] * outs
  if p == "split":   # along the rows: each piece picks rows by position
    ends = [sum(prm["sizes"][:i + 1]) for i in range(outs)]
    return [_picked(s0, e - z, e, 1, shape[a]) if prm["axis"] == a else s0
            for e, z in zip(ends, prm["sizes"])]
  if p.startswith("reduce_window"):   # pooling: a window of 1 row
    one = (prm["window_dimensions"][a] == 1 and prm["window_strides"][a] == 1
           and tuple(prm["padding"][a]) == (0, 0)
           and prm["base_dilation"][a] == 1)
    return [s0 if one else UNKNOWN] * outs
  if p == "slice":   # rows by position, unless all of them
    return [_picked(s0, prm["start_indices"][a], prm["limit_indices"][a],
                    (prm["strides"] or [1] * 99)[a], shape[a])]
  whole = {"pad": lambda: tuple(prm["padding_config"][a]) == (0, 0, 0),
           "dynamic_slice": lambda: prm["slice_sizes"][a] == shape[a],
           "rev": lambda: a not in prm["dimensions"]}   # reversed: by position
  if p in whole:
    return [s0 if whole[p]() else s0._replace(part=s0.part + (("rev", shape[a]),))
            if p == "rev" else UNKNOWN]
  return [UNKNOWN] * outs


def _picked(s0: Row, start: int, stop: int, stride: int, size: int) -> Row:
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


def _scan(eqn, states: list) -> list:
  prm = eqn.params
  if "num_consts" in prm:
    nc, nk = prm["num_consts"], prm["num_carry"]
  else:   # jax 0.12: a flat tree of (consts, carry, xs), one leaf each
    nc, nk = (len(list(t)) for t in prm["ft_in"].unpack()[:2])
  consts, carry, xs = states[:nc], states[nc:nc + nk], states[nc + nk:]
  xs = [UNKNOWN if isinstance(s, Row) and s.axis == 0 else
        s._replace(axis=s.axis - 1) if isinstance(s, Row) else s for s in xs]
  for _ in range(4):   # the carry's state, to a fixed point
    out = _run(prm["jaxpr"], consts + carry + xs)
    new = [_join([c, o]) for c, o in zip(carry, out[:nk])]
    if new == carry:
      break
    carry = new
  ys = [s._replace(axis=s.axis + 1) if isinstance(s, Row) else s for s in out[nk:]]
  return carry + ys


def _run(closed, states: Sequence) -> list:
  """The states of ``closed``'s (a jaxpr, closed or not) results."""
  j = getattr(closed, "jaxpr", closed)
  env: dict = {v: None for v in j.constvars}
  env.update(zip(j.invars, states))
  read = lambda v: env.get(v) if not hasattr(v, "val") else None
  for eqn in j.eqns:
    try:
      out = _one(eqn, [read(v) for v in eqn.invars])
    except Exception:  # noqa: BLE001 - a form it does not know: no trail
      out = [UNKNOWN] * len(eqn.outvars)
    env.update(zip(eqn.outvars, out))
  return [read(v) for v in j.outvars]


def _states_in(closed: Any, batch: Sequence[bool]) -> list:
  return [Row(0) if b and len(v.aval.shape) else None
          for v, b in zip(getattr(closed, "jaxpr", closed).invars, batch)]


def _flags(args: tuple, argnums: Sequence[int]) -> list[bool]:
  return [i in argnums for i, a in enumerate(args) for _ in jax.tree.leaves(a)]


def batch_free(fun: Callable, args: tuple, argnums: Sequence[int]) -> list[bool]:
  """Per result leaf of ``fun(*args)``: whether it is computed from nothing
  in the arguments at ``argnums`` (the batch), so that every device's is
  the same (a call counter in an nnx model's state)."""
  closed = jax.make_jaxpr(fun)(*args)
  batch = _flags(args, argnums)
  if len(batch) != len(closed.jaxpr.invars):
    return [False] * len(closed.jaxpr.outvars)
  return [s is None for s in _run(closed, _states_in(closed, batch))]


def mixing(closed: Any, batch: Sequence[bool]) -> str | None:
  """What in the jaxpr ``closed`` (its first result: the loss) mixes the
  batch's rows, or None. ``batch``: per input, whether it is a batch leaf
  (its leading axis the rows)."""
  out = _run(closed, _states_in(closed, batch))[0]
  return out.why if isinstance(out, Bad) else None


MIXES = (
    "zero1: z1.value_and_grad runs the loss on each device's rows of the "
    "batch and averages the devices' losses, which is jax.value_and_grad's "
    "loss on the whole batch only for a mean of per-row terms. This loss "
    "mixes rows: {why}; its value and gradients differ from "
    "jax.value_and_grad's. Pass what needs the whole batch as an argument "
    "(a weighted mean: return n * jnp.sum(w * l) / total, with total the "
    "whole batch's jnp.sum(w)), or take this loss's gradient with "
    "jax.value_and_grad in the jitted step (tx.update reduces it too).")


def warn_mixing(fun: Callable, args: tuple, argnums: Sequence[int]) -> None:
  """Warns (:data:`MIXES`) where ``fun(*args)``'s first result mixes the
  rows of the arguments at ``argnums`` (the batch)."""
  closed = jax.make_jaxpr(fun)(*args)
  batch = _flags(args, argnums)
  if len(batch) != len(closed.jaxpr.invars):
    return
  why = mixing(closed, batch)
  if why:
    warnings.warn(MIXES.format(why=why), UserWarning, stacklevel=3)
