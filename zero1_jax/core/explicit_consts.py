"""Arrays an optimizer closes over that ``shard_map`` cannot close over.

An optimizer built under ``jax.set_mesh`` on a mesh with ``Explicit`` axes
(``jax.make_mesh``'s default) keeps the arrays made there placed on that
mesh: ``optax.inject_hyperparams(optax.adam)(learning_rate=jnp.asarray(1e-3))``
closes over a scalar typed ``{Explicit: ('data',)}``. zero1 runs the
optimizer inside a ``shard_map`` (``tx.init`` / ``tx.update`` in plain jit,
``z1.init``, ``z1.train_step``), and JAX refuses to close over such an input
there (``NotImplementedError: Closing over inputs to shard_map where the
input is sharded on `Explicit` axes is not implemented``).

:func:`movable` returns the optimizer with each such array taken off the
mesh: a weakly typed scalar (``jnp.asarray(1e-3)``) as its Python scalar,
any other array as an uncommitted array of the same dtype and values. Both
are constants that ``shard_map`` and plain jit under the mesh take alike.
(An array moved to an ``Auto`` copy of the mesh is refused by jit under the
``Explicit`` one; a non-scalar weakly typed array becomes strongly typed.)
It follows what defines an optax transformation: the ``init`` / ``update``
functions, their closures and defaults, ``functools.partial`` arguments,
tuples, lists, dicts and NamedTuples (nested transformations). Functions are
copied, never changed: the caller's optimizer keeps its arrays. Nothing to
move: the same object back. A value of the jit being traced typed on such
a mesh (zero1 built inside the jitted step: ``optax.inject_hyperparams(
lambda lr: z1.zero1(optax.adam(lr)))``) has no value to move: refused
(:data:`TRACED`), with the form that works.

Example:
  >>> import optax
  >>> tx = optax.adam(1e-3)
  >>> movable(tx) is tx
  True
"""

from __future__ import annotations

import functools
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding


TRACED = (
    "zero1: the optimizer closes over a value of the jit being traced ({what}), "
    "on a mesh with Explicit axes: zero1 runs the optimizer inside a shard_map, "
    "which JAX does not let close over such a value. This happens when "
    "z1.zero1(...) is built inside the jitted step, e.g. "
    "optax.inject_hyperparams(lambda lr: z1.zero1(optax.adam(lr))) or a "
    "learning rate passed into jit. Build zero1 outside the jit and put "
    "inject_hyperparams inside it: "
    "z1.zero1(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)), "
    "and set opt_state.hyperparams['learning_rate'] between steps; or use a "
    "mesh with Auto axes "
    "(jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,))).")


def on_explicit_mesh(x: Any) -> bool:
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return False
  s = getattr(x, "sharding", None)
  return isinstance(s, NamedSharding) and any(
      t == AxisType.Explicit for t in s.mesh.axis_types)


def _moved(x: jax.Array) -> Any:
  """``x``'s value off the mesh: a weakly typed scalar as the Python scalar
  (weak in every jnp op, as ``x`` was), anything else as an uncommitted
  array of its dtype (``jax.device_put`` of its numpy value)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):   # typed PRNG keys
    return jax.random.wrap_key_data(
        jax.device_put(np.asarray(jax.random.key_data(x))),
        impl=jax.random.key_impl(x))
  if x.ndim == 0 and getattr(jax.typeof(x), "weak_type", False):
    return x.item()
  return jax.device_put(np.asarray(x))


def _filled(cell) -> bool:
  try:
    cell.cell_contents
  except ValueError:   # an empty cell (a name not yet bound)
    return False
  return True


def _function(f: types.FunctionType, memo: dict, found: list) -> types.FunctionType:
  """``f``, or a copy whose closure cells and defaults hold the walked
  values where any of them changed."""
  cells = [c for c in (f.__closure__ or ()) if _filled(c)]
  old = [c.cell_contents for c in cells]
  new = [_walk(v, memo, found) for v in old]
  defaults = _walk(f.__defaults__, memo, found)
  kwdefaults = _walk(f.__kwdefaults__, memo, found)
  if (all(a is b for a, b in zip(old, new)) and defaults is f.__defaults__
      and kwdefaults is f.__kwdefaults__):
    return f
  moved = dict(zip(map(id, cells), new))
  closure = tuple(types.CellType(moved[id(c)]) if id(c) in moved else c
                  for c in (f.__closure__ or ()))
  g = types.FunctionType(f.__code__, f.__globals__, f.__name__, defaults,
                         closure or None)
  g.__kwdefaults__ = kwdefaults
  g.__dict__.update(f.__dict__)
  g.__qualname__, g.__module__, g.__doc__ = f.__qualname__, f.__module__, f.__doc__
  return g


def _walk(obj: Any, memo: dict, found: list) -> Any:
  key = id(obj)
  if key in memo:
    return memo[key]
  memo[key] = obj   # a cycle leads back to the object as it is
  out = obj
  if on_explicit_mesh(obj):
    out = _moved(obj)
  elif traced_on_explicit(obj):
    found.append(obj)
  elif isinstance(obj, types.FunctionType):
    out = _function(obj, memo, found)
  elif isinstance(obj, functools.partial):
    func, args = _walk(obj.func, memo, found), _walk(obj.args, memo, found)
    kw = _walk(obj.keywords, memo, found)
    if func is not obj.func or args is not obj.args or kw is not obj.keywords:
      out = functools.partial(func, *args, **kw)
  elif isinstance(obj, tuple) and hasattr(obj, "_fields"):   # NamedTuple
    items = [_walk(v, memo, found) for v in obj]
    if any(a is not b for a, b in zip(items, obj)):
      out = type(obj)(*items)
  elif type(obj) in (tuple, list):
    items = [_walk(v, memo, found) for v in obj]
    if any(a is not b for a, b in zip(items, obj)):
      out = type(obj)(items)
  elif type(obj) is dict:
    items = {k: _walk(v, memo, found) for k, v in obj.items()}
    if any(items[k] is not v for k, v in obj.items()):
      out = items
  memo[key] = out
  return out


def traced_on_explicit(x: Any) -> bool:
  """Whether ``x`` is a tracer typed on a mesh with ``Explicit`` axes (a value
  of the jit being traced): ``shard_map`` cannot close over it, and it has no
  value to move."""
  if not isinstance(x, jax.core.Tracer):
    return False
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def movable(tx: Any) -> Any:
  """``tx`` with every array it closes over that sits on a mesh with
  ``Explicit`` axes moved off it (module docstring); ``tx`` itself when
  there is none.

  Raises:
    ValueError: ``tx`` closes over a traced value typed on such a mesh
      (:data:`TRACED`)."""
  found: list = []
  out = _walk(tx, {}, found)
  if found:
    x = found[0]
    raise ValueError(TRACED.format(what=jax.typeof(x).str_short()
                                   if hasattr(jax.typeof(x), "str_short")
                                   else jax.typeof(x)))
  return out
