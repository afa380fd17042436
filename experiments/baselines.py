"""The two data-parallel baselines that ZeRO-1 is measured against.

Both take the same ``loss_fn(params, batch)``, the same optax optimizer, the
same parameters and the same global batch (leading dim split over ``axis``) as
:func:`zero1_jax.train_step`, and both donate params and optimizer state.

* **DDP** (``ddp_init`` / ``ddp_train_step``): plain data parallel in
  ``shard_map``. Params *and the whole optax state* are replicated on every
  device; local gradients are ``pmean``'d over the axis in the parameter dtype
  (one all-reduce of Psi elements), then every device runs the identical
  update. This is PyTorch DDP / DeepSpeed stage 0.
* **GSPMD** (``gspmd_init`` / ``gspmd_train_step``): a plain ``jax.jit`` step
  with no manual collectives. Params are replicated; every optimizer-state leaf
  (and the fp32 master copy, if any) carries a ``NamedSharding`` over ``axis``
  on its first dimension divisible by N, else stays replicated. This is what
  MaxText and flax's nnx optimizer sharding do for ZeRO-1-style optimizer
  sharding; the partitioner decides which collectives to emit.

Mixed precision is handled the way ZeRO does it so the byte counts compare:
if every floating parameter is float32, the parameters *are* the master copy
(``master=None``); otherwise the state holds a float32 ``master`` copy that the
optimizer updates and the low-precision params are cast from.

Example::

    mesh = jax.make_mesh((8,), ("data",))
    tx = optax.adamw(1e-3)
    params, state = ddp_init(tx, params, mesh)
    step = ddp_train_step(loss_fn, tx, mesh)
    params, state, metrics = step(params, state, batch)
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

AXIS = "data"


class BaselineState(NamedTuple):
  master: Any          # float32 copy of the params, or None when params are float32
  inner: optax.OptState


def _floating(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def needs_master(params: Any) -> bool:
  """True when some floating leaf is not float32 (mixed precision)."""
  return any(_floating(x) and jnp.dtype(x.dtype) != jnp.float32
             for x in jax.tree.leaves(params))


def _to_master(params):
  return jax.tree.map(lambda x: x.astype(jnp.float32) if _floating(x) else x, params)


def _init_state(tx, params) -> BaselineState:
  if needs_master(params):
    master = _to_master(params)
    return BaselineState(master, tx.init(master))
  return BaselineState(None, tx.init(params))


def _update(tx, grads, state: BaselineState, params):
  """The optimizer step shared by both baselines: returns new params, state."""
  if state.master is None:
    updates, inner = tx.update(grads, state.inner, params)
    return optax.apply_updates(params, updates), BaselineState(None, inner)
  g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
  updates, inner = tx.update(g32, state.inner, state.master)
  master = optax.apply_updates(state.master, updates)
  new_params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
  return new_params, BaselineState(master, inner)


def _explicit(mesh) -> bool:
  types = getattr(mesh, "axis_types", None) or ()
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def _constrain(x, sharding: NamedSharding):
  if _explicit(sharding.mesh):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


# --------------------------------------------------------------------- DDP


def ddp_init(tx: optax.GradientTransformation, params: Any,
             mesh: jax.sharding.Mesh) -> tuple[Any, BaselineState]:
  """Params and optimizer state, both replicated over every device."""
  rep = NamedSharding(mesh, P())
  params = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=rep)(params)
  state = jax.jit(lambda p: _init_state(tx, p), out_shardings=rep)(params)
  return params, state


def ddp_train_step(loss_fn: Callable, tx: optax.GradientTransformation,
                   mesh: jax.sharding.Mesh, *, axis: str = AXIS,
                   donate: bool = True) -> Callable:
  """Jitted ``(params, state, batch) -> (params, state, {"loss"})``."""

  def per_device(params, state, batch):
    # A varying view of the replicated params keeps the gradients local, so
    # the pmean below is the one and only gradient reduction.
    local = jax.tree.map(
        lambda x: jax.lax.pcast(x, axis, to="varying") if _floating(x) else x, params)
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    grads = jax.lax.pmean(grads, axis)
    new_params, new_state = _update(tx, grads, state, params)
    return new_params, new_state, {"loss": jax.lax.pmean(loss, axis)}

  def step(params, state, batch):
    rep = jax.tree.map(lambda _: P(), params)
    st = jax.tree.map(lambda _: P(), state)
    bs = jax.tree.map(lambda _: P(axis), batch)
    batch = jax.tree.map(lambda x: _constrain(x, NamedSharding(mesh, P(axis))), batch)
    # check_vma=False as in zero1_jax.core.step: jax 0.12's vma rule for
    # lax.polynomial (erf -> exact GELU) rejects ordinary models.
    f = jax.shard_map(per_device, mesh=mesh, in_specs=(rep, st, bs),
                      out_specs=(rep, st, P()), check_vma=False)
    return f(params, state, batch)

  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


# ------------------------------------------------------------------- GSPMD


def first_divisible_spec(shape, n: int, axis: str = AXIS) -> P:
  """``P`` sharding the first dim divisible by ``n`` over ``axis``; else ``P()``."""
  for d, size in enumerate(shape):
    if size % n == 0 and size >= n:
      parts = [None] * len(shape)
      parts[d] = axis
      return P(*parts)
  return P()


def gspmd_state_shardings(tx: optax.GradientTransformation, params: Any,
                          mesh: jax.sharding.Mesh, axis: str = AXIS):
  """NamedShardings of the GSPMD state: every array leaf on its first
  divisible dim (scalars such as adam's count: replicated)."""
  n = mesh.shape[axis]
  shapes = jax.eval_shape(lambda p: _init_state(tx, p), params)
  return jax.tree.map(lambda s: NamedSharding(mesh, first_divisible_spec(s.shape, n, axis)),
                      shapes)


def gspmd_init(tx: optax.GradientTransformation, params: Any,
               mesh: jax.sharding.Mesh, *, axis: str = AXIS
               ) -> tuple[Any, BaselineState]:
  """Replicated params; optimizer state (and master) sharded over ``axis``."""
  rep = NamedSharding(mesh, P())
  params = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=rep)(params)
  shardings = gspmd_state_shardings(tx, params, mesh, axis)
  state = jax.jit(lambda p: _init_state(tx, p), out_shardings=shardings)(params)
  return params, state


