"""Whether an inner optimizer does on a 1/N shard what it does on the whole leaf.

An optimizer, a mask or a ``multi_transform`` label may decide in Python, by
a leaf's size or shape, what to compute: ``optax.scale_by_factored_rms``
factors the second moment of leaves whose two largest dims reach
``min_dim_size_to_factor`` (128), ``mask=lambda p: p.size >= 256`` decays
only large leaves. Under ZeRO-1 the inner optimizer sees this device's rows,
so the decision flips with N: a (256, 256) kernel is factored whole but not as
a (32, 256) shard at N=8, a 512-element kernel is decayed whole but not as
64-element slices, and ``multi_transform({"big": sgd(0.01), "small":
sgd(0.1)}, labels by x.size > 64)`` runs ``sgd(0.1)`` on every shard of a
128-element kernel. Each shard's computation is then elementwise, so neither
the jaxpr check (it reads the program on the shards) nor the numeric probe
(it runs small stand-in leaves, which cross no real size threshold) can see
that it is another computation.

:func:`size_reason` traces ``inner.init`` and ``inner.update`` abstractly (no
compile, no memory) on the real whole parameters and on their real shards.
The state must have the same structure, each state leaf shaped like a
parameter shard must be shaped like the whole parameter there, and each of
init and update must be one program on both (:func:`compare`): the same
operations in the same order on the same operands, equal literals, constants
and scalar parameters, and every shape the same or a parameter's whole shape
where the shard has its shard shape. Under tracing every Python decision by
size shows as one of those, so a program that passes is the same
computation on every element (the jaxpr check has made it elementwise).

Example:
  >>> import jax.numpy as jnp, optax
  >>> from zero1_jax.core import layout as lay
  >>> from zero1_jax.core.state_dims import state_shard_dims
  >>> L = lay.plan({"w": jnp.zeros((256, 256))}, 8)
  >>> why = lambda tx: size_reason(tx, L, jnp.float32, state_shard_dims(tx, L)[3])
  >>> why(optax.adam(1e-3)) is None
  True
  >>> print(why(optax.scale_by_factored_rms()))
  ... # doctest: +ELLIPSIS
  state leaf .v_row['w'] has shape (256,) for the whole parameter ['w'] (256, 256) but (1,) for its 1/N shard ...
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero1_jax.core import extra_args as xa
from zero1_jax.core import layout as lay

FIX = ("decide by ndim or by path instead of by size or shape (under zero1 "
       "the optimizer, its masks and labels see 1/N of each parameter)")


def _inputs(layout: lay.Layout, dtype: Any, whole: bool) -> Any:
  return layout.inner_tree([
      jax.ShapeDtypeStruct(s.shape if whole else s.shard_shape,
                           lay.master_dtype(s.dtype, dtype))
      for s in layout.leaves])


# Equation parameters compared by value (shapes, axes and sub-programs are
# compared on their own terms below).
_SCALARS = (bool, int, float, complex, str, np.dtype, np.generic)


class Differ(Exception):
  """Where the two programs part: each side's equation, in words."""

  def __init__(self, a: str, b: str):
    super().__init__(a)
    self.a, self.b = a, b


def _num(x) -> str:
  x = np.asarray(x)
  return (f"{x.item():.6g}" if x.size == 1 and x.dtype.kind in "fc"
          else str(x.item()) if x.size == 1 else f"an array {x.shape}")


def _show(eqn, name) -> str:
  """``prim[param=...](operands) -> dtype[shape]`` with operands named by
  ``name`` (a parameter's path, a literal's value, ``vK`` a temporary)."""
  params = ", ".join(f"{k}={v}" for k, v in eqn.params.items()
                     if isinstance(v, _SCALARS) and v is not None and k != "name")
  ops = ", ".join(_num(v.val) if hasattr(v, "val") else name(v)
                  for v in eqn.invars)
  outs = ", ".join(str(v.aval.str_short()) if hasattr(v.aval, "str_short")
                   else str(v.aval) for v in eqn.outvars)
  return f"`{eqn.primitive}{f'[{params}]' if params else ''}({ops}) -> {outs}`"


def _subs(v) -> list:
  """The sub-programs in an equation parameter: a jaxpr, a closed one, or a
  tuple of them (``cond``'s branches)."""
  return [j for j in (v if isinstance(v, (tuple, list)) else (v,))
          if hasattr(getattr(j, "jaxpr", j), "eqns")]


