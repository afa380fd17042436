"""The inner optimizer's state as unsharded optax would hold it.

``Zero1State.inner`` is the wrapped optimizer's state over the master shards:
globally, each parameter-shaped leaf (Adam's ``mu``/``nu``, schedule-free's
``z``) is its parameter zero-padded at the end of its shard dim to a multiple
of N and sharded over the data axis there (:mod:`.layout`); the other leaves
(counts, hyperparameters, the moments of scalar parameters) are replicated.
:func:`inner_state` undoes that: every parameter-shaped leaf is cut back to
its parameter's shape and gathered to the parameter's own sharding
(replicated over the data axis), the rest is returned as it is. The result
is what ``inner.init`` / ``inner.update`` on the whole parameters would hold,
so optax's helpers that read an optimizer state work on it::

  eval_params = optax.contrib.schedule_free_eval_params(
      z1.inner_state(tx, opt_state, params), params)

Which leaves are parameter-shaped is decided as for the state's shardings
(:func:`zero1_jax.core.state_dims.state_shard_dims`, used by
:mod:`.specs`); the unpadding is the slice checkpoint export applies to the
master (:func:`zero1_jax.checkpoint.reshard.export_items`).

Example:
  >>> import jax, jax.numpy as jnp, numpy as np, optax, zero1_jax as z1
  >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
  >>> tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  >>> params, opt_state = z1.init(tx, {"w": jnp.ones((5, 3))}, mesh)
  >>> state = inner_state(tx, opt_state, params)
  >>> state[0].mu["w"].shape, state[0].count.shape
  ((5, 3), ())
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zero1_jax.core import elementwise as ew
from zero1_jax.core import layout as lay
from zero1_jax.core import param_axes as pax
from zero1_jax.core import sharded_grads as sg
from zero1_jax.core import shardings as zsh
from zero1_jax.core.state import Zero1State


@functools.partial(jax.jit, static_argnames=("shape", "sharding"))
def _unpad(x: jax.Array, shape: tuple[int, ...], sharding: Any) -> jax.Array:
  # Inside the user's jit on an Explicit data axis the leaf's type is
  # sharded, and JAX cuts a sharded dim only to a multiple of the axis:
  # sharded_grads.cut makes it whole first.
  x = sg.cut(x, shape)
  if sharding is None:
    return x
  if sg.explicit(x):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def _target(x: Any, param: Any, axis: str) -> Any:
  """Where the unpadded leaf goes: the parameter's sharding over the other
  axes of the state's mesh, replicated over the data axis ``axis`` (params
  kept sharded between steps by ``z1.train_step`` are sharded over it too);
  else replicated on that mesh; None off a mesh (a single device, numpy)."""
  if not isinstance(getattr(x, "sharding", None), NamedSharding):
    return None
  mesh = x.sharding.mesh
  ps = getattr(param, "sharding", None)
  if isinstance(ps, NamedSharding) and ps.mesh.shape == mesh.shape:
    drop = lambda e: (None if e == axis else tuple(a for a in e if a != axis)
                      or None if isinstance(e, tuple) else e)
    return NamedSharding(mesh, P(*(drop(e) for e in ps.spec)))
  return NamedSharding(mesh, P())


def inner_state(tx: Any, opt_state: Zero1State, params: Any) -> optax.OptState:
  """``opt_state.inner`` as the unsharded inner optimizer would hold it.

  Args:
    tx: the transformation from :func:`zero1_jax.zero1` /
      :func:`zero1_jax.zero2` that built ``opt_state``.
    opt_state: its state as :func:`zero1_jax.init`, :func:`zero1_jax.train_step`
      or ``tx.init`` / ``tx.update`` under a mesh return it (global arrays,
      outside ``shard_map``), on any mesh, 2-D included; its leaves in
      Flax boxes (linen's ``nn.Partitioned``) or in ``nnx.Optimizer``'s
      Variables (``optimizer.opt_state``) as well.
    params: the parameters, boxed or not (their shapes and shardings are read; integer
      and zero-size ones, which zero1 never updates, are passed to
      ``inner.init`` for the state it holds there).

  Returns:
    The inner optimizer's state: every parameter-shaped leaf unpadded to its
    parameter's shape with the parameter's sharding; every other leaf (step
    counts, injected hyperparameters, a scalar parameter's moments) as it is;
    at integer and zero-size parameters, what ``inner.init`` gives them.
    Bare arrays, as optax holds them for the bare params: boxes and
    Variables are taken off.

  Raises:
    TypeError: ``tx`` is not a zero1 transformation, or ``opt_state`` not a
      ``Zero1State``.
    ValueError: ``opt_state`` does not belong to ``tx`` and ``params`` (its
      tree differs, or a leaf is not the padded parameter: e.g. a per-device
      shard from inside ``shard_map``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, zero1_jax as z1
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = z1.zero1(optax.contrib.schedule_free_adamw(1e-2), axis_name="data")
    >>> params, opt_state = z1.init(tx, {"w": jnp.ones((7,))}, mesh)
    >>> ev = optax.contrib.schedule_free_eval_params(
    ...     inner_state(tx, opt_state, params), params)
    >>> ev["w"].shape
    (7,)
  """
  zsh.require_zero1(tx, "z1.inner_state")
  if not isinstance(opt_state, Zero1State):
    raise TypeError(f"z1.inner_state: opt_state must be the Zero1State that "
                    f"z1.init / tx.init returns, got {type(opt_state).__name__}")
  # Flax boxes (the user's, or those zero1 puts on a state for bare params
  # under zero1(mesh=) with flax loaded) and nnx.Optimizer's Variables off:
  # optax on the bare params holds bare arrays.
  params = pax.values(params)
  p_leaves = jax.tree.leaves(params)
  # Owners do not depend on N: at N=1 every parameter of rank >= 1 is split
  # on some dim, so each parameter-shaped state leaf is found.
  layout = lay.plan(params, 1)
  treedef, _, _, owners = ew.state_shard_dims(tx.inner, layout,
                                              tx.config.master_dtype)
  leaves, got = jax.tree.flatten(pax.values(opt_state.inner))
  if got != treedef:
    raise ValueError(f"z1.inner_state: opt_state.inner has the tree {got}, "
                     f"but tx's inner optimizer on these params builds "
                     f"{treedef}: pass the tx and params opt_state was "
                     f"built for")
  out = []
  for x, i in zip(leaves, owners):
    if i is None:
      out.append(x)
      continue
    shape = tuple(np.shape(p_leaves[i]))
    have = tuple(np.shape(x))
    more = [d for d, (a, b) in enumerate(zip(have, shape)) if a != b]
    if (len(have) != len(shape) or len(more) > 1
        or any(have[d] < shape[d] for d in more)):
      raise ValueError(
          f"z1.inner_state: a state leaf of shape {have} is not parameter "
          f"{jax.tree_util.keystr(_path(params, i))} of shape {shape} padded "
          f"on one dim; call it outside shard_map, on the global state")
    target = _target(x, p_leaves[i], tx.config.axis_name)
    if target is not None:   # gathered first: a sharded dim cannot be cut
      x = jax.device_put(x, target)   # to a size the axis does not divide
    out.append(_unpad(x, shape, target))
  return _fill_static(tx.inner, treedef.unflatten(out), params, layout)


def _is_none(x) -> bool:
  return x is None


def _fill_static(inner: optax.GradientTransformation, state: Any, params: Any,
                 layout: lay.Layout) -> Any:
  """``state`` with the None that zero1's inner optimizer holds at static
  parameters (integer, zero-size: it never sees or updates them) replaced
  by what ``inner.init`` gives them, so that the state maps over the whole
  parameter tree as optax's does. Left as None where that init fails or
  builds another tree."""
  p_leaves = jax.tree.leaves(params)
  if not any(s.kind == lay.STATIC for s in layout.leaves):
    return state
  static = layout.treedef.unflatten([x if s.kind == lay.STATIC else None
                                     for x, s in zip(p_leaves, layout.leaves)])
  try:
    fill, fill_def = jax.tree.flatten(inner.init(static), is_leaf=_is_none)
  except Exception:  # noqa: BLE001 - an init that needs the floats: keep None
    return state
  ours, our_def = jax.tree.flatten(state, is_leaf=_is_none)
  if fill_def != our_def:
    return state
  return our_def.unflatten([f if o is None else o for o, f in zip(ours, fill)])


def _path(tree: Any, i: int) -> tuple:
  return jax.tree_util.tree_flatten_with_path(tree)[0][i][0]


def from_optax_state(tx: Any, optax_state: optax.OptState, params: Any,
                     mesh: Any = None) -> Zero1State:
  """A zero1 state continuing an optax run: the inverse of :func:`inner_state`.

  ``optax_state`` is ``tx.inner``'s state as plain optax holds it (an
  unsharded or data-parallel run, as saved: every moment parameter-shaped and
  whole). Each parameter-shaped leaf is zero-padded at the end of its shard
  dim and sharded over the data axis as ``tx.init`` would place it, at any
  N; the other leaves (counts, hyperparameters) are placed replicated. The
  masters of bf16/fp16 params are the params in the master dtype (optax kept
  none). The loss scale starts fresh.

  Args:
    tx: from :func:`zero1_jax.zero1`, wrapping the optimizer that made
      ``optax_state``.
    optax_state: that optimizer's state.
    params: the params it was trained with (arrays; their shardings over
      other mesh axes are kept, as by ``tx.init``).
    mesh: the mesh to shard over (default: the ``jax.set_mesh`` one, or the
      params', or ``zero1(..., mesh=)``).

  Returns:
    The :class:`Zero1State`; ``inner_state(tx, result, params)`` gives
    ``optax_state`` back bitwise.

  Raises:
    ValueError: ``optax_state`` is not ``tx.inner``'s state for ``params``
      (another tree, or a leaf that is neither the state ``tx.init`` holds
      there nor its parameter's shape).

  Example:
    >>> import jax, jax.numpy as jnp, optax, zero1_jax as z1
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> params = {"w": jnp.ones((13, 4))}
    >>> opt = optax.adam(1e-2)
    >>> tx = z1.zero1(opt, axis_name="data")
    >>> with jax.set_mesh(mesh):
    ...   state = from_optax_state(tx, opt.init(params), params)
    >>> tuple(state.inner[0].mu["w"].sharding.spec)   # split over the data axis
    ('data', None)
    >>> inner_state(tx, state, params)[0].mu["w"].shape
    (13, 4)
  """
  zsh.require_zero1(tx, "z1.from_optax_state")
  bare = pax.unbox(params)
  ctx = jax.set_mesh(mesh) if mesh is not None else _nothing()
  with ctx:
    template = tx.init(bare)
  is_none = lambda x: x is None
  t_leaves, t_def = jax.tree.flatten(template.inner, is_leaf=is_none)
  o_leaves, o_def = jax.tree.flatten(optax_state, is_leaf=is_none)
  if len(o_leaves) != len(t_leaves) or \
      jax.tree.structure(template.inner) != jax.tree.structure(
          t_def.unflatten([None if t is None else o
                           for t, o in zip(t_leaves, o_leaves)])):
    raise ValueError(
        f"z1.from_optax_state: optax_state has the tree {o_def}, but tx's "
        f"inner optimizer on these params holds {t_def}: pass the optax "
        f"state of the optimizer tx wraps, for these params")
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(template.inner,
                                                is_leaf=is_none)[0]]
  out = [None if t is None else _placed(o, t, path, "inner")
         for t, o, path in zip(t_leaves, o_leaves, paths)]
  inner = t_def.unflatten(out)
  p_leaves = jax.tree.leaves(bare)
  m_leaves, m_def = jax.tree.flatten(template.master, is_leaf=is_none)
  master = m_def.unflatten([
      None if m is None else
      _placed(jnp_astype(_on_mesh_of(p, m), m.dtype), m, f"master[{i}]", "master")
      for i, (m, p) in enumerate(zip(m_leaves, p_leaves))])
  return template._replace(master=master, inner=inner)


def jnp_astype(x, dtype):
  return jax.numpy.asarray(x).astype(dtype)


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


def _on_mesh_of(x: Any, like: jax.Array) -> Any:
  """``x`` replicated over ``like``'s mesh where it lies elsewhere (an optax
  state restored onto one device, as params made under ``jax.set_mesh``
  without a placement are): a pad or a cast under a mesh context refuses
  an argument off that mesh's devices."""
  sh = getattr(like, "sharding", None)
  if (isinstance(x, jax.Array) and isinstance(sh, NamedSharding)
      and x.sharding.device_set != sh.device_set):
    return jax.device_put(x, NamedSharding(sh.mesh, P()))
  return x


def _placed(x: Any, like: jax.Array, path: str, what: str) -> jax.Array:
  """``x`` zero-padded to ``like``'s shape (at the end of the dims that
  differ) and placed with ``like``'s sharding."""
  x = jax.numpy.asarray(_on_mesh_of(x, like))
  have, want = tuple(x.shape), tuple(like.shape)
  if len(have) != len(want) or any(a > b for a, b in zip(have, want)) \
      or jax.numpy.dtype(x.dtype) != jax.numpy.dtype(like.dtype):
    raise ValueError(
        f"z1.from_optax_state: {what}{path} is {x.dtype}{list(have)}, not "
        f"the state zero1 holds there ({like.dtype}{list(want)}, its "
        f"parameter padded on one dim): pass the optax state of the "
        f"optimizer tx wraps, for these params")
  if have != want:
    x = jax.numpy.pad(x, [(0, b - a) for a, b in zip(have, want)])
  return jax.device_put(x, like.sharding)
