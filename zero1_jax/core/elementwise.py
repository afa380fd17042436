"""Whether an inner optimizer may run on 1/N shards of each parameter.

ZeRO-1 hands the inner optimizer this device's rows of every parameter leaf.
That gives optax's result only if every number it computes for an element
depends on that element alone: an *elementwise* optimizer. Two checks decide,
and both must pass (:func:`check_elementwise`):

1. **The jaxpr** of ``inner.update(grads, state, params)`` traced on the shard
   shapes (:func:`jaxpr_reason`). Values computed from parameter-shaped data
   (gradients, parameters, sharded state) are *tainted*. Allowed on tainted
   values: elementwise primitives whose tainted operands have the output's
   shape, and identities; their other operands must be broadcasts of values
   that do not depend on where an element sits. Refused: a reduction,
   contraction, sort, cumulative op, reshape/slice/broadcast of tainted data,
   an unknown primitive, a loop or branch steered by tainted data; a value
   whose content depends on its position (``iota``, random bits drawn with a
   non-scalar shape, a constant array) meeting tainted data or reaching the
   output; and a tainted value stored in a replicated slot (a scalar state
   leaf computed from the parameters: whole-tree statistics).
2. **A numeric probe** (:func:`probe_reason`): two updates on small leaves
   with the real shard dims, whole and as N zero-padded shards, must agree on
   the updates and on *every* state leaf, scalars and PRNG keys included. It
   catches what a jaxpr hides, e.g. a scale computed from ``x.size``.

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

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero1_jax.core import layout as lay

REFUSAL = (
    "zero1: the inner optimizer is not elementwise ({why}); ZeRO-1 runs it on "
    "1/N slices of each parameter, which would silently change its result. "
    "Use it unsharded (plain data parallel), or replace that transform with "
    "an elementwise one (adam, adamw, lion, sgd, rmsprop, adagrad, ...); for "
    "gradient clipping pass zero1(..., max_grad_norm=...) instead of "
    "optax.clip_by_global_norm.")

_ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt
ceil clamp clz complex conj convert_element_type cos cosh digamma div eq erf
erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag integer_pow
is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
polygamma population_count pow real reduce_precision regularized_incomplete_beta
rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical
sign sin sinh sqrt square sub tan tanh xor zeta
""".split())
# One output per operand, equal to it.
_IDENTITY = frozenset("copy copy_p optimization_barrier sharding_constraint "
                      "device_put mesh_cast reshard pvary pcast".split())
# Produce values that depend on the position of an element (non-scalar).
_POSITIONAL = frozenset("iota random_bits rng_uniform rng_bit_generator "
                        "threefry2x32".split())
_KINDS = (
    ("reduce_ argmax argmin", "reduces across elements"),
    ("dot_general conv_general_dilated", "contracts across elements"),
    ("sort cumsum cumprod cummax cummin cumlogsumexp top_k",
     "sorts or accumulates along an axis"),
    ("broadcast_in_dim reshape squeeze expand_dims transpose slice "
     "dynamic_slice dynamic_update_slice gather scatter concatenate pad rev "
     "split", "moves elements between positions"),
)


class _NotElementwise(Exception):
  pass


class Refused(ValueError):
  """The REFUSAL ValueError; ``why`` names the reason."""

  def __init__(self, why: str):
    super().__init__(REFUSAL.format(why=why))
    self.why = why


def _brief(e: Exception) -> str:
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def _kind(prim: str) -> str:
  for names, what in _KINDS:
    if any(prim == n or (n.endswith("_") and prim.startswith(n))
           for n in names.split()):
      return what
  return "not known to be elementwise"


class _Taint:
  """Per value: ``dep`` (computed from parameter-shaped data) and ``pos``
  (why its content depends on an element's position, or None)."""
  __slots__ = ("dep", "pos")

  def __init__(self, dep=False, pos=None):
    self.dep, self.pos = dep, pos

  def __or__(self, o):
    return _Taint(self.dep or o.dep, self.pos or o.pos)

  def __eq__(self, o):
    return (self.dep, bool(self.pos)) == (o.dep, bool(o.pos))


