"""The numeric probe: an inner optimizer on whole leaves vs. on N shards.

:func:`probe_reason` runs two updates on small stand-ins for the parameters
(:func:`probe_layout`: the real shard dims, the same padding), once on the
whole leaves and once on N zero-padded shards, and compares the updates and
*every* state leaf, scalars and PRNG keys included, within a floor of
rounding derived below. It catches what a jaxpr hides (a scale computed from
``x.size``); :mod:`.elementwise` runs it after the jaxpr check.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from zero1_jax.core import layout as lay
  >>> L = lay.plan({"w": jnp.zeros((5, 3))}, 4)
  >>> probe_reason(optax.adam(1e-3), L) is None
  True
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero1_jax.core import extra_args as xa
from zero1_jax.core import layout as lay
from zero1_jax.core.refusal import Refused, brief
from zero1_jax.core.state_dims import leaf_dtype, shard_inputs, state_shard_dims


def probe_layout(layout: lay.Layout, n: int) -> lay.Layout:
  """Small stand-ins for ``layout``'s leaves, split on the same (real) shard
  dims over ``n``: other dims capped at 3, the shard dim kept when at most
  4n rows, else 3n rows plus its remainder mod n (the same padding)."""
  leaves = []
  for s in layout.leaves:
    if s.kind != lay.SHARD:
      leaves.append(s)
      continue
    shape = [min(x, 3) for x in s.shape]
    rows = s.shape[s.dim]
    shape[s.dim] = rows if rows <= 4 * n else 3 * n + rows % n
    per = -(-shape[s.dim] // n)
    shard = tuple(per if j == s.dim else x for j, x in enumerate(shape))
    padded = tuple(per * n if j == s.dim else x for j, x in enumerate(shape))
    leaves.append(lay.LeafSpec(lay.SHARD, tuple(shape), s.dtype, s.dim, shard,
                               padded))
  return lay.Layout(layout.treedef, tuple(leaves), n)


# Rounding allowed between the whole and the sharded probe, in ulps of the
# value's scale (see probe_reason): 8 ulps, 9.5e-7 relative in float32.
ULPS = 8


def _max_abs(x) -> float:
  x = np.abs(np.asarray(x)).astype(np.float64)
  return float(np.max(np.abs(x), initial=0.0, where=np.isfinite(x)))


def _probe_paths(inner: optax.GradientTransformation, small: lay.Layout,
                 dtype: Any) -> list[str]:
  """Names of the probe's compared leaves: the update's (twice), then the
  state's, as ``['w1']`` / ``state[0].mu['w1']``."""
  p = shard_inputs(small, dtype)
  state = jax.eval_shape(inner.init, p)
  names = lambda tree, pre: [pre + jax.tree_util.keystr(k) for k, _ in
                             jax.tree_util.tree_flatten_with_path(tree)[0]]
  return names(p, "") * 2 + names(state, "state")


