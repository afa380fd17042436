"""What lives where on a mesh: the data axis's size, the params' and the
state's ``NamedSharding``s for :func:`zero1_jax.init`,
:func:`zero1_jax.train_step` and checkpoint restores.

Example:
  >>> import jax, jax.numpy as jnp, optax, zero1_jax as z1
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  >>> data_size(tx, mesh)
  1
  >>> tuple(state_shardings(tx, {"w": jnp.ones(3)}, mesh).inner[0].mu["w"].spec)
  ('data',)
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zero1_jax.core import blame
from zero1_jax.core import refusal
from zero1_jax.core import offload as ofl
from zero1_jax.core import param_axes as pax
from zero1_jax.core import specs as zspecs
from zero1_jax.core.state import Zero1State
from zero1_jax.core.tx_config import Zero1Transformation


def data_size(tx: Zero1Transformation, mesh: jax.sharding.Mesh) -> int:
  """The size of ``tx``'s data axis on ``mesh``; ValueError naming the fix
  when the mesh lacks it."""
  return axis_size(tx, mesh)


def require_zero1(tx: Any, where: str) -> None:
  """TypeError naming the fix unless ``tx`` came from :func:`zero1_jax.zero1`
  or :func:`zero1_jax.zero2` (a plain optax optimizer, or one wrapped around
  the zero1 transform, has no sharded state to build or step)."""
  if isinstance(tx, Zero1Transformation):
    return
  wrapper = blame.name(tx) if isinstance(
      tx, optax.GradientTransformation) else ""
  if wrapper in refusal.NEST_INSIDE:   # lookahead(z1.zero1(...)), as told
    fix = (f"z1.train_step (whose state z1.init makes) calls zero1's "
           f"update itself and takes no wrapper around it: run "
           f"{wrapper}(z1.zero1(opt, ...), ...) with tx.init / tx.update in "
           f"a jax.jit step of your own, or give {where} z1.zero1(opt, ...) "
           f"alone.")
    got = wrapper
  elif isinstance(tx, optax.MultiSteps):
    fix = ("Accumulate inside instead: z1.zero1(optax.MultiSteps(opt, k), "
           "axis_name='data'), or z1.train_step(..., grad_accum_steps=k).")
    got = "optax.MultiSteps"
  else:
    fix = ("Wrap the optimizer: z1.zero1(opt, axis_name='data'); to chain "
           "more transformations, put them inside: "
           "z1.zero1(optax.chain(opt, ...), axis_name='data').")
    got = ("a plain optax GradientTransformation"
           if isinstance(tx, optax.GradientTransformation)
           else type(tx).__qualname__)
  raise TypeError(f"{where}: tx must be the transformation z1.zero1(...) or "
                  f"z1.zero2(...) returns, got {got}. {fix}")


def axis_size(tx: Zero1Transformation, mesh: jax.sharding.Mesh,
              where: str = "zero1") -> int:
  """:func:`data_size`, after :func:`require_zero1` (``where`` names the
  caller in its error)."""
  require_zero1(tx, where)
  axis = tx.config.axis_name
  if axis not in mesh.axis_names:
    names = tuple(mesh.axis_names)
    if len(names) == 1:
      fix = (f"Build the mesh with that axis, e.g. jax.make_mesh(("
             f"{jax.device_count()},), ('{axis}',)), or pass zero1(..., "
             f"axis_name='{names[0]}')")
    else:   # 2-D: keep the other axes; name the data-parallel one
      fix = (f"Pass zero1(..., axis_name=<the data-parallel one of {names}>), "
             f"or name that axis '{axis}' when building the mesh (params "
             f"sharded over the other axes stay as they are)")
    raise ValueError(
        f"zero1: mesh has axes {names} but the optimizer shards over "
        f"'{axis}'. {fix}.")
  return mesh.shape[axis]


def replicated(tree: Any) -> Any:
  """``P()`` for every leaf of ``tree``."""
  return jax.tree.map(lambda _: P(), tree)


def param_axes(tx: Zero1Transformation, params: Any,
               mesh: jax.sharding.Mesh) -> pax.ParamAxes | None:
  """How ``params`` are sharded over ``mesh``'s axes other than the data axis
  (``tx.config.param_specs``, else the arrays' ``NamedSharding`` or Flax
  ``nn.Partitioned`` names); None when they are not."""
  axis_size(tx, mesh)
  return pax.resolve(params, dict(mesh.shape), tx.config.axis_name,
                     tx.config.param_specs)


def param_shardings(tx: Zero1Transformation, params: Any,
                    mesh: jax.sharding.Mesh) -> Any:
  """``NamedSharding``s the params train with: replicated over the data
  axis, and as :func:`param_axes` says over the others."""
  pa = param_axes(tx, params, mesh)
  specs = (replicated(pax.unbox(params)) if pa is None
           else pa.param_specs(pax.unbox(params)))
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def state_shardings(tx: Zero1Transformation, params: Any,
                    mesh: jax.sharding.Mesh) -> Zero1State:
  """``NamedSharding``s of ``tx``'s state for ``params`` on ``mesh`` (with
  ``offload``, the sharded leaves' memory kind is ``pinned_host``)."""
  require_zero1(tx, "z1.state_shardings")
  pa = param_axes(tx, params, mesh)
  specs = zspecs.state_specs(tx, pax.unbox(params),
                             axis_size(tx, mesh, "z1.state_shardings"), pa)
  # With offload, the leaves sharded over the data axis in host memory.
  return ofl.state_shardings(mesh, specs, tx.config.axis_name,
                             tx.config.offload)