_CLEAN = _Taint()


def _size(aval) -> int:
  return int(np.prod(getattr(aval, "shape", ()) or (), dtype=np.int64))


def _sub_jaxprs(eqn):
  """(jaxpr, consts) of call-like sub-jaxprs taking exactly eqn's operands."""
  for v in eqn.params.values():
    j = getattr(v, "jaxpr", v)
    if (hasattr(j, "eqns") and len(j.invars) == len(eqn.invars)
        and len(j.outvars) == len(eqn.outvars)):
      return j, getattr(v, "consts", ())
  return None


def _open(cj):
  return (cj.jaxpr, cj.consts) if hasattr(cj, "consts") else (cj, ())


def _run(jaxpr, consts, ins: list) -> list:
  """Taints of ``jaxpr``'s outputs given its inputs' taints."""
  env: dict = {}
  for v, c in zip(jaxpr.constvars, consts):
    pos = (f"a constant array of shape {np.shape(c)}"
           if np.size(c) > 1 and np.ptp(np.asarray(c).ravel()) != 0 else None)
    env[v] = _Taint(False, pos)
  for v, t in zip(jaxpr.invars, ins):
    env[v] = t
  read = lambda v: env.get(v, _CLEAN) if not hasattr(v, "val") else _CLEAN
  for eqn in jaxpr.eqns:
    outs = _eqn(eqn, [read(v) for v in eqn.invars])
    for v, t in zip(eqn.outvars, outs):
      env[v] = t
  return [read(v) for v in jaxpr.outvars]


def _fixpoint(body, carry: list) -> list:
  for _ in range(len(carry) + 2):
    new = [a | b for a, b in zip(carry, body(carry))]
    if new == carry:
      return new
    carry = new
  return carry


def _eqn(eqn, ins: list) -> list:
  prim = eqn.primitive.name
  p = eqn.params
  avals = [v.aval for v in eqn.outvars]
  if prim == "cond":
    if ins[0].dep or ins[0].pos:
      raise _NotElementwise("a branch chosen by parameter-shaped data")
    outs = [_CLEAN] * len(avals)
    for br in p["branches"]:
      outs = [a | b for a, b in zip(outs, _run(*_open(br), ins[1:]))]
    return outs
  if prim == "while":
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cc, bc, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    carry = _fixpoint(lambda c: _run(*_open(p["body_jaxpr"]), bc + c), carry)
    (pred,) = _run(*_open(p["cond_jaxpr"]), cc + carry)
    if pred.dep or pred.pos:
      raise _NotElementwise("a loop whose length depends on parameter-shaped "
                            "data")
    return carry
  if prim == "scan":
    nc, nk = p["num_consts"], p["num_carry"]
    consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
    if any(t.dep or t.pos for t in xs):
      raise _NotElementwise("a scan over the rows of parameter-shaped data")
    body = lambda c: _run(*_open(p["jaxpr"]), consts + c + xs)[:nk]
    carry = _fixpoint(body, carry)
    ys = _run(*_open(p["jaxpr"]), consts + carry + xs)[nk:]
    if any(t.dep for t in ys):
      raise _NotElementwise("a scan stacking parameter-shaped data")
    return carry + ys
  sub = _sub_jaxprs(eqn)
  if sub is not None:
    return _run(sub[0], sub[1], ins)
  dep = any(t.dep for t in ins)
  pos = next((t.pos for t in ins if t.pos), None)
  if prim in _POSITIONAL and any(_size(a) > 1 for a in avals):
    what = "random numbers" if prim != "iota" else "an iota"
    pos = f"{what} drawn with a shape of the shard ({prim})"
  if dep and pos:
    raise _NotElementwise(f"{pos} combined with parameter-shaped data")
  if not dep:
    return [_Taint(False, pos)] * len(avals)
  if prim in _IDENTITY:
    return list(ins[:len(avals)])
  if prim in _ELEMENTWISE:
    for v, t in zip(eqn.invars, ins):
      if t.dep and tuple(v.aval.shape) != tuple(avals[0].shape):
        raise _NotElementwise(f"{prim} broadcasts parameter-shaped data")
    return [_Taint(True, None)] * len(avals)
  raise _NotElementwise(f"{prim} on parameter-shaped data ({_kind(prim)})")