def gspmd_train_step(loss_fn: Callable, tx: optax.GradientTransformation,
                     mesh: jax.sharding.Mesh, params: Any, *, axis: str = AXIS,
                     donate: bool = True) -> Callable:
  """Jitted ``(params, state, batch) -> (params, state, {"loss"})``.

  ``params`` (arrays or ShapeDtypeStructs) only fixes the state shardings; no
  collective is written by hand: the partitioner derives them from the
  shardings of the inputs and outputs.
  """
  rep = NamedSharding(mesh, P())
  state_sh = gspmd_state_shardings(tx, params, mesh, axis)
  param_sh = jax.tree.map(lambda _: rep, params)

  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    new_params, new_state = _update(tx, grads, state, params)
    return new_params, new_state, {"loss": loss}

  def batch_sharding(batch):
    return jax.tree.map(lambda _: NamedSharding(mesh, P(axis)), batch)

  jitted = {}

  class _Step:
    """jit with the batch sharding filled in from the first batch's tree."""

    def _get(self, batch):
      key = jax.tree.structure(batch)
      if key not in jitted:
        jitted[key] = jax.jit(
            step, in_shardings=(param_sh, state_sh, batch_sharding(batch)),
            out_shardings=(param_sh, state_sh, rep),
            donate_argnums=(0, 1) if donate else ())
      return jitted[key]

    def __call__(self, params, state, batch):
      return self._get(batch)(params, state, batch)

    def lower(self, params, state, batch):
      return self._get(batch).lower(params, state, batch)

  return _Step()


# ------------------------------------------------------------------- floor


def floor_init(params: Any, mesh: jax.sharding.Mesh) -> tuple[Any, None]:
  """Replicated params and no optimizer state (see :func:`floor_train_step`)."""
  rep = NamedSharding(mesh, P())
  return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=rep)(params), None


def floor_train_step(loss_fn: Callable, mesh: jax.sharding.Mesh, *,
                     axis: str = AXIS, lr: float = 1e-4,
                     donate: bool = True, mean_loss: bool = False) -> Callable:
  """The no-communication floor: forward, backward and a local SGD step on
  each device's own batch shard, with no collective at all (the devices'
  params drift apart; only its time and memory are meaningful). Every
  data-parallel method does at least this much work; its overhead is what it
  costs above it. Jitted ``(params, None, batch) -> (params, None, {"loss"})``.
  """

  def per_device(params, batch):
    local = jax.tree.map(
        lambda x: jax.lax.pcast(x, axis, to="varying") if _floating(x) else x, params)
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    new = jax.tree.map(lambda p, g: (p - lr * g).astype(p.dtype) if _floating(p) else p,
                       params, grads)
    return new, jax.lax.pmean(loss, axis) if mean_loss else loss

  def step(params, state, batch):
    rep = jax.tree.map(lambda _: P(), params)
    bs = jax.tree.map(lambda _: P(axis), batch)
    batch = jax.tree.map(lambda x: _constrain(x, NamedSharding(mesh, P(axis))), batch)
    # Outputs declared replicated though they differ per device: nothing is
    # communicated, which is the point (check_vma=False lets it through).
    f = jax.shard_map(per_device, mesh=mesh, in_specs=(rep, bs),
                      out_specs=(rep, P()), check_vma=False)
    new, loss = f(params, batch)
    return new, state, {"loss": loss}    # device 0's loss

  return jax.jit(step, donate_argnums=(0,) if donate else ())
