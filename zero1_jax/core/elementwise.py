"""Whether an inner optimizer may run on 1/N shards of each parameter.

ZeRO-1 hands the inner optimizer this device's rows of every parameter leaf.
That gives optax's result only if every number it computes for an element
depends on that element alone: an *elementwise* optimizer. Two checks decide,
and both must pass (:func:`check_elementwise`):

1. **The jaxpr** of ``inner.update(grads, state, params)`` traced on the shard
   shapes (:func:`jaxpr_reason`). Values computed from parameter-shaped data
   (gradients, parameters, sharded state) are *tainted*, and the taint
   analysis of :mod:`.jaxpr_check` refuses any step that mixes elements (a
   reduction, contraction, sort, reshape/slice of tainted data, a loop or
   branch steered by it, position-dependent values meeting it). Here, also
   refused: a position-dependent value reaching the output, and a tainted
   value stored in a replicated slot (a scalar state leaf computed from the
   parameters: whole-tree statistics).
2. **A numeric probe** (:func:`.probe.probe_reason`): two updates on small
   leaves with the real shard dims, whole and as N zero-padded shards, must
   agree on the updates and on *every* state leaf, scalars and PRNG keys
   included. It catches what a jaxpr hides, e.g. a scale computed from
   ``x.size``.

Between them, :func:`.size_check.size_reason` refuses an optimizer that
decides by a leaf's size or shape (factored moments, a mask by size): on a
shard it would run another, still elementwise, computation.
:func:`.dtype_check.dtype_reason` refuses one that decides by a leaf's dtype:
on a bf16 param's fp32 master it would decide otherwise.

:func:`.state_dims.state_shard_dims` tells which state leaves are sharded
(and refuses state not shaped like the parameter shards: adafactor's
factored moments).

Example:
  >>> import jax.numpy as jnp, optax
  >>> from zero1_jax.core import layout as lay
  >>> L = lay.plan({"w": jnp.zeros((5, 3))}, 4)
  >>> jaxpr_reason(optax.adam(1e-3), L) is None
  True
  >>> jaxpr_reason(optax.chain(optax.centralize(), optax.adam(1e-3)), L)
  'reduce_sum on parameter-shaped data (reduces across elements)'
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from zero1_jax.core import blame
from zero1_jax.core import dtype_check
from zero1_jax.core import extra_args as xa
from zero1_jax.core import jaxpr_check as jc
from zero1_jax.core import layout as lay
from zero1_jax.core import verdicts
from zero1_jax.core.probe import probe_reason
from zero1_jax.core.refusal import (CANNOT_RUN, REFUSAL, Refused, brief,
                                     refusal)
from zero1_jax.core.size_check import size_reason
from zero1_jax.core.state_dims import shard_inputs, state_shard_dims


def jaxpr_reason(inner: optax.GradientTransformation, layout: lay.Layout,
                 dtype: Any = jnp.float32, extra: dict | None = None
                 ) -> str | None:
  """Why ``inner.update`` on ``layout``'s shards is not elementwise, read
  from its jaxpr; None if every step is. ``extra``: the update's extra
  keyword arguments (:mod:`.extra_args`)."""
  try:
    _, dims, _, _ = state_shard_dims(inner, layout, dtype)
  except Refused as e:
    return e.why
  p = shard_inputs(layout, dtype)
  state = jax.eval_shape(inner.init, p)
  arrays, rebuild = xa.split(extra)
  try:
    closed, out_shape = jax.make_jaxpr(
        xa.updater(inner, rebuild), return_shape=True)(p, state, p, arrays)
  except Exception as e:  # noqa: BLE001 - any failure to trace is a refusal
    return (f"its update(grads, state, params) cannot be traced on the "
            f"shards: {brief(e)}")
  sharded = [s.kind == lay.SHARD for s in layout.leaves
             if s.kind != lay.STATIC]
  ins = ([jc.Taint(t) for t in sharded] + [jc.Taint(d is not None) for d in dims]
         + [jc.Taint(t) for t in sharded] + xa.taints(arrays))
  u_def = jax.tree.structure(out_shape[0])
  if (u_def != jax.tree.structure(p)
      or jax.tree.structure(out_shape[1]) != jax.tree.structure(state)):
    return "its updates or new state have another structure than its inputs"
  try:
    outs = jc.taints(closed, ins)
  except jc.NotElementwise as e:
    return str(e)
  paths = ([f"updates{jax.tree_util.keystr(k)}"
            for k, _ in jax.tree.flatten_with_path(out_shape[0])[0]]
           + [f"state{jax.tree_util.keystr(k)}"
              for k, _ in jax.tree.flatten_with_path(out_shape[1])[0]])
  for t, ok, path in zip(outs, sharded + [d is not None for d in dims], paths):
    if t.pos:
      return f"{t.pos} stored in {path}"
    if t.dep and not ok:
      return (f"{path} is not sharded but is computed from parameter-shaped "
              f"data (a whole-leaf or whole-tree statistic)")
  return None


def check_elementwise(inner: optax.GradientTransformation, params: Any,
                      num_shards: int = 2, dtype: Any = jnp.float32,
                      extra_args: dict | None = None) -> None:
  """Raises ValueError (REFUSAL, naming why) unless ``inner`` is elementwise
  on ``params`` split over ``num_shards`` (at least 2: the decision does not
  hang on the mesh size) in ``dtype``.

  ``extra_args``: None at ``tx.init``, where an update that cannot be
  traced without extra keyword arguments it takes (:func:`.extra_args.
  deferrable`) is checked with float32 scalars for the ones it misses, and
  if accepted so, checked again at its first update with the real ones
  (:func:`check_update_args`); at an update, the arguments it is given.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> check_elementwise(optax.adamw(1e-3), {"w": jnp.zeros((5, 3))}, 4)
    >>> check_elementwise(optax.lamb(1e-3), {"w": jnp.zeros((5, 3))}, 4)
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    zero1_jax.core.refusal.Refused: zero1: the inner optimizer is not elementwise (...
  """
  inner = getattr(inner, "inner", inner)   # a Zero1Transformation: its inner
  layout = lay.plan(params, max(int(num_shards), 2))
  where, why = _verdict(inner, layout, dtype, extra_args)
  if why and extra_args is None and xa.deferrable(inner, why):
    # The update needs arguments init is not given: those it names missing
    # are tried as float32 scalars (a loss value=). Accepted so: checked
    # again at the first update with the real ones. Refused so for its
    # arithmetic (polyak_sgd): refused here. Not traceable so (it needs an
    # array, a function): refused here for what it missed.
    guess: dict = {}
    w, y = where, why
    while y and xa.missing(y) - set(guess) and len(guess) < 8:
      guess.update({k: jax.ShapeDtypeStruct((), jnp.float32)
                    for k in xa.missing(y)})
      w, y = _verdict(inner, layout, dtype, guess)
    if not y:
      return
    if not y.startswith(xa.UNTRACEABLE):
      where, why = w, y
  if why:
    raise Refused(why, where)


def _verdict(inner: optax.GradientTransformation, layout: lay.Layout,
             dtype: Any, extra: dict | None) -> tuple[str, str | None]:
  """``(where, why)`` of the checks on ``layout`` with the update's extra
  arguments ``extra``; remembered (:mod:`.verdicts`)."""
  key = verdicts.key(inner, layout, dtype)   # an equal check before: its verdict
  if extra:
    sig = xa.key(extra)
    key = None if key is None or sig is None else (key, sig)
  found, verdict = verdicts.remembered(key)
  if not found:
    verdict = None
    for check in _stages(layout, dtype, extra):
      why = check(inner)
      if why:   # name the part refused, in the stage that refused the whole
        verdict = f"{blame.locate(inner, why, check)}\n{why}"
        break
    verdicts.remember(key, verdict)
  if not verdict:
    return "", None
  where, _, why = verdict.rpartition("\n")
  return where, why


def check_update_args(inner: optax.GradientTransformation, params: Any,
                      num_shards: int, dtype: Any, extra_args: dict) -> None:
  """At an update: with extra arguments, :func:`check_elementwise` with
  them (once per their names, shapes and dtypes); without, the refusal
  ``tx.init`` left to this update, if it left one."""
  if extra_args:
    check_elementwise(inner, params, num_shards, dtype, extra_args)
    return
  layout = lay.plan(params, max(int(num_shards), 2))
  key = verdicts.key(inner, layout, dtype)
  found, verdict = verdicts.remembered(key)
  if key is None and xa.takes_extra(inner):   # nothing remembered: retrace
    why = jaxpr_reason(inner, layout, dtype)
    found, verdict = True, (f"\n{why}" if xa.deferrable(inner, why) else None)
  if found and verdict:
    where, _, why = verdict.rpartition("\n")
    raise Refused(why, where or blame.locate(inner, why,
                                             _stages(layout, dtype)[0]))


def located(e: Refused, inner: optax.GradientTransformation,
            layout: lay.Layout, dtype: Any = jnp.float32) -> Refused:
  """``e`` (a refusal by :func:`state_shard_dims`) naming the refused part
  of ``inner`` (:func:`.blame.locate`)."""
  if e.where:
    return e
  return Refused(e.why, blame.locate(inner, e.why, _stages(layout, dtype)[0]))


def _stages(layout: lay.Layout, dtype: Any, extra: dict | None = None) -> list:
  """The checks in order, each ``inner -> why or None``: the jaxpr, the
  same program on whole leaves and shards, on params in their own dtypes
  and on their masters, the numeric probe."""
  def size(inner):
    try:
      owners = state_shard_dims(inner, layout, dtype)[3]
    except Refused as e:
      return e.why
    return size_reason(inner, layout, dtype, owners, extra)
  return [lambda inner: jaxpr_reason(inner, layout, dtype, extra), size,
          lambda inner: dtype_check.dtype_reason(inner, layout, dtype, extra),
          lambda inner: probe_reason(inner, layout, dtype, extra=extra)]
