"""Is zero1's state placed as zero1 planned, where a program hands it back?

In plain ``jax.jit`` code the program, not zero1, places the optimizer state
between steps: its ``in_shardings`` / ``out_shardings``, a
``with_sharding_constraint``, or the arrays it passes. A state replicated
over the data axis (shardings derived from the params' annotations, a
``P()`` constraint) still trains to the same weights, since ``tx.update``
slices what it needs, but every device then holds the whole state: the
ZeRO-1 saving is gone and nothing fails. :func:`check` measures, per state
leaf, the bytes one device holds as placed against zero1's plan
(:func:`zero1_jax.core.specs.state_specs`) and warns with both totals and the
fix: at once for arrays and for tracers typed on Explicit axes, at compile
time (:func:`zero1_jax.core.seen_sharding.inspect`) on Auto axes.

It warns rather than raises: the step's result is right, and a program may
replicate the state on purpose (a debug run, a later reshard); the warning
makes the cost visible with the numbers to act on.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> per_device_bytes((16, 4), jnp.float32, P("data", None), {"data": 8})
  32
  >>> per_device_shape((16, 8), P(None, "data"), {"data": 8})
  (16, 1)
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zero1_jax.core import seen_sharding

FIX = (
    "Place the state as tx.init returned it: derive the jit shardings from "
    "the state itself, not from the params' (linen: nn.get_partition_spec("
    "abstract_state) -> nn.logical_to_mesh_sharding(..., mesh, rules), with "
    "the TrainState built by tx.init so opt_state carries zero1's metadata; "
    "nnx: nnx.get_partition_spec(nnx.state(optimizer)); any program: "
    "jax.tree.map(lambda x: x.sharding, state)), and constrain it with "
    "those, not with P() or the params' specs.")


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def per_device_shape(shape, spec: P, sizes: Mapping[str, int]) -> tuple:
  """The shape of one device's piece of an array of ``shape`` placed as
  ``spec``."""
  parts = tuple(spec.partitions) if hasattr(spec, "partitions") else tuple(spec)
  dims = [int(s) for s in shape]
  for d, e in enumerate(parts[:len(dims)]):
    m = math.prod(int(sizes[a]) for a in _axes(e))
    dims[d] = -(-dims[d] // m)
  return tuple(dims)


NOT_ZERO1S = (
    "zero1: opt_state{path} has shape {shape}, which its placement {spec} "
    "cannot split evenly: zero1 holds each parameter-shaped state leaf padded "
    "to a multiple of the data axis and split over it, so this one was "
    "replaced from outside (e.g. optax.tree_utils.tree_set(state, "
    "mu=jax.tree.map(jnp.zeros_like, params))). Build the replacement from "
    "the state's own leaves (tree_set(state, mu=jax.tree.map(jnp.zeros_like, "
    "tree_get(state, 'mu')))), or convert a whole optax state with "
    "z1.from_optax_state.")


def divides(shape, spec: P, sizes: Mapping[str, int]) -> bool:
  """Whether ``spec`` splits every dim of ``shape`` it shards evenly."""
  parts = tuple(spec.partitions) if hasattr(spec, "partitions") else tuple(spec)
  return all(int(n) % math.prod(int(sizes[a]) for a in _axes(e)) == 0
             for n, e in zip(shape, parts))


def per_device_bytes(shape, dtype, spec: P, sizes: Mapping[str, int]) -> int:
  """Bytes one device holds of an array of ``shape`` placed as ``spec``."""
  return math.prod(per_device_shape(shape, spec, sizes)) * jnp.dtype(dtype).itemsize


def _typed_spec(x) -> P | None:
  """The spec of ``x``'s type (Explicit axes only; None without one)."""
  try:
    return jax.typeof(x).sharding.spec
  except (AttributeError, TypeError):
    return None


EQUINOX_FIX = (
    "Equinox: leave the optimizer state out of the replicated constraint: "
    "`model = eqx.filter_shard(model, replicated)` (opt_state stays as "
    "tx.init placed it), not `model, opt_state = eqx.filter_shard((model, "
    "opt_state), replicated)`.")

REPLICATED = (
    "Every misplaced leaf is whole on each device: something gives the "
    "state P() (a jit's in_shardings / out_shardings, jax.device_put, or a "
    "sharding constraint over the model and the state together). ")


def fix_for_replicated() -> str:
  """The one change for a state replicated on purpose, in the program's
  framework (Equinox's parallelism example constrains (model, opt_state)
  replicated), else the general fix."""
  if "equinox" in sys.modules:
    return REPLICATED + EQUINOX_FIX + " Otherwise: " + FIX
  return REPLICATED + FIX


