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


def one_host(mesh: Any) -> bool:
  """Whether every device of ``mesh`` belongs to one process (host): of an
  abstract mesh (``jax.set_mesh``'s, read under jit), that of the concrete
  mesh ``jax.set_mesh`` set with it; True when neither says."""
  try:
    return len({d.process_index for d in mesh.devices.flat}) <= 1
  except (AttributeError, ValueError, TypeError):
    pass
  try:   # jax's context of the concrete mesh (0.10.2-0.12); private
    from jax._src.mesh import get_concrete_mesh
    concrete = get_concrete_mesh()
    if concrete.empty or concrete.shape != getattr(mesh, "shape", None):
      return True
    return len({d.process_index for d in concrete.devices.flat}) <= 1
  except (ImportError, AttributeError, ValueError, TypeError):  # pragma: no cover
    return True
