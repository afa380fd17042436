"""Flax integration: a linen ``TrainState`` and an nnx trainer.

linen: :class:`TrainState` is ``flax.training.train_state.TrainState`` whose
``create`` builds the sharded optimizer state on a mesh (``tx.init`` has to
run inside shard_map) and whose ``apply_gradients`` works inside the sharded
step without materialising a full update tree. Use :func:`state_specs` for
the shard_map specs::

    state = z1.flax.TrainState.create(apply_fn=model.apply, params=params,
                                      tx=tx, mesh=mesh)
    specs = z1.flax.state_specs(state, mesh)

    def per_device(state, batch):
      local = jax.lax.pcast(state.params, "data", to="varying")
      grads = jax.grad(loss)(local, batch)        # local, unreduced
      return state.apply_gradients(grads=grads)

    step = jax.jit(jax.shard_map(per_device, mesh=mesh,
                                 in_specs=(specs, P("data")), out_specs=specs))

Outside shard_map flax's own ``TrainState`` and ``nnx.Optimizer(model, tx)``
work unchanged in plain ``jax.jit`` code under ``jax.set_mesh`` (see
:mod:`zero1_jax.core.jit_mode`); this module is for shard_map steps.

nnx: :class:`NnxTrainer` trains with :func:`zero1_jax.train_step`: it splits
the model into its ``wrt`` variables and the rest, trains the former, and
writes them back::

    trainer = z1.flax.NnxTrainer(model, tx, mesh, loss_fn)   # loss_fn(model, batch)
    metrics = trainer.train_step(batch)
    trainer.update_model(model)

It holds every other variable constant, so a model that updates them in the
loss (BatchNorm statistics, the RNG counts of ``nnx.Dropout``) is refused at
the first step with :class:`HeldStateMutated`; train such a model with
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` in plain jit under
``jax.set_mesh``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from flax import errors as flax_errors
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

from zero1_jax.core import fresh_state
from zero1_jax.core import specs as zspecs
from zero1_jax.core import shardings as zsh
from zero1_jax.core import step as zstep
from zero1_jax.core.transform import Zero1Transformation


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` for a :func:`zero1_jax.zero1` tx.

  ``params`` are replicated over the mesh, ``opt_state`` is sharded.
  ``apply_gradients(grads=...)`` must run inside shard_map over the tx's
  axis, with this device's local (unreduced) gradients.
  """

  def apply_gradients(self, *, grads, **kwargs):
    if not isinstance(self.tx, Zero1Transformation):
      return super().apply_gradients(grads=grads, **kwargs)
    fresh_state.warn_if_new(self.tx, lambda s: s)   # restored by flax?
    params, opt_state, _ = self.tx.apply(grads, self.opt_state, self.params)
    return self.replace(step=self.step + 1, params=params,
                        opt_state=opt_state, **kwargs)

  @classmethod
  def create(cls, *, apply_fn, params, tx, mesh: jax.sharding.Mesh | None = None,
             **kwargs):
    """Like flax's ``create``; with a zero1 tx, ``mesh`` is required."""
    if not isinstance(tx, Zero1Transformation):
      return super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    if mesh is None:
      raise ValueError("TrainState.create with a zero1 optimizer needs "
                       "mesh=<the data-parallel mesh> to shard its state.")
    params, opt_state = zstep.init(tx, params, mesh)
    return cls(step=0, apply_fn=apply_fn, params=params, tx=tx,
               opt_state=opt_state, **kwargs)


def state_specs(state: TrainState, mesh: jax.sharding.Mesh) -> TrainState:
  """PartitionSpecs of ``state`` for ``shard_map`` in/out specs."""
  n = zsh.data_size(state.tx, mesh)
  opt = zspecs.state_specs(state.tx, state.params, n)
  return state.replace(step=P(), params=jax.tree.map(lambda _: P(), state.params),
                       opt_state=opt)


class HeldStateMutated(ValueError):
  """:class:`NnxTrainer`'s model updated a variable it holds constant."""


def _held_message(what: str) -> str:
  return (
      f"z1.flax.NnxTrainer: the model updates non-parameter state during the "
      f"loss ({what}). NnxTrainer trains only the `wrt` variables and holds "
      f"every other variable constant, so these updates (BatchNorm "
      f"statistics, the RNG counts nnx.Dropout draws from, a Variable set in "
      f"__call__) cannot be kept. Either train with nnx.Optimizer(model, tx, "
      f"wrt=nnx.Param) in a plain jax.jit / nnx.jit step under "
      f"`with jax.set_mesh(mesh):` (the same zero1 tx; it carries the "
      f"model's state), or make the model deterministic in the loss "
      f"(model.eval(): BatchNorm use_running_average=True, Dropout "
      f"deterministic=True).")