def shard_inputs(layout: lay.Layout, dtype: Any) -> Any:
  """The param-structured tree of ShapeDtypeStructs the inner optimizer sees
  on one device (None at static leaves)."""
  return layout.inner_tree([jax.ShapeDtypeStruct(s.shard_shape, dtype)
                            for s in layout.leaves])


def state_shard_dims(inner: optax.GradientTransformation, layout: lay.Layout,
                     dtype: Any = jnp.float32) -> tuple[Any, list, list]:
  """``(treedef, dims, shapes)`` of ``inner``'s state on ``layout``'s shards: per
  state leaf, the dim it is sharded on like its parameter, or None
  (replicated: counts, hyperparameters, keys, scalar-parameter moments).

  ``inner.init`` is evaluated abstractly on the shard shapes and again with
  leaf ``i``'s shard dim grown by ``i + 1``; a leaf whose shape moves must be
  shaped like leaf ``i``'s shard in both, else :class:`Refused`.
  """
  def shards(grow: bool):
    out = []
    for i, s in enumerate(layout.leaves):
      shape = list(s.shard_shape)
      if grow and s.kind == lay.SHARD:
        shape[s.dim] += i + 1
      out.append(jax.ShapeDtypeStruct(tuple(shape), dtype))
    return layout.inner_tree(out)

  try:
    a, b = (jax.eval_shape(inner.init, shards(g)) for g in (False, True))
  except Exception as e:  # noqa: BLE001 - an init that fails is refused
    raise Refused(f"its init fails on the shards: {_brief(e)}") from e
  a_leaves, a_def = jax.tree.flatten_with_path(a)
  b_leaves, b_def = jax.tree.flatten(b)
  if a_def != b_def:
    raise Refused("its state structure depends on the parameter shapes")
  by_grow = {i + 1: s for i, s in enumerate(layout.leaves) if s.kind == lay.SHARD}
  dims = []
  for (path, x), y in zip(a_leaves, b_leaves):
    if x.shape == y.shape:
      dims.append(None)
      continue
    delta = [j for j, (u, v) in enumerate(zip(x.shape, y.shape)) if u != v]
    hit = (by_grow.get(y.shape[delta[0]] - x.shape[delta[0]])
           if len(x.shape) == len(y.shape) and len(delta) == 1 else None)
    if hit is None or x.shape != hit.shard_shape:
      raise Refused(f"state leaf {jax.tree_util.keystr(path)} of shape "
                    f"{x.shape} is not shaped like any parameter shard")
    dims.append(hit.dim)
  return a_def, dims, [x.shape for _, x in a_leaves]


def jaxpr_reason(inner: optax.GradientTransformation, layout: lay.Layout,
                 dtype: Any = jnp.float32) -> str | None:
  """Why ``inner.update`` on ``layout``'s shards is not elementwise, read
  from its jaxpr; None if every step is."""
  try:
    _, dims, _ = state_shard_dims(inner, layout, dtype)
  except Refused as e:
    return e.why
  p = shard_inputs(layout, dtype)
  state = jax.eval_shape(inner.init, p)
  try:
    closed, out_shape = jax.make_jaxpr(
        lambda g, s, q: inner.update(g, s, q), return_shape=True)(p, state, p)
  except Exception as e:  # noqa: BLE001 - any failure to trace is a refusal
    return (f"its update(grads, state, params) cannot be traced on the "
            f"shards: {_brief(e)}")
  sharded = [s.kind == lay.SHARD for s in layout.leaves
             if s.kind != lay.STATIC]
  ins = ([_Taint(t) for t in sharded] + [_Taint(d is not None) for d in dims]
         + [_Taint(t) for t in sharded])
  u_def = jax.tree.structure(out_shape[0])
  if (u_def != jax.tree.structure(p)
      or jax.tree.structure(out_shape[1]) != jax.tree.structure(state)):
    return "its updates or new state have another structure than its inputs"
  try:
    outs = _run(*_open(closed), ins)
  except _NotElementwise as e:
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


