"""Checks of what :func:`zero1_jax.zero1`'s update is handed: each tree
against the parameter layout, with errors naming the first path that differs
and the fix; and of what the user's ``loss_fn`` returns.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zero1_jax.core import layout as lay
from zero1_jax.core.state import stores_master


def check_master(state, layout: lay.Layout, master_dtype) -> list:
  """``state.master``'s leaves (None where not stored), or a ValueError that
  says which parameter's dtype differs from the one the state was built for."""
  try:
    leaves = layout.treedef.flatten_up_to(state.master)
  except (ValueError, TypeError) as e:
    raise ValueError(f"zero1: opt_state.master does not match the parameter "
                     f"tree ({e}).") from None
  for (path, _), m, s in zip(
      jax.tree_util.tree_flatten_with_path(
          layout.treedef.unflatten([0] * len(layout.leaves)))[0],
      leaves, layout.leaves):
    if (m is None) == stores_master(s, master_dtype):
      what = ("has a master copy" if m is not None else "has no master copy")
      raise ValueError(
          f"zero1: opt_state.master{jax.tree_util.keystr(path)} {what}, but "
          f"the parameter is {jnp.dtype(s.dtype).name} (master dtype "
          f"{lay.master_dtype(s.dtype, master_dtype).name}): the state was "
          f"built for params of "
          f"another dtype. Build it from the params you train, e.g. "
          f"z1.init(tx, params, mesh, param_dtype=...) to cast them after "
          f"taking the master.")
  return leaves


WHOLE_STATE = (
    "zero1: opt_state{path} has shape {got}, but this device's shard of it is "
    "{want}. Inside jax.pmap or shard_map each device holds its own 1/N "
    "shards of the state; a state handed whole to every device (pmap's "
    "in_axes=None, flax's jax_utils.replicate, shard_map's in_specs=P()) "
    "would broadcast against the gradient's shard. Create the state where "
    "the step runs (jax.pmap(tx.init), or TrainState.create inside "
    "jax.pmap) and map it over the devices (in_axes=0); give shard_map "
    "in_specs from z1.state_shardings(tx, params, mesh) (their .spec); or "
    "step in plain jax.jit on a mesh, where the state stays global "
    "(docs/forms.md).")


def check_state_shapes(inner, layout: lay.Layout, state, stored: list,
                       view: list) -> None:
  """Inside shard_map or pmap: ``state``'s sharded leaves have this
  device's shard shapes, those of ``inner.init`` on the master shards
  ``view`` (:func:`.inner_update.master_view`) and of the stored masters;
  a ValueError (:data:`WHOLE_STATE`) naming the first that has not. Trees
  that differ are left to the checks that name them."""
  for i, (m, s) in enumerate(zip(stored, layout.leaves)):
    if m is not None and tuple(jnp.shape(m)) != tuple(s.shard_shape):
      path = jax.tree_util.keystr(_leaf_path(layout, i))
      raise ValueError(WHOLE_STATE.format(path=".master" + path,
                                          got=tuple(jnp.shape(m)),
                                          want=tuple(s.shard_shape)))
  want = jax.eval_shape(inner.init, layout.inner_tree(view))
  if jax.tree.structure(want) != jax.tree.structure(state.inner):
    return
  got = jax.tree_util.tree_flatten_with_path(state.inner)[0]
  for (path, g), w in zip(got, jax.tree.leaves(want)):
    if tuple(jnp.shape(g)) != tuple(w.shape):
      raise ValueError(WHOLE_STATE.format(
          path=".inner" + jax.tree_util.keystr(path), got=tuple(jnp.shape(g)),
          want=tuple(w.shape)))


def _leaf_path(layout: lay.Layout, i: int) -> tuple:
  return jax.tree_util.tree_flatten_with_path(
      layout.treedef.unflatten([0] * len(layout.leaves)))[0][i][0]


def check_tree(what: str, tree, layout: lay.Layout, blocks: bool = False
               ) -> list:
  """Leaves of ``tree``; ValueError naming the first path that differs.
  ``blocks``: a sharded leaf may also be this device's block of it
  (``shard_shape``, :func:`zero1_jax.core.jit_mode._block_specs`)."""
  leaves, treedef = jax.tree.flatten(tree)
  if treedef != layout.treedef:
    want = [jax.tree_util.keystr(p) for p, _ in
            jax.tree_util.tree_flatten_with_path(
                layout.treedef.unflatten([0] * len(layout.leaves)))[0]]
    got = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(tree)[0]]
    first = next((f"{w!r} vs {g!r}" for w, g in zip(want, got) if w != g),
                 f"{len(want)} leaves expected, {len(got)} given")
    raise ValueError(f"zero1: {what} tree does not match the parameter tree "
                     f"(first difference: {first}). Pass {what} with the same "
                     f"structure as params.")
  for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(tree)[0],
                             layout.leaves):
    if tuple(x.shape) != spec.shape and not (
        blocks and spec.kind == lay.SHARD
        and tuple(x.shape) == spec.shard_shape):
      raise ValueError(
          f"zero1: {what}{jax.tree_util.keystr(path)} has shape "
          f"{tuple(x.shape)} but the parameter has {spec.shape}.")
  return leaves


