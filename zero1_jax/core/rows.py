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

import contextvars
import warnings
from typing import Any, Callable, Sequence

import jax

from zero1_jax.core.rows_rules import (
    ALONG, NONLINEAR, SUM, UNKNOWN, Bad, Row, CALLS, ELEMENTWISE,
    SUM_KEEPS, conv, dot, elementwise, gather, join, picked, reduced,
    reshape)

# The data axis while :func:`mixing` runs: a collective over it (a psum of
# the batch's weight, an all_gather of in-batch negatives) gives every
# device the whole batch's value, as jax.value_and_grad's loss computes it.
_DATA_AXIS: contextvars.ContextVar = contextvars.ContextVar("axis", default=None)


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
  if p in ELEMENTWISE:
    return [elementwise(p, states)] * outs
  if p == "dot_general":
    return [dot(p, eqn, states)]
  if p == "gather":
    return [gather(eqn, states)]
  if p == "scan":
    return _scan(eqn, states)
  sub = next((prm[k] for k in CALLS if k in prm), None)
  if sub is not None and len(getattr(sub, "jaxpr", sub).invars) == len(states):
    return _run(sub, states)
  if p == "cond":
    if states[0] is not None:
      return [UNKNOWN] * outs
    return [join(list(s)) for s in zip(*(_run(b, states[1:])
                                           for b in prm["branches"]))]
  if p == "conv_general_dilated":
    return [conv(eqn, states)]
  if p in ("psum", "pmax", "pmin") and all(
      isinstance(d, int) for d in prm["axes"]):
    # over positional axes: a vmapped lax.pmean (Equinox's BatchNorm)
    return [reduced(p[1:], s, prm["axes"]) for s in states]
  named = prm.get("axes", prm.get("axis_name")) or ()
  named = set(named if isinstance(named, (tuple, list)) else [named])
  if p in ("psum", "all_gather") and _DATA_AXIS.get() in named - {None}:
    # the whole batch's sum, or its rows, on every device
    return [None if s is None or s == SUM or p == "all_gather" else UNKNOWN
            for s in states]
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
    joined = join([s for s in states if s is not None])
    return [UNKNOWN if along in rows else joined] * outs
  if len(states) != 1:
    return [UNKNOWN] * outs
  if s0 == SUM:   # a sum moved, summed or cut: still one
    return [SUM if p in SUM_KEEPS else Bad(NONLINEAR.format(p=p))] * outs
  if not isinstance(s0, Row):
    return [UNKNOWN] * outs
  a, shape = s0.axis, eqn.invars[0].aval.shape
  if p == "broadcast_in_dim":
    return [s0._replace(axis=prm["broadcast_dimensions"][a])]
  if p == "reshape":
    return [reshape(s0, tuple(shape), tuple(prm["new_sizes"]))]
  if p == "transpose":
    return [s0._replace(axis=list(prm["permutation"]).index(a))]
  if p == "squeeze":
    dims = prm["dimensions"]
    return [UNKNOWN if a in dims else s0._replace(axis=a - sum(d < a for d in dims))]
  if p.startswith(("reduce_", "arg")) and "axes" in prm:
    return [reduced(p, s0, prm["axes"])] * outs
  if p.startswith("cum"):
    along = prm.get("axis", prm.get("dimension"))
    return [Bad(ALONG.format(p=p)) if along == a else s0] * outs
  if p == "top_k":   # the k largest along one axis (hardest examples)
    along = prm.get("axis", -1) % len(shape)
    return [Bad(ALONG.format(p=p)) if along == a else s0] * outs
  if p == "split":   # along the rows: each piece picks rows by position
    ends = [sum(prm["sizes"][:i + 1]) for i in range(outs)]
    return [picked(s0, e - z, e, 1, shape[a]) if prm["axis"] == a else s0
            for e, z in zip(ends, prm["sizes"])]
  if p.startswith("reduce_window"):   # pooling: a window of 1 row
    one = (prm["window_dimensions"][a] == 1 and prm["window_strides"][a] == 1
           and tuple(prm["padding"][a]) == (0, 0)
           and prm["base_dilation"][a] == 1)
    return [s0 if one else UNKNOWN] * outs
  if p == "slice":   # rows by position, unless all of them
    return [picked(s0, prm["start_indices"][a], prm["limit_indices"][a],
                    (prm["strides"] or [1] * 99)[a], shape[a])]
  whole = {"pad": lambda: tuple(prm["padding_config"][a]) == (0, 0, 0),
           "dynamic_slice": lambda: prm["slice_sizes"][a] == shape[a],
           "rev": lambda: a not in prm["dimensions"]}   # reversed: by position
  if p in whole:
    return [s0 if whole[p]() else s0._replace(part=s0.part + (("rev", shape[a]),))
            if p == "rev" else UNKNOWN]
  return [UNKNOWN] * outs


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
    new = [join([c, o]) for c, o in zip(carry, out[:nk])]
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


def mixing(closed: Any, batch: Sequence[bool], axis: str | None = None
           ) -> str | None:
  """What in the jaxpr ``closed`` (its first result: the loss) mixes the
  batch's rows, or None. ``batch``: per input, whether it is a batch leaf
  (its leading axis the rows); ``axis``: the data axis, which the loss's
  collectives may reduce over."""
  token = _DATA_AXIS.set(axis)
  try:
    out = _run(closed, _states_in(closed, batch))[0]
  finally:
    _DATA_AXIS.reset(token)
  return out.why if isinstance(out, Bad) else None


MIXES = (
    "zero1: z1.value_and_grad runs the loss on each device's rows of the "
    "batch and averages the devices' losses, which is jax.value_and_grad's "
    "loss on the whole batch only for a mean of per-row terms. This loss "
    "mixes rows: {why}; its value and gradients differ from "
    "jax.value_and_grad's. Pass what needs the whole batch as an argument "
    "(a weighted mean: return n * jnp.sum(w * l) / total, with total the "
    "whole batch's jnp.sum(w)), or compute it over the devices on the data "
    "axis, which is bound where the loss runs (jax.lax.psum(jnp.sum(w), "
    "{axis!r}) for that total, jax.lax.all_gather(z, {axis!r}, tiled=True) "
    "for in-batch negatives, flax's BatchNorm(axis_name={axis!r})), or "
    "take this loss's gradient with jax.value_and_grad in the jitted step "
    "(tx.update reduces it too).")


def warn_mixing(fun: Callable, args: tuple, argnums: Sequence[int],
                axis: str | None = None) -> None:
  """Warns (:data:`MIXES`) where ``fun(*args)``'s first result mixes the
  rows of the arguments at ``argnums`` (the batch) split over ``axis``."""
  closed = jax.make_jaxpr(fun)(*args)
  batch = _flags(args, argnums)
  if len(batch) != len(closed.jaxpr.invars):
    return
  why = mixing(closed, batch, axis)
  if why:
    warnings.warn(MIXES.format(why=why, axis=axis or "data"), UserWarning,
                  stacklevel=3)
