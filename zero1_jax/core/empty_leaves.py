"""``jax.shard_map`` that takes no zero-size array in: jaxlib 0.11.2 crashes.

jaxlib 0.11.2's Shardy canonicalizer (``ManualComputationUnusedInputsPattern``)
segfaults compiling a shard_map that takes a zero-size array as an input
beside others (XLA first folds it into a constant); 0.10.2, 0.11.0, 0.11.1
and 0.12 compile it. A parameter tree may hold such a leaf (zero1 passes it
through untouched), so every shard_map here receives ``None`` in its place
and rebuilds the (empty) array inside, with its per-device shape.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  >>> f = shard_map(lambda e, x: (e, x * 2), mesh=mesh, in_specs=(P(), P()),
  ...               out_specs=(P(), P()), check_vma=False)
  >>> [a.shape for a in f(jnp.zeros((0, 3)), jnp.ones(4))]
  [(0, 3), (4,)]
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _empty(x: Any) -> bool:
  shape = getattr(x, "shape", None)
  return shape is not None and hasattr(x, "dtype") and math.prod(shape) == 0


def _local_shape(shape: tuple, spec: Any, mesh: Any) -> tuple:
  spec = tuple(spec) if isinstance(spec, P) else ()
  out = []
  for d, size in enumerate(shape):
    axes = spec[d] if d < len(spec) else None
    axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
    out.append(size // math.prod(mesh.shape[a] for a in axes))
  return tuple(out)


def shard_map(f: Callable, *, mesh: Any, in_specs: tuple, out_specs: Any,
              **kwargs) -> Callable:
  """``jax.shard_map(f, mesh=..., in_specs=..., out_specs=..., **kwargs)``,
  zero-size input arrays kept out of it (module docstring)."""
  inner = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                        **kwargs)

  def call(*args):
    leaves, treedef = jax.tree.flatten(args)
    holes = [i for i, x in enumerate(leaves) if _empty(x)]
    if not holes:
      return inner(*args)
    specs = jax.tree.leaves(jax.tree.map(
        lambda s, a: jax.tree.map(lambda _: s, a), tuple(in_specs), args,
        is_leaf=lambda s: isinstance(s, P)), is_leaf=lambda s: isinstance(s, P))
    made = {i: (_local_shape(leaves[i].shape, specs[i], mesh), leaves[i].dtype)
            for i in holes}

    def body(*stripped):
      got = treedef.flatten_up_to(stripped)   # None where a hole is
      got = [jnp.zeros(*made[i]) if i in made else x for i, x in enumerate(got)]
      return f(*treedef.unflatten(got))

    stripped = treedef.unflatten([None if i in made else x
                                  for i, x in enumerate(leaves)])
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs, **kwargs)(*stripped)

  return call