def _values(state: nnx.State) -> dict:
  """``{'bn.mean (BatchStat)': value}`` of ``state``'s variables."""
  return {f"{'.'.join(map(str, path))} ({type(v).__name__})": v.get_value()
          for path, v in nnx.to_flat_state(state)}


class NnxTrainer:
  """Trains the ``wrt`` variables of an nnx model with ZeRO-1.

  The other variables are held constant: a model that updates them in the
  loss (``nnx.BatchNorm`` in training mode, ``nnx.Dropout`` drawing from
  ``nnx.Rngs``, any Variable it sets in ``__call__``) is refused at the
  first ``train_step`` with :class:`HeldStateMutated` naming them. Train
  such a model with ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` in plain
  ``jax.jit`` under ``jax.set_mesh(mesh)``, or call ``model.eval()`` first.

  Args:
    model: an ``nnx.Module``.
    tx: from :func:`zero1_jax.zero1`.
    mesh: the data-parallel mesh.
    loss_fn: ``loss_fn(model, batch) -> scalar`` mean loss.
    wrt: which variables to train (default ``nnx.Param``); the others are
      held constant during the step.
    **step_kwargs: passed to :func:`zero1_jax.train_step`
      (``grad_accum_steps``, ``has_aux``).

  Raises:
    HeldStateMutated: (at the first ``train_step``) the loss updates a
      variable outside ``wrt``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, zero1_jax as z1
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    >>> loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> tx = z1.zero1(optax.adam(1e-2), axis_name="data")
    >>> trainer = z1.flax.NnxTrainer(model, tx, mesh, loss)
    >>> batch = {"x": np.ones((16, 5), np.float32), "y": np.ones((16, 3), np.float32)}
    >>> metrics = trainer.train_step(batch)
    >>> trainer.update_model(model)
  """

  def __init__(self, model: nnx.Module, tx: Zero1Transformation,
               mesh: jax.sharding.Mesh, loss_fn: Callable[[Any, Any], Any],
               *, wrt: Any = nnx.Param, **step_kwargs):
    graphdef, wrt_state, rest = nnx.split(model, wrt, ...)
    self._template = wrt_state

    def rebuild(pure):
      state = jax.tree.map(lambda x: x, self._template)
      nnx.replace_by_pure_dict(state, pure)
      return state

    def loss(pure, batch):
      # This trace's own copies of the held variables: the model may write
      # them here (no TraceContextError), and a write shows as a new value.
      held = jax.tree.map(lambda x: x, rest)
      before = _values(held)
      merged = nnx.merge(graphdef, rebuild(pure), held)
      try:
        out = loss_fn(merged, batch)
      except flax_errors.TraceContextError as e:   # a variable outside both
        raise HeldStateMutated(_held_message(_brief(e))) from e
      after = _values(nnx.split(merged, wrt, ...)[2])
      changed = [k for k in after if k not in before or after[k] is not before[k]]
      if changed:
        raise HeldStateMutated(_held_message(", ".join(changed)))
      return out

    self._rebuild = rebuild
    self.params, self.opt_state = zstep.init(tx, nnx.to_pure_dict(wrt_state),
                                             mesh)
    self._step = zstep.train_step(loss, tx, mesh, **step_kwargs)

  def train_step(self, batch) -> dict:
    """One optimizer step on ``batch``; returns the metrics."""
    self.params, self.opt_state, metrics = self._step(
        self.params, self.opt_state, batch)
    return metrics

  def update_model(self, model: nnx.Module) -> None:
    """Writes the trained variables back into ``model``."""
    nnx.update(model, self._rebuild(self.params))


def _brief(e: Exception) -> str:
  return (str(e).splitlines() or [""])[0][:200]


