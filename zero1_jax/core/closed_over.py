"""What ``z1.value_and_grad``'s loss is handed besides arrays, and what it
closes over.

``z1.value_and_grad`` runs the loss per device inside a ``shard_map``, which
takes arrays only. ``jax.value_and_grad`` takes any pytree after the params:
an Equinox model's static part (``eqx.partition``: functions, activation
choices, Python numbers), a string, None. :func:`split_static` takes such leaves out of the
arguments and puts them back inside, closed over.

A closed-over array is whole on every device inside that ``shard_map``: a
batch the loss closes over (``lambda p: loss(p, batch)``, as nanodo writes
its loss) makes every device compute the whole batch, its rows all-gathered,
N times the FLOPs, with the right result. :func:`check_closed_over` finds
the arrays ``fun`` closes over (the constants of its jaxpr) and warns for
each one sharded over the data axis: at once for arrays, when the step
compiles on Auto axes; on an Explicit axis (which ``shard_map`` refuses to
close over) it raises, with the same fix.

Example:
  >>> import jax.numpy as jnp
  >>> kept, rebuild = split_static((jnp.ones(2), {"act": jnp.tanh, "n": None}))
  >>> kept[1]
  {'act': None, 'n': None}
  >>> rebuild(kept)[1]["act"] is jnp.tanh
  True
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import jax
import numpy as np

from zero1_jax.core import explicit_consts

CLOSED_OVER = (
    "zero1: z1.value_and_grad(fun, tx): fun closes over an array of shape "
    "{shape} sharded over the data axis '{axis}' ({spec}), e.g. the batch. "
    "fun runs on each device's share of the arguments at batch_argnums "
    "{argnums}; an array it closes over is whole on every device, so each "
    "device computes all of it (the array is all-gathered; up to {n}x the "
    "FLOPs; the result is the same). Pass it as an argument: "
    "z1.value_and_grad(lambda params, batch: ..., tx)(params, batch) "
    "(batch_argnums=(1,) splits it over '{axis}').")


EXPLICIT = (
    "zero1: z1.value_and_grad(fun, tx): fun closes over {what} on a mesh "
    "with Explicit axes (jax.make_mesh's default). fun runs on each device inside a shard_map, which JAX does not "
    "let close over such a value. Pass it to fun as an argument after the "
    "batch: z1.value_and_grad(lambda params, batch, extra: ..., tx)(params, "
    "batch, extra); arguments outside batch_argnums {argnums} reach every "
    "device whole. Or use a mesh with Auto axes "
    "(jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,))).")


KEY_CLOSED_OVER = (
    "zero1: z1.value_and_grad(fun, tx): fun closes over a PRNG key, which "
    "is the same on every device: each device draws the same random numbers "
    "for its rows (the same dropout masks on every device, where "
    "jax.value_and_grad draws them for the whole batch). Pass the key as an "
    "argument after the batch, z1.value_and_grad(lambda params, batch, rng: "
    "..., tx)(params, batch, rng): each device's index along the data axis "
    "is folded into a key argument (device_keys=True).")


def is_key(x) -> bool:
  """A PRNG key: typed, or raw ``uint32[2]`` (``jax.random.PRNGKey``'s)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  return (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
          or (dtype == np.uint32 and np.shape(x) == (2,)))


def _is_array(x) -> bool:
  """What the ``shard_map`` takes: arrays. Python and numpy scalars stay
  as they are, as ``jax.value_and_grad`` hands its non-differentiated
  arguments to ``fun`` (``range(n)`` on an int argument; Equinox's
  ``MaxPool2d(init=-inf)`` in a model's static part)."""
  return isinstance(x, (jax.Array, np.ndarray))