def _key_data(x):
  """A PRNG key's raw bits (comparable with ``==``); other values as they are.
  Applied inside the probe's jitted program, so that under ``jax.jit(tx.init)``
  nothing traced is left to convert."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(x)
  return x


def probe_reason(inner: optax.GradientTransformation, layout: lay.Layout,
                 dtype: Any = jnp.float32, seed: int = 0,
                 extra: dict | None = None) -> str | None:
  """Two updates on ``probe_layout`` leaves, whole vs. as N shards (zero
  padded, like zero1's master shards): why they differ, or None. ``extra``:
  the update's extra keyword arguments, passed as ones of their shapes.

  Runs with jax's transfers allowed: the probe's numbers are zero1's own,
  copied to a device and back under a program's
  ``jax_transfer_guard="disallow"`` (big_vision sets it) as well."""
  with jax.transfer_guard("allow"):
    return _probe_reason(inner, layout, dtype, seed, extra)


def _probe_reason(inner: optax.GradientTransformation, layout: lay.Layout,
                  dtype: Any, seed: int, extra: dict | None) -> str | None:
  n = layout.num_shards
  small = probe_layout(layout, n)
  try:
    _, dims, _, _ = state_shard_dims(inner, small, dtype)
  except Refused as e:
    return e.why
  full_p, full_g = _probe_values(small, dtype, seed)
  arrays, rebuild = xa.split(extra)
  update = xa.updater(inner, rebuild)
  try:
    whole, parts = _run_both(inner, update, xa.stand_ins(arrays), small,
                             full_p, full_g)
  except Exception as e:  # noqa: BLE001 - an update that fails is refused
    return f"its update fails on the probe: {brief(e)}"
  return _differs(inner, small, dtype, full_p, dims, whole, parts)


def _probe_values(small: lay.Layout, dtype: Any, seed: int
                  ) -> tuple[list, list]:
  """``(params, grads)`` per leaf: normal numbers (grads 1e3 x larger), in
  the dtype the inner optimizer sees; complex: both parts random."""
  rng = np.random.default_rng(seed)

  def normal(s, scale=1.0):   # complex: both parts random (elementwise data)
    dt = leaf_dtype(s, dtype)
    x = rng.normal(size=s.shape) * scale
    if jnp.issubdtype(dt, jnp.complexfloating):
      x = x + 1j * rng.normal(size=s.shape) * scale
    return x.astype(dt)

  full_p, full_g = [], []
  for s in small.leaves:
    full_p.append(normal(s))
    full_g.append(normal(s, 1e3))
  return full_p, full_g


def _split(xs: list, small: lay.Layout) -> list:
  """Leaves -> stacked ``(n, *shard_shape)`` zero-padded shards; scalars
  unbatched."""
  n = small.num_shards
  out = []
  for x, s in zip(xs, small.leaves):
    if s.kind != lay.SHARD:
      out.append(x)
      continue
    pads = [(0, 0)] * x.ndim
    pads[s.dim] = (0, s.padded_shape[s.dim] - s.shape[s.dim])
    x = np.pad(x, pads)
    out.append(np.stack(np.split(x, n, axis=s.dim)))
  return out


def _run_both(inner: optax.GradientTransformation, update: Any, values: Any,
              small: lay.Layout, full_p: list, full_g: list
              ) -> tuple[list, list]:
  """``(whole, parts)``: the leaves of two updates' ``u``, ``u2`` and state
  on the whole leaves, and the same from ``vmap`` over the N shards, in one
  jitted program (``update``: :func:`.extra_args.updater`'s, with the extra
  arguments' stand-ins ``values``)."""
  n = small.num_shards

  def run(p, g):
    state = inner.init(p)
    u, state = update(g, state, p, values)
    u2, state = update(g, state, optax.apply_updates(p, u), values)
    return [_key_data(x) for x in jax.tree.leaves((u, u2, state))]

  axes = small.inner_tree([0 if s.kind == lay.SHARD else None
                           for s in small.leaves])
  tree = lambda xs: small.inner_tree([jnp.asarray(x) for x in xs])
  both = jax.jit(lambda p, g, sp, sg: (
      run(p, g), jax.vmap(run, in_axes=(axes, axes), axis_size=n)(sp, sg)))
  # Concrete numbers even when tx.init is traced (jax.jit(TrainState.create)).
  # Only then: evaluating at compile time compiles each of the optimizer's
  # own jitted helpers on its own (19 programs for adam, 2.98 s against
  # 1.31 s for the first z1.init of a process). On one device, outside the
  # user's mesh: partitioned over jax.set_mesh's 8 devices, bert-large's
  # 369 leaves took 20.2 s to check, against 10.0 (experiments/probes/startup.py).
  traced = isinstance(jnp.zeros(()), jax.core.Tracer)
  with (jax.ensure_compile_time_eval() if traced else contextlib.nullcontext(),
        _no_mesh()):
    return both(tree(full_p), tree(full_g), tree(_split(full_p, small)),
                tree(_split(full_g, small)))


@contextlib.contextmanager
def _no_mesh():
  """No mesh for the probe's own arrays, computed while the caller traces:
  not a shard_map's manual mesh (an update's extra arguments are checked
  there), and not the devices of a ``jax.set_mesh`` mesh, which may be a
  compile-only one (``z1.inspect.gpu.mesh``: nothing runs on its devices;
  ``jax.eval_shape(TrainState.create)`` under it failed with "'Executable'
  object has no attribute 'local_devices'", blamed on the optimizer)."""
  try:   # jax's own context for the concrete mesh (0.10.2-0.12); private
    from jax._src.sharding_impls import _internal_use_concrete_mesh
    from jax._src.mesh import empty_concrete_mesh
    concrete = _internal_use_concrete_mesh(empty_concrete_mesh)
  except (ImportError, AttributeError, AssertionError):  # pragma: no cover
    concrete = contextlib.nullcontext()
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), \
      concrete:
    yield


def _differs(inner: optax.GradientTransformation, small: lay.Layout,
             dtype: Any, full_p: list, dims: list, whole: list, parts: list
             ) -> str | None:
  """Where the sharded updates and state differ from the whole ones beyond
  rounding, in words; None where none does."""
  n = small.num_shards
  floats = [x for x, s in zip(full_p, small.leaves) if s.kind != lay.STATIC]
  u_dims = [s.dim if s.kind == lay.SHARD else None for s in small.leaves
            if s.kind != lay.STATIC]
  for i, (w, ps, d) in enumerate(zip(whole, parts, u_dims * 2 + dims)):
    w, ps = np.asarray(w), np.asarray(ps)
    if d is None:
      got = ps
      w = np.broadcast_to(w, ps.shape)
    else:
      got = np.concatenate(list(ps), axis=d)
      got = got[tuple(slice(0, m) for m in w.shape)]
    update = i < 2 * len(u_dims)
    what = "its update" if update else "its state"
    if got.shape != w.shape:
      return f"{what} has another shape on a shard"
    if jnp.issubdtype(w.dtype, jnp.inexact):
      # The floor. Whole and sharded are two XLA programs; each may round a
      # value differently (fusion, fma, a vmapped scalar), by a few ulps of
      # the operands it was computed from. An update is computed from the
      # parameters and added back to them (schedule-free's update is
      # y_new - params: at a warmup step with lr ~ 0 it is ~1e-7 of pure
      # rounding of params), so its ulps are the parameter's, not its own:
      # the floor is ULPS ulps of max(|update|, |param|). A state leaf is
      # carried as it is, so its floor is ULPS ulps of its own magnitude.
      # What a non-elementwise optimizer changes (a whole-leaf statistic,
      # a size-dependent scale) moves the update by a fraction of itself, not
      # by a few ulps of the parameters: with the probe's gradients (1e3 x
      # the params) any update that moves the weights beyond rounding shows.
      # (An update the schedule keeps ~0 in both probe steps shows nothing;
      # the jaxpr check and the state leaves, at their own scale, still do.)
      scale = _max_abs(w)
      if update:
        scale = max(scale, _max_abs(floats[i % len(u_dims)]))
      atol = ULPS * float(jnp.finfo(w.dtype).eps) * scale
      ok = np.allclose(got, w, rtol=1e-5, atol=atol, equal_nan=True)
    else:
      atol, ok = 0.0, np.array_equal(got, w)
    if not ok:
      diff = np.abs(got.astype(np.complex128) - w).astype(np.float64)
      err = float(np.max(diff, initial=0.0, where=np.isfinite(w)))
      step = f"step {i // len(u_dims) + 1}, " if update else ""
      path = _probe_paths(inner, small, dtype)[i]
      return (f"{what} on N={n} shards differs from the same slices of "
              f"{what} on the whole parameters at {path} ({step}by {err:.3g}, "
              f"beyond rounding: {atol:.3g})")
  return None