def _comparable(x) -> np.ndarray:
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def probe_reason(inner: optax.GradientTransformation, layout: lay.Layout,
                 dtype: Any = jnp.float32, seed: int = 0) -> str | None:
  """Two updates on ``probe_layout`` leaves, whole vs. as N shards (zero
  padded, like zero1's master shards): why they differ, or None."""
  n = layout.num_shards
  small = probe_layout(layout, n)
  try:
    _, dims, _ = state_shard_dims(inner, small, dtype)
  except Refused as e:
    return e.why
  rng = np.random.default_rng(seed)
  full_p, full_g = [], []
  for s in small.leaves:
    full_p.append(rng.normal(size=s.shape).astype(dtype))
    full_g.append((rng.normal(size=s.shape) * 1e3).astype(dtype))

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

  def run(p, g):
    state = inner.init(p)
    u, state = inner.update(g, state, p)
    u2, state = inner.update(g, state, optax.apply_updates(p, u))
    return jax.tree.leaves((u, u2, state))

  axes = small.inner_tree([0 if s.kind == lay.SHARD else None
                           for s in small.leaves])
  try:
    tree = lambda xs: small.inner_tree([jnp.asarray(x) for x in xs])
    both = jax.jit(lambda p, g, sp, sg: (
        run(p, g), jax.vmap(run, in_axes=(axes, axes), axis_size=n)(sp, sg)))
    whole, parts = both(tree(full_p), tree(full_g), tree(split(full_p)),
                        tree(split(full_g)))
  except Exception as e:  # noqa: BLE001 - an update that fails is refused
    return f"its update fails on the probe: {_brief(e)}"
  u_dims = [s.dim if s.kind == lay.SHARD else None for s in small.leaves
            if s.kind != lay.STATIC]
  for i, (w, ps, d) in enumerate(zip(whole, parts, u_dims * 2 + dims)):
    w, ps = _comparable(w), _comparable(ps)
    if d is None:
      got = ps
      w = np.broadcast_to(w, ps.shape)
    else:
      got = np.concatenate(list(ps), axis=d)
      got = got[tuple(slice(0, m) for m in w.shape)]
    what = ("its update" if i < 2 * len(u_dims) else "its state")
    if got.shape != w.shape:
      return f"{what} has another shape on a shard"
    if jnp.issubdtype(w.dtype, jnp.inexact):
      scale = float(np.max(np.abs(w), initial=0.0, where=np.isfinite(w)))
      ok = np.allclose(got, w, rtol=1e-5, atol=1e-6 * scale, equal_nan=True)
    else:
      ok = np.array_equal(got, w)
    if not ok:
      return (f"{what} on N={n} shards differs from the same slices of "
              f"{what} on the whole parameters (leaf {i})")
  return None


def check_elementwise(inner: optax.GradientTransformation, params: Any,
                      num_shards: int = 2, dtype: Any = jnp.float32) -> None:
  """Raises ValueError (REFUSAL, naming why) unless ``inner`` is elementwise
  on ``params`` split over ``num_shards`` (at least 2: the decision does not
  hang on the mesh size) in ``dtype``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> check_elementwise(optax.adamw(1e-3), {"w": jnp.zeros((5, 3))}, 4)
    >>> check_elementwise(optax.lamb(1e-3), {"w": jnp.zeros((5, 3))}, 4)
    Traceback (most recent call last):
    ...
    ValueError: zero1: the inner optimizer is not elementwise (...
  """
  inner = getattr(inner, "inner", inner)   # a Zero1Transformation: its inner
  layout = lay.plan(params, max(int(num_shards), 2))
  why = jaxpr_reason(inner, layout, dtype) or probe_reason(inner, layout, dtype)
  if why:
    raise Refused(why)
