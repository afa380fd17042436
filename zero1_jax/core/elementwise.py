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
2. **A numeric probe** (:func:`probe_reason`): two updates on small leaves
   with the real shard dims, whole and as N zero-padded shards, must agree on
   the updates and on *every* state leaf, scalars and PRNG keys included. It
   catches what a jaxpr hides, e.g. a scale computed from ``x.size``.

Between them, :func:`.size_check.size_reason` refuses an optimizer that
decides by a leaf's size or shape (factored moments, a mask by size): on a
shard it would run another, still elementwise, computation.

:func:`state_shard_dims` tells which state leaves are sharded (and refuses
state not shaped like the parameter shards: adafactor's factored moments).

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

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero1_jax.core import blame
from zero1_jax.core import extra_args as xa
from zero1_jax.core import jaxpr_check as jc
from zero1_jax.core import layout as lay
from zero1_jax.core import verdicts
from zero1_jax.core.refusal import (CANNOT_RUN, REFUSAL, Refused, brief,
                                     refusal)
from zero1_jax.core.size_check import size_reason

def leaf_dtype(spec: lay.LeafSpec, dtype: Any) -> np.dtype:
  """The dtype the inner optimizer sees at a leaf: its master dtype
  (:func:`.layout.master_dtype`) for the configured master ``dtype``."""
  return lay.master_dtype(spec.dtype, dtype)


def shard_inputs(layout: lay.Layout, dtype: Any) -> Any:
  """The param-structured tree of ShapeDtypeStructs the inner optimizer sees
  on one device (None at static leaves)."""
  return layout.inner_tree([jax.ShapeDtypeStruct(s.shard_shape,
                                                 leaf_dtype(s, dtype))
                            for s in layout.leaves])


def _handed(layout: lay.Layout) -> str:
  """What zero1 hands the inner optimizer, in words (for init failures)."""
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(
      layout.treedef.unflatten(range(len(layout.leaves))))[0]]
  static = [p for p, s in zip(paths, layout.leaves) if s.kind == lay.STATIC]
  if not static:
    return "the parameter shards zero1 hands it"
  return ("the parameter tree zero1 hands it (None at the integer and "
          f"zero-size leaves {', '.join(static)}, which it never updates)")


def state_shard_dims(inner: optax.GradientTransformation, layout: lay.Layout,
                     dtype: Any = jnp.float32) -> tuple[Any, list, list, list]:
  """``(treedef, dims, shapes, owners)`` of ``inner``'s state on ``layout``'s
  shards: per state leaf, the dim it is sharded on like its parameter, or
  None (replicated: counts, hyperparameters, keys, scalar-parameter moments,
  moments of leaves not split over the data axis); and the index of the
  parameter leaf it is shaped like, or None (nothing parameter-shaped).

  ``inner.init`` is evaluated abstractly on the shard shapes and again with
  leaf ``i``'s shard dim (dim 0 for an unsplit, non-scalar leaf) grown by
  ``i + 1``; a leaf whose shape moves must be shaped like leaf ``i``'s shard
  in both, else :class:`Refused`.
  """
  def grows(s):
    return s.kind == lay.SHARD or (s.kind == lay.REPLICATE and s.shape)

  def shards(grow: bool):
    out = []
    for i, s in enumerate(layout.leaves):
      shape = list(s.shard_shape)
      if grow and grows(s):
        shape[max(s.dim, 0)] += i + 1
      out.append(jax.ShapeDtypeStruct(tuple(shape), leaf_dtype(s, dtype)))
    return layout.inner_tree(out)

  try:
    a, b = (jax.eval_shape(inner.init, shards(g)) for g in (False, True))
  except Exception as e:  # noqa: BLE001 - an init that fails is refused
    raise Refused(f"its init fails on {_handed(layout)}: {brief(e)}") from e
  a_leaves, a_def = jax.tree.flatten_with_path(a)
  b_leaves, b_def = jax.tree.flatten(b)
  if a_def != b_def:
    raise Refused("its state structure depends on the parameter shapes")
  by_grow = {i + 1: i for i, s in enumerate(layout.leaves) if grows(s)}
  dims, owners = [], []
  for (path, x), y in zip(a_leaves, b_leaves):
    if x.shape == y.shape:
      dims.append(None)
      owners.append(None)
      continue
    delta = [j for j, (u, v) in enumerate(zip(x.shape, y.shape)) if u != v]
    i = (by_grow.get(y.shape[delta[0]] - x.shape[delta[0]])
         if len(x.shape) == len(y.shape) and len(delta) == 1 else None)
    hit = None if i is None else layout.leaves[i]
    if hit is None or x.shape != hit.shard_shape:
      raise Refused(f"state leaf {jax.tree_util.keystr(path)} of shape "
                    f"{x.shape} is not shaped like any parameter shard")
    dims.append(hit.dim if hit.kind == lay.SHARD else None)
    owners.append(i)
  return a_def, dims, [x.shape for _, x in a_leaves], owners


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