class _Report:
  """Collects the per-leaf measurements of one check and warns once."""

  def __init__(self, names, planned, expected, whole=None, specs=None):
    self.names, self.planned, self.expected = names, planned, expected
    self.whole = whole or {}   # leaf -> its bytes if whole on each device
    self.specs = specs or {}   # leaf -> zero1's spec for it
    self.got: dict[int, tuple[int, str]] = {}
    # The program's line while its update is traced: a compile-time report
    # may run where no frame of the program is on the stack.
    f = _user_frame(sys._getframe(1))   # its place, not the frame (no locals kept)
    self.site = None if f is None else (f.f_code.co_filename, f.f_lineno, f.f_globals)

  def add(self, i: int, nbytes: int, how: str):
    self.got[i] = (nbytes, how)
    if len(self.got) == self.expected:
      self.emit()
      # On Auto axes a cached trace compiled again (the state arrives placed
      # otherwise) runs the callbacks again: one warning per compile.
      self.got = {}

  def emit(self):
    bad = [i for i, (b, how) in self.got.items()
           if how is not None and how != "ok"]
    if not bad:
      return
    held = sum(b for b, _ in self.got.values())
    plan = sum(self.planned[i] for i in self.got)
    first = bad[0]
    spec = self.specs.get(first)
    measured = (
        f"Measured: {held} B of zero1's state per device where zero1 planned "
        f"{plan} B; a step given it placed so re-shards it. " if held != plan
        else f"The bytes are as planned ({held} B per device), split on "
        f"other dims: a step given the state so re-shards those leaves (an "
        f"all-to-all of their bytes each step). ")
    _warn_at_user_line(
        f"zero1: this program places zero1's optimizer state other than "
        f"zero1 planned: {len(bad)} of {len(self.got)} state leaves (e.g. "
        f"{self.names[first]}: {self.got[first][1]}, "
        f"{self.got[first][0]} B per device, planned "
        + (f"{spec}, " if spec is not None else "")
        + f"{self.planned[first]} B). " + measured
        + (fix_for_replicated()
           if all(self.got[i][0] == self.whole.get(i) for i in bad) else FIX),
        self.site)


_LIBRARIES = ("zero1_jax", "jax", "jaxlib", "flax", "equinox", "optax")


def _library_dirs() -> tuple[str, ...]:
  return tuple(os.path.dirname(m.__file__) + os.sep
               for m in map(sys.modules.get, _LIBRARIES)
               if m is not None and getattr(m, "__file__", None))


def _user_frame(f: Any) -> Any:
  """The first frame from ``f`` outward outside zero1 and the libraries it
  runs under, or None."""
  dirs = _library_dirs()
  while f is not None and f.f_code.co_filename.startswith(dirs):
    f = f.f_back
  return f


def user_stacklevel() -> int:
  """``warnings.warn``'s stacklevel, called from the function that warns,
  of the first frame outside zero1 and the libraries it runs under (the
  program's own line: a compile-time callback runs inside jax's compile)."""
  dirs = _library_dirs()
  f, level = sys._getframe(2), 2
  while f is not None and f.f_code.co_filename.startswith(dirs):
    f, level = f.f_back, level + 1
  return level if f is not None else 2


def _warn_at_user_line(message: str, site: Any) -> None:
  """Warns at the program's line on the stack, else at ``site`` (its
  ``(filename, lineno, globals)`` recorded while the update was traced:
  jax 0.10's compile runs the report's callback with none of the program's
  frames on the stack)."""
  if _user_frame(sys._getframe(1)) is not None or site is None:
    warnings.warn(message, UserWarning, stacklevel=user_stacklevel())
    return
  filename, lineno, g = site
  warnings.warn_explicit(message, UserWarning, filename, lineno,
                         module=g.get("__name__"),
                         registry=g.setdefault("__warningregistry__", {}),
                         module_globals=g)