def assign(variables: Any, values: Any) -> None:
  """Sets each nnx ``Variable`` in ``variables`` to the matching leaf of
  ``values``: e.g. an ``nnx.Optimizer``'s ``opt_state`` to the state
  :meth:`zero1_jax.checkpoint.Checkpointer.restore` returned (bare arrays,
  sharded for the mesh restored onto).

  Example::

    params, opt_state, extra = ckpt.restore(None, tx, nnx.state(model, nnx.Param), mesh)
    nnx.update(model, params)
    z1.flax.assign(optimizer.opt_state, opt_state)

  Raises:
    ValueError: the trees differ (another optimizer, or not Variables).
  """
  is_var = lambda x: isinstance(x, nnx.Variable)
  targets = jax.tree.leaves(variables, is_leaf=is_var)
  got = jax.tree.leaves(values)
  if len(targets) != len(got) or not all(map(is_var, targets)):
    raise ValueError(
        f"zero1 flax.assign: {len(targets)} targets ("
        f"{sum(map(is_var, targets))} nnx Variables) for {len(got)} values; "
        f"pass the optimizer's opt_state and the state restored for the same "
        f"optimizer")
  for var, x in zip(targets, got):
    var.set_value(x)



_ZERO1_KEYS = {"master", "inner", "loss_scale"}


def restore_checkpoint(ckpt_dir: str, target: Any, *, step: int | None = None,
                       mesh: jax.sharding.Mesh | None = None) -> Any:
  """``flax.training.checkpoints.restore_checkpoint`` for a flax
  ``TrainState`` whose tx is zero1, from a checkpoint of an optax run or of
  a zero1 one.

  flax's own restore into a zero1 target fills what the checkpoint lacks
  from the target: an optax checkpoint comes back with params and step
  restored and zero1's moments at zero, count 0 (the warmup restarts, and
  nothing says so). Here an optax ``opt_state`` is read into ``tx.inner``'s
  state and converted with :func:`zero1_jax.from_optax_state` (any N); a
  zero1 one is read as it is. Params and state are placed as in
  ``target``.

  Example::

    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    state = z1.flax.restore_checkpoint(ckpt_dir, state)   # optax or zero1

  Raises:
    ValueError: the checkpoint has no ``params`` / ``opt_state``, or its
      optimizer state is not ``tx``'s inner optimizer's (naming the first
      missing entry, or :func:`zero1_jax.from_optax_state` the difference).
  """
  from flax import serialization
  from flax.training import checkpoints

  from zero1_jax.core import inner_state as zinner

  raw = checkpoints.restore_checkpoint(ckpt_dir, target=None, step=step)
  if raw is None or raw is target or not isinstance(raw, dict) or not {
      "params", "opt_state"} <= set(raw):
    raise ValueError(
        f"z1.flax.restore_checkpoint: {ckpt_dir} holds no TrainState "
        f"checkpoint (params and opt_state)")
  tx = target.tx
  params = serialization.from_state_dict(target.params, raw["params"])
  params = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), params,
                        target.params)
  saved = raw["opt_state"]
  if isinstance(saved, dict) and set(saved) == _ZERO1_KEYS:
    state = serialization.from_state_dict(target.opt_state, saved)
    state = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), state,
                         target.opt_state)
  else:
    template = jax.eval_shape(tx.inner.init, params)
    optax_state = _from_raw(template, saved, "opt_state")
    state = zinner.from_optax_state(tx, optax_state, params, mesh=mesh)
  return target.replace(step=_like(raw.get("step", target.step), target.step),
                        params=params, opt_state=state)


def _like(step: Any, target: Any) -> Any:
  """The restored step as ``target``'s is: a Python int as flax's own
  restore gives it, or an array placed as the target's (an array restored
  without a target lies on one device, which a jit under ``jax.set_mesh``
  refuses beside the mesh's arrays)."""
  if isinstance(target, jax.Array):
    return jax.device_put(jax.numpy.asarray(step, target.dtype), target.sharding)
  if isinstance(target, int):
    return int(np.asarray(step))
  return step


def _from_raw(template: Any, raw: Any, where: str) -> Any:
  """``template``'s tree filled from a restored state dict (tuples keyed
  '0', '1', ...; NamedTuples by field; an empty node may be missing)."""
  if isinstance(template, tuple) and hasattr(template, "_fields"):
    raw = raw or {}
    return type(template)(**{f: _from_raw(getattr(template, f), raw.get(f),
                                          f"{where}.{f}")
                             for f in template._fields})
  if isinstance(template, (tuple, list)):
    raw = raw or {}
    return type(template)(_from_raw(t, raw.get(str(i)), f"{where}[{i}]")
                          for i, t in enumerate(template))
  if isinstance(template, dict):
    raw = raw or {}
    return {k: _from_raw(t, raw.get(k), f"{where}[{k!r}]")
            for k, t in template.items()}
  if template is None:
    return None
  if raw is None:
    raise ValueError(
        f"z1.flax.restore_checkpoint: the checkpoint has no {where}: its "
        f"optimizer state is not that of the optimizer zero1 wraps here")
  return raw
