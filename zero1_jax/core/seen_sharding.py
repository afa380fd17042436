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
program's executable keeps the fast path. It does not ask jax for the
program's device list (jax's own primitive does, and then requires every
argument on one mesh: big_vision's batch is on a mesh of its own); the
shard shape it compares is read from the partitioner's tiles.
Where this jax lacks the pieces
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

try:   # jax's own pieces, private: 0.10.2 to 0.12 spell them the same
  from jax._src import debugging as _debugging
  from jax._src.lib import xla_client as _xc
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import hlo
  from jax._src.sharding_impls import (ShardingContext, parse_flatten_op_sharding,
                                       replicated_hlo_sharding)
  from jax.extend.core import Primitive
  from jax.interpreters import ad, batching, mlir
  _lower_inspect = _debugging._inspect_sharding_lowering_rule
  _CALL = _debugging._INSPECT_SHARDING_CALL_NAME
except (ImportError, AttributeError):   # pragma: no cover - another jax
  _lower_inspect = None


class _Seen:
  """What the partitioner chose, where no device list names it: the shard
  shape read from its tiles (what :mod:`.placement` compares), its spec
  where the mesh's axes parse it."""

  def __init__(self, hlo_sharding: Any, spec: Any):
    self._hlo, self.spec = hlo_sharding, spec if spec is not None else hlo_sharding

  def shard_shape(self, shape: tuple) -> tuple:
    if self._hlo.is_replicated() or not self._hlo.is_tiled():
      return tuple(shape)
    tiles = list(self._hlo.tile_assignment_dimensions())[:len(shape)]
    return tuple(-(-d // t) for d, t in zip(shape, tiles))


def _read(hlo_sharding: Any, axes: tuple) -> _Seen:
  """``hlo_sharding`` as a :class:`_Seen`, its spec parsed on a mesh of
  ``axes`` ((name, size) pairs) taken in device order."""
  spec = None
  if axes:
    try:
      mesh = jax.sharding.AbstractMesh(tuple(n for _, n in axes),
                                       tuple(a for a, _ in axes))
      spec = parse_flatten_op_sharding(hlo_sharding, mesh)[0]
    except Exception:   # noqa: BLE001 - a spec these axes do not express
      spec = None
  return _Seen(hlo_sharding, spec)


def _lower(ctx, x, *, callback, axes):
  """jax's own inspection where the program has a device list; else (most
  programs: jax makes one only for a primitive that asks for it, and asking
  made jax require a single mesh for every argument, which failed
  big_vision's batch on a mesh of its own) the same custom call, its
  answer read without devices (:func:`_read`)."""
  context = ctx.module_context.axis_context
  if (not isinstance(context, ShardingContext)
      or context.device_assignment is not None):
    _lower_inspect(ctx, x, callback=callback)
    return [x]
  answer = lambda h: callback(_read(h, axes))
  if context.num_devices == 1:
    answer(replicated_hlo_sharding)
    return [x]
  ctx.module_context.add_keepalive(answer)   # alive while XLA partitions
  hlo.CustomCallOp([x.type], [x], call_target_name=ir.StringAttr.get(_CALL),
                   has_side_effect=ir.BoolAttr.get(True),
                   api_version=mlir.i32_attr(1),
                   called_computations=ir.ArrayAttr.get([]),
                   backend_config=ir.StringAttr.get(
                       _xc.encode_inspect_sharding_callback(answer)),
                   operand_layouts=None, result_layouts=None)
  return [x]


def _build():
  p = Primitive("zero1_seen_sharding")
  p.def_impl(lambda x, *, callback, axes: (callback(x.sharding), x)[1])
  p.def_abstract_eval(lambda aval, *, callback, axes: aval)   # no effect
  mlir.register_lowering(p, _lower)
  batching.primitive_batchers[p] = lambda args, dims, *, callback, axes: (
      p.bind(args[0], callback=callback, axes=axes), dims[0])
  ad.primitive_jvps[p] = lambda primals, tangents, *, callback, axes: (
      p.bind(primals[0], callback=callback, axes=axes), tangents[0])
  return p


_p = _build() if _lower_inspect is not None else None


def inspect(x: Any, callback: Callable[[Any], Any],
            axes: tuple = ()) -> Any:
  """``x``, with ``callback(sharding)`` called when the program compiles
  (at once, outside jit), as ``jax.debug.inspect_array_sharding``; use the
  returned value in place of ``x`` so the read stays in the program.
  ``axes``: the mesh's ``(name, size)`` pairs, to name the spec of a
  program without a device list (the sharding then has ``spec`` and
  ``shard_shape`` only)."""
  if _p is None or not isinstance(x, jax.core.Tracer):
    jax.debug.inspect_array_sharding(x, callback=callback)
    return x
  return _p.bind(x, callback=callback, axes=tuple(axes))