def probe_layout(layout: lay.Layout, n: int) -> lay.Layout:
  """Small stand-ins for ``layout``'s leaves, split on the same (real) shard
  dims over ``n``: other dims capped at 3, the shard dim kept when at most
  4n rows, else 3n rows plus its remainder mod n (the same padding)."""
  leaves = []
  for s in layout.leaves:
    if s.kind != lay.SHARD:
      leaves.append(s)
      continue
    shape = [min(x, 3) for x in s.shape]
    rows = s.shape[s.dim]
    shape[s.dim] = rows if rows <= 4 * n else 3 * n + rows % n
    per = -(-shape[s.dim] // n)
    shard = tuple(per if j == s.dim else x for j, x in enumerate(shape))
    padded = tuple(per * n if j == s.dim else x for j, x in enumerate(shape))
    leaves.append(lay.LeafSpec(lay.SHARD, tuple(shape), s.dtype, s.dim, shard,
                               padded))
  return lay.Layout(layout.treedef, tuple(leaves), n)


# Rounding allowed between the whole and the sharded probe, in ulps of the
# value's scale (see probe_reason): 8 ulps, 9.5e-7 relative in float32.
ULPS = 8


def _max_abs(x) -> float:
  x = np.abs(np.asarray(x)).astype(np.float64)
  return float(np.max(np.abs(x), initial=0.0, where=np.isfinite(x)))


def _probe_paths(inner: optax.GradientTransformation, small: lay.Layout,
                 dtype: Any) -> list[str]:
  """Names of the probe's compared leaves: the update's (twice), then the
  state's, as ``['w1']`` / ``state[0].mu['w1']``."""
  p = shard_inputs(small, dtype)
  state = jax.eval_shape(inner.init, p)
  names = lambda tree, pre: [pre + jax.tree_util.keystr(k) for k, _ in
                             jax.tree_util.tree_flatten_with_path(tree)[0]]
  return names(p, "") * 2 + names(state, "state")


def _key_data(x):
  """A PRNG key's raw bits (comparable with ``==``); other values as they are.
  Applied inside the probe's jitted program, so that under ``jax.jit(tx.init)``
  nothing traced is left to convert."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(x)
  return x


def probe_reason(inner: optax.GradientTransformation, layout: lay.Layout,
                 dtype: Any = jnp.float32, seed: int = 0,
                 extra: dict | None = None) -> str | None:
  """Two updates on ``probe_layout`` leaves, whole vs. as N shards (zero
  padded, like zero1's master shards): why they differ, or None. ``extra``:
  the update's extra keyword arguments, passed as ones of their shapes."""
  n = layout.num_shards
  small = probe_layout(layout, n)
  try:
    _, dims, _, _ = state_shard_dims(inner, small, dtype)
  except Refused as e:
    return e.why
  rng = np.random.default_rng(seed)

  def normal(s, scale=1.0):   # complex: both parts random (elementwise data)
    dt = leaf_dtype(s, dtype)
    x = rng.normal(size=s.shape) * scale
    if jnp.issubdtype(dt, jnp.complexfloating):
      x = x + 1j * rng.normal(size=s.shape) * scale
    return x.astype(dt)

  full_p, full_g = [], []
  for s in small.leaves:
    full_p.append(normal(s))
    full_g.append(normal(s, 1e3))

  def split(xs):  # -> leaves stacked (n, *shard_shape); scalars unbatched
    out = []
    for x, s in zip(xs, small.leaves):
      if s.kind != lay.SHARD:
        out.append(x)
        continue
      pads = [(0, 0)] * x.ndim
      pads[s.dim] = (0, s.padded_shape[s.dim] - s.shape[s.dim])
      x = np.pad(x, pads)
      out.append(np.stack(np.split(x, n, axis=s.dim)))
    return out

  arrays, rebuild = xa.split(extra)
  update = xa.updater(inner, rebuild)
  values = xa.stand_ins(arrays)

  def run(p, g):
    state = inner.init(p)
    u, state = update(g, state, p, values)
    u2, state = update(g, state, optax.apply_updates(p, u), values)
    return [_key_data(x) for x in jax.tree.leaves((u, u2, state))]

  axes = small.inner_tree([0 if s.kind == lay.SHARD else None
                           for s in small.leaves])
  try:
    tree = lambda xs: small.inner_tree([jnp.asarray(x) for x in xs])
    both = jax.jit(lambda p, g, sp, sg: (
        run(p, g), jax.vmap(run, in_axes=(axes, axes), axis_size=n)(sp, sg)))
    # Concrete numbers even when tx.init is traced (jax.jit(TrainState.create)).
    # Only then: evaluating at compile time compiles each of the optimizer's
    # own jitted helpers on its own (19 programs for adam, 2.98 s against
    # 1.31 s for the first z1.init of a process).
    # Inside a shard_map (an update's extra arguments are checked there) the
    # probe's own arrays must not see its manual mesh: no mesh for them.
    traced = isinstance(jnp.zeros(()), jax.core.Tracer)
    with (jax.ensure_compile_time_eval() if traced else contextlib.nullcontext(),
          jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))
          if traced else contextlib.nullcontext()):
      whole, parts = both(tree(full_p), tree(full_g), tree(split(full_p)),
                          tree(split(full_g)))
  except Exception as e:  # noqa: BLE001 - an update that fails is refused
    return f"its update fails on the probe: {brief(e)}"
  floats = [x for x, s in zip(full_p, small.leaves) if s.kind != lay.STATIC]
  u_dims = [s.dim if s.kind == lay.SHARD else None for s in small.leaves
            if s.kind != lay.STATIC]
  for i, (w, ps, d) in enumerate(zip(whole, parts, u_dims * 2 + dims)):
    w, ps = np.asarray(w), np.asarray(ps)
    if d is None:
      got = ps
      w = np.broadcast_to(w, ps.shape)
    else:
      got = np.concatenate(list(ps), axis=d)
      got = got[tuple(slice(0, m) for m in w.shape)]
    update = i < 2 * len(u_dims)
    what = "its update" if update else "its state"
    if got.shape != w.shape:
      return f"{what} has another shape on a shard"
    if jnp.issubdtype(w.dtype, jnp.inexact):
      # The floor. Whole and sharded are two XLA programs; each may round a
      # value differently (fusion, fma, a vmapped scalar), by a few ulps of
      # the operands it was computed from. An update is computed from the
      # parameters and added back to them (schedule-free's update is
      # y_new - params: at a warmup step with lr ~ 0 it is ~1e-7 of pure
      # rounding of params), so its ulps are the parameter's, not its own:
      # the floor is ULPS ulps of max(|update|, |param|). A state leaf is
      # carried as it is, so its floor is ULPS ulps of its own magnitude.
      # What a non-elementwise optimizer changes (a whole-leaf statistic,
      # a size-dependent scale) moves the update by a fraction of itself, not
      # by a few ulps of the parameters: with the probe's gradients (1e3 x
      # the params) any update that moves the weights beyond rounding shows.
      # (An update the schedule keeps ~0 in both probe steps shows nothing;
      # the jaxpr check and the state leaves, at their own scale, still do.)
      scale = _max_abs(w)
      if update:
        scale = max(scale, _max_abs(floats[i % len(u_dims)]))
      atol = ULPS * float(jnp.finfo(w.dtype).eps) * scale
      ok = np.allclose(got, w, rtol=1e-5, atol=atol, equal_nan=True)
    else:
      atol, ok = 0.0, np.array_equal(got, w)
    if not ok:
      diff = np.abs(got.astype(np.complex128) - w).astype(np.float64)
      err = float(np.max(diff, initial=0.0, where=np.isfinite(w)))
      step = f"step {i // len(u_dims) + 1}, " if update else ""
      path = _probe_paths(inner, small, dtype)[i]
      return (f"{what} on N={n} shards differs from the same slices of "
              f"{what} on the whole parameters at {path} ({step}by {err:.3g}, "
              f"beyond rounding: {atol:.3g})")
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
  same program on whole leaves and shards, the numeric probe."""
  def size(inner):
    try:
      owners = state_shard_dims(inner, layout, dtype)[3]
    except Refused as e:
      return e.why
    return size_reason(inner, layout, dtype, owners, extra)
  return [lambda inner: jaxpr_reason(inner, layout, dtype, extra), size,
          lambda inner: probe_reason(inner, layout, dtype, extra=extra)]
