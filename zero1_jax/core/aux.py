"""``z1.value_and_grad``'s ``aux``: what ``jax.value_and_grad``'s would hold.

The loss runs on each device's piece of the batch, so each device has its
own aux. A leaf whose leading dim grows with the batch (per example: the
loss on the whole batch gives N times the rows it gives on a piece, as
logits do) comes back as the devices' pieces in order: the whole batch's
rows, split over the data axis, as ``jax.value_and_grad`` returns them.
Every other leaf is reduced over the devices by ``aux_reduce``:

* ``"mean"`` (the default): the mean of the devices' values, right for a
  mean over the batch (as the loss is);
* ``"sum"``: their sum, right for a sum or a count over the batch;
* a function ``(aux, axis_name) -> aux`` of one device's leaves (its
  per-example leaves ``None``), reducing with ``jax.lax`` collectives over
  the axis, for a tree that holds both.

An integer leaf averaged (a count comes out 1/N of the batch's, as a float)
says so. A leaf whose shape depends on the batch other than by its leading
dim is refused.

Example:
  >>> import jax, jax.numpy as jnp
  >>> fun = lambda p, x: {"rows": x * p, "n": jnp.sum(x), "m": jnp.mean(x)}
  >>> x = jnp.ones((8, 3))
  >>> per_example(fun, (1.0, x), (1.0, x[:2]), 4)
  {'m': False, 'n': False, 'rows': True}
  >>> split(per_example(fun, (1.0, x), (1.0, x[:2]), 4), {"rows": 1, "n": 2, "m": 3})
  ({'m': 3, 'n': 2, 'rows': None}, {'m': None, 'n': None, 'rows': 1})
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zero1_jax.core import rows as batch_rows

MEAN, SUM = "mean", "sum"

BATCH_SHAPED = (
    "zero1: aux leaf {path} is {local} on a device's piece of the batch and "
    "{whole} on the whole batch: only a leaf whose leading dim grows with the "
    "batch (per example) can be put back together. Return it per example on "
    "its leading dim, or reduce it inside the loss.")
INT_MEAN = (
    "zero1: aux leaves {paths} are integers, averaged over the {n} pieces of "
    "the batch (aux_reduce='mean'): a count comes out 1/{n} of the whole "
    "batch's, as a float, where jax.value_and_grad gives the batch's. If they "
    "are sums or counts pass aux_reduce='sum' (z1.value_and_grad also takes a "
    "function (aux, axis_name) -> aux that sums those with jax.lax.psum and "
    "averages the rest with jax.lax.pmean).")
PER_EXAMPLE_STEP = (
    "zero1: aux leaves {paths} hold one row per example; z1.train_step "
    "returns aux reduced over the micro-batches and devices, which would mix "
    "different examples' rows. Reduce them inside the loss, or compute them "
    "with z1.value_and_grad in your own jax.jit, which returns per-example "
    "leaves for the whole batch.")


def check_reduce(how: Any, functions: bool = True) -> Any:
  if how in (MEAN, SUM) or (functions and callable(how)):
    return how
  raise ValueError(
      f"aux_reduce must be 'mean', 'sum'"
      f"{' or a function (aux, axis_name) -> aux' if functions else ''}, got {how!r}")


def check_step(fun_aux: Callable, params: Any, batch: Any, pieces: int,
               how: Any) -> None:
  """``z1.train_step``'s aux, reduced over ``pieces`` micro-batches x
  devices: per-example leaves refused, integers averaged warned."""
  piece = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (x.shape[0] // pieces,) + x.shape[1:], x.dtype), batch)
  rows = per_example(fun_aux, (params, batch), (params, piece), pieces, how)
  paths = [jax.tree_util.keystr(path) for path, r in
           jax.tree_util.tree_flatten_with_path(rows)[0] if r]
  if paths:
    raise ValueError(PER_EXAMPLE_STEP.format(paths=", ".join(paths)))


def per_example(fun_aux: Callable, whole_args: tuple, piece_args: tuple,
                n: int, how: Any = MEAN, argnums: tuple = (1,)) -> Any:
  """A tree like the aux of ``fun_aux(*args)``: True where a leaf's leading
  dim on the whole batch (``whole_args``) is ``n`` times that on one
  device's piece (``piece_args``, abstract or concrete), False where the
  two shapes match; ValueError for any other change. Warns (for the caller
  of the caller) if ``how`` averages integer leaves computed from the batch
  (the arguments at ``argnums``; one computed from none is the same on
  every device, and its mean is it)."""
  whole = jax.eval_shape(fun_aux, *whole_args)
  piece = jax.eval_shape(fun_aux, *piece_args)

  def one(path, w, p):
    if w.shape == p.shape:
      return False
    if w.shape[1:] == p.shape[1:] and w.shape[:1] == (n * p.shape[0],):
      return True
    raise ValueError(BATCH_SHAPED.format(path=jax.tree_util.keystr(path),
                                         local=p.shape, whole=w.shape))
  rows = jax.tree_util.tree_map_with_path(one, whole, piece)
  ints = [jax.tree_util.keystr(path) for (path, x), r in
          zip(jax.tree_util.tree_flatten_with_path(piece)[0], jax.tree.leaves(rows))
          if not r and jnp.issubdtype(x.dtype, jnp.integer)]
  if how == MEAN and ints and n > 1:
    free = [jax.tree_util.keystr(path) for (path, _), f in zip(
        jax.tree_util.tree_flatten_with_path(piece)[0],
        batch_rows.batch_free(fun_aux, whole_args, argnums)) if f]
    ints = [i for i in ints if i not in free]
  if how == MEAN and ints and n > 1:
    warnings.warn(INT_MEAN.format(paths=", ".join(ints), n=n), UserWarning,
                  stacklevel=3)
  return rows


def split(rows: Any, aux: Any) -> tuple[Any, Any]:
  """``(reduced part, per-example part)`` of ``aux``: each a tree like it
  with the other part's leaves ``None``."""
  rows_l, treedef = jax.tree.flatten(rows)
  aux_l = treedef.flatten_up_to(aux)
  return (treedef.unflatten([None if r else a for r, a in zip(rows_l, aux_l)]),
          treedef.unflatten([a if r else None for r, a in zip(rows_l, aux_l)]))


def join(rows: Any, reduced: Any, examples: Any) -> Any:
  """``aux`` back from :func:`split`'s two parts."""
  rows_l, treedef = jax.tree.flatten(rows)
  r_l = treedef.flatten_up_to(reduced)
  e_l = treedef.flatten_up_to(examples)
  return treedef.unflatten([e if r else v for r, v, e in zip(rows_l, r_l, e_l)])


def reduce(aux: Any, rows: Any, how: Any, axis: str) -> Any:
  """One device's ``aux`` (inside the shard_map): per-example leaves as they
  are, the rest reduced over ``axis`` by ``how``."""
  reduced, examples = split(rows, aux)
  if how == MEAN:
    reduced = jax.lax.pmean(reduced, axis)
  elif how == SUM:
    reduced = jax.lax.psum(reduced, axis)
  else:
    reduced = how(reduced, axis)
  return join(rows, reduced, examples)


def out_specs(rows: Any, axis: str) -> Any:
  """The shard_map's out specs of the aux: per-example leaves split over
  ``axis`` on their leading dim, the rest replicated."""
  return jax.tree.map(lambda r: P(axis) if r else P(), rows)
