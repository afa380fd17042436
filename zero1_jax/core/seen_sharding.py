"""The sharding XLA chose for a value, read while the program compiles, at no run-time cost.

``jax.debug.inspect_array_sharding`` calls back with the sharding the SPMD
partitioner picked, but its primitive carries a debug effect, and an
executable with any effect loses jax's C++ dispatch: every call of the
step then goes through Python, checking each argument's sharding and
layout. Measured on one H200 (experiments/gpu/measure.py, BERT-base, 574
arguments), ``z1.zero1`` in the user's jit took 13.7 ms a step against 9.0
for ``z1.train_step``, the GPU idle while the host dispatched.

:func:`inspect` does the same read with an identity primitive that declares
no effect: its value is the input, it lowers to jax's own inspection
custom call (which the partitioner consumes at compile time), and the
program's executable keeps the fast path. Where this jax lacks the pieces
it is built from, it falls back to ``jax.debug.inspect_array_sharding``
(correct, with the slower dispatch).

Example:
  >>> import jax, jax.numpy as jnp
  >>> seen = []
  >>> f = jax.jit(lambda x: inspect(x, seen.append) * 2)
  >>> f(jnp.ones(4)).tolist(), len(seen)
  ([2.0, 2.0, 2.0, 2.0], 1)
"""

from __future__ import annotations

from typing import Any, Callable

import jax

try:   # jax's own rule, private: 0.10.2 to 0.12 spell it the same
  from jax._src import debugging as _debugging
  from jax._src import dispatch as _dispatch
  from jax.extend.core import Primitive
  from jax.interpreters import ad, batching, mlir
  _lower_inspect = _debugging._inspect_sharding_lowering_rule
except (ImportError, AttributeError):   # pragma: no cover - another jax
  _lower_inspect = None


def _build():
  p = Primitive("zero1_seen_sharding")
  p.def_impl(lambda x, *, callback: (callback(x.sharding), x)[1])
  p.def_abstract_eval(lambda aval, *, callback: aval)   # no effect

  def lower(ctx, x, *, callback):
    _lower_inspect(ctx, x, callback=callback)
    return [x]
  mlir.register_lowering(p, lower)
  _dispatch.prim_requires_devices_during_lowering.add(p)
  batching.primitive_batchers[p] = lambda args, dims, *, callback: (
      p.bind(args[0], callback=callback), dims[0])
  ad.primitive_jvps[p] = lambda primals, tangents, *, callback: (
      p.bind(primals[0], callback=callback), tangents[0])
  return p


_p = _build() if _lower_inspect is not None else None


def inspect(x: Any, callback: Callable[[Any], Any]) -> Any:
  """``x``, with ``callback(sharding)`` called when the program compiles
  (at once, outside jit), as ``jax.debug.inspect_array_sharding``; use the
  returned value in place of ``x`` so the read stays in the program."""
  if _p is None or not isinstance(x, jax.core.Tracer):
    jax.debug.inspect_array_sharding(x, callback=callback)
    return x
  return _p.bind(x, callback=callback)
