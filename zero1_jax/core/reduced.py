"""Params typed ``reduced`` over the data axis, and the gradients jit returns.

Under ``jax.jit``, params placed by :func:`reduced_params`
(``P(..., reduced={axis})``) make ``jax.grad`` return gradients typed
*unreduced* over the axis: partial sums whose total is the gradient of the
global-mean loss, which ``tx.update`` reduce-scatters straight into each
device's shard (:data:`.grad_reduce.PARTIAL`). Plain replicated params get
gradients already reduced by jit's partitioner
(:data:`.grad_reduce.REDUCED`). :func:`grads_mode` tells which.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from zero1_jax.core import layout as lay
from zero1_jax.core.grad_reduce import PARTIAL, REDUCED


def reduced_over(x, axis: str, field: str) -> bool:
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return axis in getattr(spec, field, ())


def _spec(x, axis: str, field: str | None) -> P:
  """``P()`` for ``x``'s rank, typed ``reduced`` / ``unreduced`` over ``axis``."""
  nones = [None] * jnp.ndim(x)
  return P(*nones, **({field: {axis}} if field else {}))


def grads_mode(grads: Any, layout: lay.Layout, axis: str) -> str:
  """:data:`PARTIAL` if the floating gradients are typed unreduced over
  ``axis``, :data:`REDUCED` if none is; ValueError if only some are."""
  leaves = jax.tree.leaves(grads)
  flags = {reduced_over(g, axis, "unreduced")
           for g, s in zip(leaves, layout.leaves) if s.kind != lay.STATIC}
  if flags == {True, False}:
    raise ValueError(
        f"zero1: some gradients are unreduced over '{axis}' and some are not: "
        f"place every parameter with z1.reduced_params(params, mesh) (or none "
        f"of them).")
  return PARTIAL if flags == {True} else REDUCED


def reduced_params(params: Any, mesh: jax.sharding.Mesh | None = None, *,
                   axis_name: str = "data") -> Any:
  """Places ``params`` replicated and typed ``reduced`` over ``axis_name``.

  Under ``jax.jit`` such params make ``jax.grad`` return gradients typed
  *unreduced* over the axis, and :func:`zero1_jax.zero1`'s ``update`` then
  reduce-scatters them directly (one collective per bucket, no all-reduce).
  The updates it returns are typed the same way, so the params stay so
  through ``optax.apply_updates`` / ``TrainState.apply_gradients``.

  The model must accept reduced-typed params: matmuls do; adding a reduced
  bias to activations sharded over the axis is refused by JAX
  (``ShardingTypeError``) unless the bias is broadcast with an explicit
  ``out_sharding`` (see the README). Floating scalars and arrays are placed
  reduced; other leaves plainly replicated.

  Args:
    params: a tree of arrays.
    mesh: a mesh whose ``axis_name`` is ``Explicit`` (``jax.make_mesh``'s
      default); default: the ``jax.set_mesh`` mesh.
    axis_name: the data axis.

  Returns:
    ``params`` on the mesh.

  Raises:
    ValueError: no mesh, the mesh lacks the axis or the axis is not Explicit.
  """
  if mesh is None:
    mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
      raise ValueError("zero1: reduced_params needs a mesh: pass mesh= or call "
                       "it under `with jax.set_mesh(mesh):`.")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"zero1: mesh has axes {tuple(mesh.axis_names)}, not "
                     f"'{axis_name}'; pass axis_name=<the data axis>.")
  kind = dict(zip(mesh.axis_names, mesh.axis_types))[axis_name]
  if kind != jax.sharding.AxisType.Explicit:
    raise ValueError(
        f"zero1: axis '{axis_name}' is {kind}; reduced params need an Explicit "
        f"axis: jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Explicit,"
        f" ...)).")

  def place(x):
    floating = lay.trainable(jnp.result_type(x))
    return jax.device_put(x, NamedSharding(
        mesh, _spec(x, axis_name, "reduced" if floating else None)))
  return jax.tree.map(place, params)