def check_shards(tree, layout: lay.Layout) -> list:
  """Leaves of already-reduced gradients (``apply(..., pre_reduced=True)``):
  this device's ``shard_shape`` piece at sharded leaves, the scalar at
  replicated ones, anything (None) at static ones, which come back as
  ShapeDtypeStructs of the parameter; ValueError otherwise."""
  try:
    leaves = layout.treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(f"zero1: pre-reduced grads do not match the parameter "
                     f"tree ({e}).") from None
  for i, (x, spec) in enumerate(zip(leaves, layout.leaves)):
    if spec.kind == lay.STATIC:
      leaves[i] = jax.ShapeDtypeStruct(spec.shape, spec.dtype)
    elif tuple(jnp.shape(x)) != spec.shard_shape:
      path = jax.tree_util.tree_flatten_with_path(
          layout.treedef.unflatten(range(len(leaves))))[0][i][0]
      raise ValueError(
          f"zero1: pre-reduced grads{jax.tree_util.keystr(path)} has shape "
          f"{tuple(jnp.shape(x))} "
          f"but this device's shard is {spec.shard_shape}. pre_reduced=True "
          f"takes the summed 1/N shards (zero2's train_step); pass whole local "
          f"gradients without it.")
  return leaves


def split_loss(out: Any, has_aux: bool) -> tuple[jax.Array, Any]:
  """``(loss, aux)`` from what loss_fn returned; TypeError naming the fix
  when it is not a scalar loss (or a (loss, aux) pair with has_aux)."""
  if has_aux:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      got = (f"one array, {jnp.result_type(out)}{list(jnp.shape(out))}"
             if hasattr(out, "shape") else type(out).__name__)
      raise TypeError(f"zero1: has_aux=True but loss_fn returned {got}, not "
                      f"a (loss, aux) pair; drop has_aux or return both")
    loss, aux = out
  elif isinstance(out, (tuple, list)):
    raise TypeError(f"zero1: loss_fn returned a {type(out).__name__} of "
                    f"{len(out)}; if it is (loss, aux), pass has_aux=True to "
                    f"z1.train_step")
  else:
    loss, aux = out, None
  if jnp.ndim(loss) != 0 or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
    raise TypeError(
        f"zero1: loss_fn must return a floating scalar, the mean loss over the "
        f"examples it is given (each device's share of the batch); got "
        f"{jnp.result_type(loss)}{list(jnp.shape(loss))}. Reduce it, e.g. "
        f"jnp.mean(per_example_loss)")
  return loss, aux


def _manual_types(x) -> tuple[frozenset, frozenset]:
  """(varying, unreduced) manual axes of ``x``'s type inside shard_map."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)   # jax 0.10 - 0.12
  if mat is not None:
    return frozenset(mat.varying), frozenset(mat.unreduced)
  return frozenset(getattr(aval, "vma", ()) or ()), frozenset()


def check_local_grads(grads, axis: str) -> None:
  """Inside a ``shard_map`` that tracks varying axes (``check_vma=True``, its
  default), ValueError if a float gradient is invariant over ``axis``: JAX has
  already summed it over the devices, and reducing it again would apply N
  times the mean gradient. Under ``check_vma=False`` nothing is typed and
  nothing is checked."""
  if axis not in _manual_types(jax.lax.axis_index(axis))[0]:
    return   # check_vma=False: no types to read
  summed = []
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    if not jnp.issubdtype(jnp.asarray(g).dtype, jnp.inexact):
      continue
    varying, unreduced = _manual_types(g)
    if axis not in varying and axis not in unreduced:
      summed.append(jax.tree_util.keystr(path) or "<root>")
  if summed:
    shown = ", ".join(summed[:3]) + (f" (+{len(summed) - 3} more)"
                                     if len(summed) > 3 else "")
    raise ValueError(
        f"zero1: tx.update got gradients that are already reduced over "
        f"'{axis}' (invariant: {shown}). Inside shard_map, jax.grad with "
        f"respect to params that entered as P() sums the per-device "
        f"gradients for you, and zero1 would reduce them again: the update "
        f"would use N times the mean gradient. Differentiate with respect to "
        f"a varying view so each device keeps its own gradient: "
        f"`local = jax.lax.pcast(params, '{axis}', to='varying'); "
        f"grads = jax.grad(loss)(local, batch)` (what z1.train_step does), "
        f"or use z1.train_step.")