def _same_value(x, y, pairs: set, dtypes: dict | None = None) -> bool:
  """Two constants alike: equal (dtype too), or of a parameter's whole and
  shard shapes and each one value throughout (``zeros_like``), the same.
  ``dtypes``: see :func:`compare`; ``x`` in a parameter's own dtype is
  alike ``y`` in its master's if it is ``y`` rounded, or the same property
  of its dtype (``finfo(dtype).eps``)."""
  x, y = np.asarray(x), np.asarray(y)
  if x.dtype != y.dtype:
    if not dtypes or dtypes.get(x.dtype) != y.dtype:
      return False
    if x.shape != y.shape:
      return False
    fx, fy = jnp.finfo(x.dtype), jnp.finfo(y.dtype)
    with np.errstate(over="ignore"):   # fp32's max is bf16's inf: finfo's
      rounded = y.astype(x.dtype)
    return bool(np.array_equal(x, rounded, equal_nan=True)) or any(
        x.size == 1 and x.item() == getattr(fx, k) and y.item() == getattr(fy, k)
        for k in ("eps", "tiny", "max", "min", "smallest_normal", "resolution"))
  if x.shape == y.shape:
    return bool(np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))
  if (x.shape, y.shape) not in pairs or not x.size or not y.size:
    return False
  return _same_value(x.ravel()[0], y.ravel()[0], pairs) and bool(
      np.all(x == x.ravel()[0]) and np.all(y == y.ravel()[0]))


def compare(a, b, pairs: set, names: dict | None = None,
             dtypes: dict | None = None) -> None:
  """Raises :class:`Differ` unless the closed jaxprs ``a`` (traced on the
  whole parameters) and ``b`` (on their shards) are one program: the same
  equations in the same order on the same operands (values numbered as they
  are defined), equal literals, constants and scalar parameters, alike
  sub-programs, and every value of the same dtype and rank, its shape the
  same in both or, in ``a``, a parameter's whole shape where ``b`` has that
  parameter's shard shape (``pairs``). ``names``: input number -> what to
  call it in the message (``grads['w']``). ``dtypes``: a dtype of ``a``
  -> the one ``b`` has in its place (``a`` traced on parameters in their
  own dtypes, ``b`` on their masters: bfloat16 -> float32); a conversion
  between such a pair is no operation, and a literal in it is ``b``'s
  rounded (:func:`_same_value`)."""
  ja, ca = (a.jaxpr, a.consts) if hasattr(a, "consts") else (a, ())
  jb, cb = (b.jaxpr, b.consts) if hasattr(b, "consts") else (b, ())
  names, dtypes = names or {}, dtypes or {}
  if len(ca) != len(cb) or not all(_same_value(x, y, pairs, dtypes)
                                   for x, y in zip(ca, cb)):
    raise Differ("the constants it closes over", "other ones")
  ids_a, ids_b = {}, {}
  canon = lambda d: dtypes.get(d, d)
  eqns_a, alias_a = _unconverted(ja.eqns, canon)
  eqns_b, alias_b = _unconverted(jb.eqns, canon)
  first = len(ja.constvars)

  def define(u, v):
    ids_a[u] = ids_b[v] = len(ids_a)

  def name_in(ids):
    return lambda v: names.get(ids.get(v, -1) - first, f"v{ids.get(v, '?')}")

  def differ(ea, eb):
    return Differ(_show(ea, name_in(ids_a)) if ea is not None else "nothing",
                   _show(eb, name_in(ids_b)) if eb is not None else "nothing")

  def alike(u, v) -> bool:   # the same operand: one value, or equal literals
    if hasattr(u, "val") or hasattr(v, "val"):
      return (hasattr(u, "val") and hasattr(v, "val")
              and _same_value(u.val, v.val, pairs, dtypes))
    u, v = alias_a.get(u, u), alias_b.get(v, v)
    return u in ids_a and v in ids_b and ids_a[u] == ids_b[v]

  def shaped(u, v) -> bool:
    x, y = u.aval, v.aval
    sx, sy = tuple(getattr(x, "shape", ())), tuple(getattr(y, "shape", ()))
    dx, dy = getattr(x, "dtype", None), getattr(y, "dtype", None)
    return ((dx == dy or canon(dx) == dy)   # an explicit bf16 stays one
            and len(sx) == len(sy) and (sx == sy or (sx, sy) in pairs))

  for u, v in zip(ja.constvars + ja.invars, jb.constvars + jb.invars):
    define(u, v)
  for ea, eb in zip(eqns_a, eqns_b):
    if (ea.primitive != eb.primitive or sorted(ea.params) != sorted(eb.params)
        or len(ea.invars) != len(eb.invars)
        or len(ea.outvars) != len(eb.outvars)
        or not all(map(alike, ea.invars, eb.invars))
        or not all(map(shaped, ea.outvars, eb.outvars))):
      raise differ(ea, eb)
    for k, pa in ea.params.items():
      pb = eb.params[k]
      sa, sb = _subs(pa), _subs(pb)
      if isinstance(pa, np.dtype) and isinstance(pb, np.dtype) and pa != pb:
        pa = canon(pa)
      if (isinstance(pa, _SCALARS) and not (type(pa) is type(pb) and pa == pb)
          or len(sa) != len(sb)):
        raise differ(ea, eb)
      for x, y in zip(sa, sb):
        if dtypes and _draws_bits(x):   # random numbers at the dtype's width
          continue
        try:
          compare(x, y, pairs, dtypes=dtypes)
        except Differ:
          raise differ(ea, eb) from None
    for u, v in zip(ea.outvars, eb.outvars):
      define(u, v)
  if len(eqns_a) != len(eqns_b):
    k = min(len(eqns_a), len(eqns_b))
    raise differ(eqns_a[k] if k < len(eqns_a) else None,
                 eqns_b[k] if k < len(eqns_b) else None)
  if len(ja.outvars) != len(jb.outvars) or not all(
      map(alike, ja.outvars, jb.outvars)):
    raise Differ("its results in one order", "in another")