def check(state: Any, specs: Any, sizes: Mapping[str, int],
          data_axis: str) -> Any:
  """Checks the placement of ``state`` (bare arrays or tracers) against
  ``specs``; returns ``state``, with leaves typed on an Explicit data axis
  other than planned resharded to the plan (so the step runs, after the
  warning)."""
  is_p = lambda s: isinstance(s, P)
  spec_leaves, treedef = jax.tree.flatten(specs, is_leaf=is_p)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_p)[0]]
  leaves = treedef.flatten_up_to(state)
  idx = [i for i, x in enumerate(leaves) if x is not None and np.ndim(x) > 0]
  planned = {i: per_device_bytes(np.shape(leaves[i]), leaves[i].dtype,
                                 spec_leaves[i], sizes) for i in idx}
  # A piece of another shape (same bytes, another dim) is misplaced too:
  # each step then re-shards it (an all-to-all).
  pieces = {i: per_device_shape(np.shape(leaves[i]), spec_leaves[i], sizes)
            for i in idx}
  whole = {i: math.prod(np.shape(leaves[i])) * jnp.dtype(leaves[i].dtype).itemsize
           for i in idx}
  report = _Report(paths, planned, len(idx), whole,
                   {i: spec_leaves[i] for i in idx})
  out = list(leaves)
  for i in idx:
    x, spec = leaves[i], spec_leaves[i]
    if not divides(np.shape(x), spec, sizes):
      raise ValueError(NOT_ZERO1S.format(path=paths[i], shape=np.shape(x),
                                         spec=spec))
    if not isinstance(x, (jax.Array, jax.core.Tracer)):   # host arrays
      if _data_explicit(data_axis):   # placed as planned (Auto: by jit)
        out[i] = jax.sharding.reshard(jnp.asarray(x), spec)
      report.add(i, planned[i], "ok")
      continue
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      shape = x.sharding.shard_shape(x.shape)
      nbytes = math.prod(shape) * x.dtype.itemsize
      ok = tuple(shape) == pieces[i]
      report.add(i, nbytes, "ok" if ok else
                 f"placed {getattr(x.sharding, 'spec', x.sharding)}")
      if not ok and _data_explicit(data_axis, x):
        out[i] = jax.sharding.reshard(x, _on_own_mesh(x, spec))
      continue
    typed = _typed_spec(x) if isinstance(x, jax.core.Tracer) else None
    typed_data = typed is not None and any(
        data_axis in _axes(e) for e in tuple(getattr(typed, "partitions", typed)))
    data_explicit = _data_explicit(data_axis, x)
    if isinstance(x, jax.core.Tracer) and (typed_data or data_explicit):
      nbytes = per_device_bytes(np.shape(x), x.dtype, typed, sizes)
      ok = (per_device_shape(np.shape(x), typed, sizes) == pieces[i]
            and _same(typed, spec, np.ndim(x), sizes))
      report.add(i, nbytes, "ok" if ok else f"typed {typed}")
      if not ok:
        out[i] = jax.sharding.reshard(x, _on_own_mesh(x, spec))
      continue

    def seen(sharding, i=i, x=x):
      shape = sharding.shard_shape(np.shape(x))
      nbytes = math.prod(shape) * jnp.dtype(x.dtype).itemsize
      report.add(i, nbytes, "ok" if tuple(shape) == pieces[i]
                 else f"placed {getattr(sharding, 'spec', sharding)}")
    out[i] = seen_sharding.inspect(x, seen, tuple(sizes.items()))   # no run-time effect
  return treedef.unflatten(out)


def _type_mesh(x: Any) -> Any:
  """The mesh ``x`` is placed on (an array's sharding's) or typed on (a
  tracer under jit), or None."""
  try:
    mesh = (x.sharding.mesh if isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer) else jax.typeof(x).sharding.mesh)
  except (AttributeError, TypeError):
    return None
  return None if getattr(mesh, "empty", True) else mesh


def _data_explicit(axis: str, x: Any = None) -> bool:
  """Whether ``axis`` is Explicit: on ``jax.set_mesh``'s mesh, else on the
  mesh of ``x``'s type (a jit without ``jax.set_mesh`` types its tracers
  on the arguments' mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if (mesh.empty or axis not in mesh.axis_names) and x is not None:
    mesh = _type_mesh(x) or mesh
  if mesh.empty or axis not in mesh.axis_names:
    return False
  kind = dict(zip(mesh.axis_names, mesh.axis_types))[axis]
  return kind == jax.sharding.AxisType.Explicit


def _on_own_mesh(x: Any, spec: P) -> Any:
  """``spec`` as ``jax.sharding.reshard`` takes it for ``x``: bare under
  ``jax.set_mesh``, else on the mesh of ``x``'s type."""
  if not jax.sharding.get_abstract_mesh().empty:
    return spec
  mesh = _type_mesh(x)
  return spec if mesh is None else jax.sharding.NamedSharding(mesh, spec)


def _same(a: P, b: P, ndim: int, sizes: Mapping[str, int]) -> bool:
  """Same placement, size-1 axes aside (they split nothing)."""
  pa = tuple(getattr(a, "partitions", a)) + (None,) * ndim
  pb = tuple(getattr(b, "partitions", b)) + (None,) * ndim
  real = lambda e: tuple(x for x in _axes(e) if sizes.get(x) != 1)
  return [real(e) for e in pa[:ndim]] == [real(e) for e in pb[:ndim]]
