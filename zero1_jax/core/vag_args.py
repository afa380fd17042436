"""What :func:`zero1_jax.value_and_grad`'s loss is handed besides the params.

The arguments at ``batch_argnums`` are split over the data axis on their
leading dim; the others reach every device whole. Here: the PRNG keys among
the others, with each device's index folded in (:func:`device_keys`; a raw
``uint32[2]`` key is told from data by dtype and shape alone, and
:func:`say_raw_keys` says so); the checks that name a batch left out of
``batch_argnums`` or a scalar in it (:func:`check_batch`,
:func:`batch_hint`); and the arguments as shapes without their placement
(:func:`abstract`), on which zero1 traces the loss for its own checks,
with the data axis bound as the shard_map binds it (:func:`data_axis`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> [x.shape for x in abstract((jnp.ones((4, 2)), 3.0))]
  [(4, 2), ()]
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp

from zero1_jax.core import closed_over


def device_keys(args: tuple, argnums: tuple, axis: str) -> tuple:
  """``args`` (one device's, in the shard_map) with the device's index along
  ``axis`` folded into each PRNG key outside the batch arguments."""
  fold = lambda x: (jax.random.fold_in(x, jax.lax.axis_index(axis))
                    if closed_over.is_key(x) else x)
  return tuple(a if i + 1 in argnums else jax.tree.map(fold, a)
               for i, a in enumerate(args))


RAW_KEY = (
    "zero1: z1.value_and_grad: argument {i} (uint32[2]) is read as a raw PRNG "
    "key (jax.random.PRNGKey's): each device's index along the data axis is "
    "folded into it, so the devices draw different numbers. If it is not a "
    "key, pass device_keys=False (or use typed keys, jax.random.key, which "
    "need no guess).")


def say_raw_keys(args: tuple, argnums: tuple) -> None:
  """Warns for each non-batch argument :func:`device_keys` takes for a raw
  key by its dtype and shape alone."""
  for i, a in enumerate(args):
    if i + 1 not in argnums and any(
        closed_over.is_key(x) and not jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(a)):
      warnings.warn(RAW_KEY.format(i=i + 1), UserWarning, stacklevel=3)


def check_batch(args: tuple, argnums: tuple, axis: str) -> None:
  """Every array of the batch arguments has a leading dim to split, and no
  other argument is placed split over ``axis`` (a batch left out of
  ``batch_argnums``)."""
  for i, a in enumerate(args):
    if i + 1 not in argnums:
      for x in jax.tree.leaves(a):
        where = (jax.typeof(x) if isinstance(x, jax.core.Tracer)
                 else x if isinstance(x, jax.Array) else None)
        if closed_over.data_spec(getattr(where, "sharding", None), axis):
          raise ValueError(
              f"zero1: z1.value_and_grad: argument {i + 1} is split over the "
              f"data axis '{axis}' like the batch, but batch_argnums={argnums} "
              f"leaves it out, so every device would get it whole. If it is "
              f"part of the batch, pass batch_argnums="
              f"{tuple(sorted(set(argnums) | {i + 1}))}.")
      continue
    for path, x in jax.tree_util.tree_leaves_with_path(a):
      if x is not None and jnp.ndim(x) == 0:
        raise ValueError(
            f"zero1: z1.value_and_grad: argument {i + 1}"
            f"{jax.tree_util.keystr(path)} is a scalar in the batch "
            f"(batch_argnums={argnums}), whose arrays are split over the data "
            f"axis on their leading dim. Pass it in an argument of its own "
            f"outside batch_argnums, which every device gets whole: "
            f"z1.value_and_grad(lambda params, batch, scale: ..., tx)"
            f"(params, batch, scale).")


def batch_hint(args: tuple, argnums: tuple) -> str | None:
  """For an error raised running ``fun`` per device: the arguments outside
  ``batch_argnums`` whose leading dim is the batch's (rows every device gets
  whole while the batch is split), if any."""
  rows = {jnp.shape(x)[0] for i, a in enumerate(args) if i + 1 in argnums
          for x in jax.tree.leaves(a) if jnp.ndim(x)}
  whole = [i + 1 for i, a in enumerate(args) if i + 1 not in argnums
           and any(jnp.ndim(x) and jnp.shape(x)[0] in rows
                   for x in jax.tree.leaves(a))]
  if not whole:
    return None
  return (f"zero1: z1.value_and_grad splits the arguments at batch_argnums="
          f"{argnums} over the data axis; argument(s) {tuple(whole)} have the "
          f"batch's leading dim but reach every device whole. If they are part "
          f"of the batch, pass batch_argnums="
          f"{tuple(sorted(set(argnums) | set(whole)))}.")


def abstract(args: tuple) -> tuple:
  """``args`` as shapes and dtypes (weak types kept), without placement."""
  def one(x):
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                                weak_type=getattr(aval, "weak_type", False))
  return tuple(jax.tree.map(one, a) for a in args)


@contextlib.contextmanager
def data_axis(axis: str, n: int):
  """``axis`` (of ``n`` devices) bound while zero1 traces the loss outside
  its shard_map, as the shard_map binds it where the loss runs: a loss may
  use it (``jax.lax.all_gather`` of a contrastive loss's embeddings, a
  ``psum`` of the batch's total weight, flax's ``BatchNorm(axis_name=)``),
  which zero1's checks failed on with "unbound axis name"."""
  try:   # what jax.make_jaxpr(axis_env=...) binds; private (0.10.2-0.12)
    from jax._src.core import extend_axis_env_nd
  except ImportError:  # pragma: no cover
    yield
    return
  with extend_axis_env_nd([(axis, n)]):
    yield