def _draws_bits(j) -> bool:
  """Whether the (closed) jaxpr ``j`` draws random bits: ``normal(key,
  shape, dtype)`` draws 16 bits for a bf16 value and 32 for its fp32
  master, another program for the same draw (compared at its call only)."""
  return any(e.primitive.name == "random_bits" or any(
      _draws_bits(x) for v in e.params.values() for x in _subs(v))
      for e in getattr(j, "jaxpr", j).eqns)


def _unconverted(eqns, canon) -> tuple[list, dict]:
  """``eqns`` less the conversions that are none under ``canon`` (bfloat16
  to its float32 master and back, a change of weak type), and the value
  each one's result stands for."""
  kept, alias = [], {}
  for e in eqns:
    if (e.primitive.name == "convert_element_type" and not hasattr(
        e.invars[0], "val") and canon(e.invars[0].aval.dtype)
        == canon(e.outvars[0].aval.dtype)):
      alias[e.outvars[0]] = alias.get(e.invars[0], e.invars[0])
    else:
      kept.append(e)
  return kept, alias


def _differs(what: str, a, b, pairs: set, names: dict) -> str | None:
  """Why ``what`` (``"update"``, ``"init"``) computes another program on the
  whole parameters (closed jaxpr ``a``) than on the shards (``b``), or None."""
  try:
    compare(a, b, pairs, names)
  except Differ as d:
    return (f"its {what} runs other operations on the whole parameters than "
            f"on a shard ({d.a} against {d.b}): a mask, label, constant or "
            f"branch decided by size or shape; {FIX}")
  return None


def input_names(**trees) -> dict:
  """Input number of a traced function of ``trees`` (in order) -> its path."""
  out = []
  for pre, tree in trees.items():
    out += [pre + jax.tree_util.keystr(k)
            for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return dict(enumerate(out))


def _program(fn, *args):
  return jax.make_jaxpr(fn)(*args)


def size_reason(inner: optax.GradientTransformation, layout: lay.Layout,
                dtype: Any, owners: Sequence[int | None],
                extra: dict | None = None) -> str | None:
  """Why ``inner`` computes something else on ``layout``'s shards than on
  the whole parameters, or None. ``owners``: per state leaf on the shards,
  the parameter leaf it is shaped like, or None
  (:func:`.state_dims.state_shard_dims`); ``extra``: the update's extra
  keyword arguments (:mod:`.extra_args`)."""
  whole, shards = _inputs(layout, dtype, True), _inputs(layout, dtype, False)
  try:
    s_whole = jax.eval_shape(inner.init, whole)
  except Exception as e:  # noqa: BLE001 - the shards' init succeeded
    return (f"its init fails on the whole parameters but not on a shard "
            f"({type(e).__name__}); {FIX}")
  s_shard = jax.eval_shape(inner.init, shards)
  w_leaves, w_def = jax.tree.flatten_with_path(s_whole)
  s_leaves, s_def = jax.tree.flatten(s_shard)
  if w_def != s_def:
    return (f"its state has another structure for the whole parameters than "
            f"for a shard (a mask or label by size?); {FIX}")
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(
      layout.treedef.unflatten(range(len(layout.leaves))))[0]]
  for (path, w), s, i in zip(w_leaves, s_leaves, owners):
    want = s.shape if i is None else layout.leaves[i].shape
    if w.shape != want:
      name = jax.tree_util.keystr(path)
      if i is None:   # not shaped like a shard: the parameter its path ends in
        i = max((j for j, p in enumerate(paths) if name.endswith(p)),
                key=lambda j: len(paths[j]), default=None)
      where = ("parameters but {} for their 1/N shards" if i is None else
               f"parameter {paths[i]} {layout.leaves[i].shape} but {{}} for "
               f"its 1/N shard").format(s.shape)
      return (f"state leaf {name} has shape {w.shape} "
              f"for the whole {where} (factored moments, as optax.adafactor and "
              f"scale_by_factored_rms keep for large leaves, or a choice by "
              f"size); {FIX}")
  pairs = {(s.shape, s.shard_shape) for s in layout.leaves
           if s.kind != lay.STATIC}
  arrays, rebuild = xa.split(extra)
  update = xa.updater(inner, rebuild)
  return (_differs("init", _program(inner.init, whole),
                   _program(inner.init, shards), pairs, input_names(params=whole))
          or _differs("update", _program(update, whole, s_whole, whole, arrays),
                      _program(update, shards, s_shard, shards, arrays), pairs,
                      input_names(grads=whole, state=s_whole, params=whole,
                             extra=arrays)))
