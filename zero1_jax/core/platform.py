"""Which devices a program is compiled for: 'gpu', 'tpu' or 'cpu'.

The mesh says it, not ``jax.default_backend()``: a step compiled for GPUs on
a machine without one (:mod:`zero1_jax.inspect.gpu`) runs jax's CPU backend
while XLA builds it for H100s, and what suits one (packing small leaves,
when to gather) does not suit the other.

Example:
  >>> import jax
  >>> of(jax.make_mesh((1,), ("data",)))
  'cpu'
  >>> of(None) is None
  True
"""

from __future__ import annotations

from typing import Any

import jax


def of(mesh: Any) -> str | None:
  """The platform of ``mesh``'s devices (a concrete or an abstract mesh,
  a compile-only one too); None when it does not say."""
  try:
    return mesh.devices.flat[0].platform
  except (AttributeError, IndexError, ValueError, TypeError):
    pass
  device = getattr(mesh, "abstract_device", None)
  return getattr(device, "platform", None)


def resolve(mesh: Any = None) -> str:
  """:func:`of` ``mesh``, else of the ``jax.set_mesh`` mesh, else jax's
  default backend."""
  found = of(mesh)
  if found is None:
    try:
      found = of(jax.sharding.get_abstract_mesh())
    except (AttributeError, ValueError):   # pragma: no cover - older jax
      found = None
  return found or jax.default_backend()


def _processes(mesh: Any) -> int | None:
  """How many processes ``mesh``'s devices belong to; None if it has none."""
  try:
    return len({d.process_index for d in mesh.devices.flat})
  except (AttributeError, ValueError, TypeError):
    return None


def one_host(mesh: Any, concrete: Any = None) -> bool:
  """Whether every device of ``mesh`` belongs to one process (host). An
  abstract mesh (read under jit from the arguments' shardings) has no
  devices: then those of a concrete mesh of its shape, ``concrete``
  (``zero1(mesh=)``) or the one ``jax.set_mesh`` set; else, where the
  mesh holds every device of a run of several processes, False; True when
  nothing says."""
  found = _processes(mesh)
  if found is not None:
    return found <= 1
  shape = getattr(mesh, "shape", None)
  candidates = [concrete]
  try:   # jax's context of the concrete mesh (0.10.2-0.12); private
    from jax._src.mesh import get_concrete_mesh
    candidates.append(get_concrete_mesh())
  except ImportError:  # pragma: no cover
    pass
  for m in candidates:
    if m is not None and not getattr(m, "empty", True) and m.shape == shape:
      found = _processes(m)
      if found is not None:
        return found <= 1
  size = getattr(mesh, "size", None)
  return not (jax.process_count() > 1 and size == jax.device_count())