def split_static(args: tuple) -> tuple[tuple, Callable[[tuple], tuple]]:
  """``(args with each non-array leaf replaced by None, rebuild)``:
  ``rebuild(kept)`` puts the non-array leaves back (``kept`` may hold
  other arrays of the same structure, e.g. tracers)."""
  flat = [jax.tree.flatten(a) for a in args]
  kept = tuple(tdef.unflatten([x if _is_array(x) else None for x in leaves])
               for leaves, tdef in flat)

  def rebuild(kept_args: tuple) -> tuple:
    out = []
    for (leaves, tdef), k in zip(flat, kept_args):
      it = iter(jax.tree.leaves(k))
      out.append(tdef.unflatten([next(it) if _is_array(x) else x
                                 for x in leaves]))
    return tuple(out)

  return kept, rebuild


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def data_spec(sharding, axis: str):
  """``sharding``'s spec if it splits a dim over ``axis``, else None."""
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return None
  parts = tuple(spec.partitions) if hasattr(spec, "partitions") else tuple(spec)
  return spec if any(axis in _axes(e) for e in parts) else None


def check_closed_over(fun: Callable, args: tuple, axis: str, n: int,
                      argnums: tuple, movable: bool = True) -> bool:
  """Warns (:data:`CLOSED_OVER`) for each array ``fun(*args)`` closes over
  that is sharded over ``axis``. Traces ``fun`` once more for its jaxpr.
  Returns whether it closes over an array on a mesh with Explicit axes
  that ``shard_map`` refuses and :func:`.explicit_consts.movable` can move
  (a concrete one; ``movable`` False: raises for it too).

  Raises:
    ValueError: such an array sharded over ``axis`` (:data:`CLOSED_OVER`),
      or traced on an Explicit mesh (:data:`EXPLICIT`)."""
  consts = jax.make_jaxpr(fun)(*args).consts
  said, to_move = [], False

  def say(x, spec):
    if not said:
      said.append(True)
      warnings.warn(CLOSED_OVER.format(shape=tuple(np.shape(x)), axis=axis,
                                       spec=spec, argnums=argnums, n=n),
                    UserWarning, stacklevel=4)

  if any(is_key(x) for x in consts):
    warnings.warn(KEY_CLOSED_OVER, UserWarning, stacklevel=4)
  for x in consts:
    data = (math.prod(np.shape(x)) >= n and np.ndim(x) > 0 and data_spec(
        getattr(x, "sharding", None) if not isinstance(x, jax.core.Tracer)
        else getattr(jax.typeof(x), "sharding", None), axis))
    if not data and explicit_consts.traced_on_explicit(x):
      raise ValueError(EXPLICIT.format(what=_what(x), argnums=argnums))
    if not data and explicit_consts.on_explicit_mesh(x):
      if not movable:
        raise ValueError(EXPLICIT.format(what=_what(x), argnums=argnums))
      to_move = True
      continue
    if np.ndim(x) == 0 or math.prod(np.shape(x)) < n:
      continue
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      spec = data_spec(x.sharding, axis)
      if spec is not None:
        say(x, spec)
      continue
    if not isinstance(x, jax.core.Tracer):
      continue
    sharding = getattr(jax.typeof(x), "sharding", None)
    typed = data_spec(sharding, axis)
    if typed is not None:   # Explicit: shard_map cannot close over it at all
      raise ValueError(CLOSED_OVER.format(
          shape=tuple(np.shape(x)), axis=axis, spec=typed, argnums=argnums,
          n=n) + " (On an Explicit axis JAX refuses to close over it.)")
    mesh = getattr(sharding, "mesh", None)
    kinds = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
    if kinds.get(axis) == jax.sharding.AxisType.Explicit:
      continue   # its type is its placement: not over the axis
    # Auto axes: the placement jit chose, read when the step compiles.
    jax.debug.inspect_array_sharding(
        x, callback=lambda s, x=x: (data_spec(s, axis) is not None
                                    and say(x, data_spec(s, axis))))
  return to_move


def _what(x) -> str:
  what = ("a PRNG key" if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
          else f"an array of shape {tuple(np.shape(x))} ({np.dtype(x.dtype).name})")
  return what + (", a value of the jit being traced,"
                 if isinstance(x, jax.core.Tracer) else "")
