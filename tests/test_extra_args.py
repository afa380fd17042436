"""Extra update arguments in the elementwise check (core/extra_args.py;
issue #38 item 6). ``reduce_on_plateau`` (``value=``), a stateful schedule
of ``inject_hyperparams`` and ``conditionally_mask(...,
forward_extra_args=True)`` were refused at ``tx.init``: the check traced
``update`` without the keywords that zero1's update forwards. Now the check
runs at the first update with them, and refuses only what is not
elementwise with them, or an update they are missing from.

Plain jit under an 8-device mesh, gradients handed whole: zero1's updates
against optax's within tests/test_updates.py's bound (8 ulps of max|u|).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax._src import base as optax_base

import zero1_jax as z1
from helpers import mesh

N = 8
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 15, dtype=jnp.float32).reshape(5, 3),
          "b": jnp.arange(7, dtype=jnp.float32) / 7}
GRADS = jax.tree.map(lambda x: jnp.cos(3 * x) + 0.25, PARAMS)
ULPS_OF_U = 8


def _close(got, want, what):
  for k in want:
    w = np.asarray(want[k])
    atol = ULPS_OF_U * np.finfo(w.dtype).eps * max(np.max(np.abs(w)), 1e-30)
    np.testing.assert_allclose(np.asarray(got[k]), w, rtol=0, atol=atol,
                               err_msg=f"{what} {k}")


def _both(make, extras):
  """zero1 and optax, update after update with ``extras[i]``: the zero1
  state and the list of (zero1 u, optax u)."""
  opt, tx = make(), z1.zero1(make(), axis_name="data")
  t = opt.init(PARAMS)
  out = []
  with jax.set_mesh(mesh(N)):
    s = tx.init(PARAMS)   # was refused here
    step = jax.jit(tx.update)
    for extra in extras:
      u, s = step(GRADS, s, PARAMS, **extra)
      v, t = jax.jit(opt.update)(GRADS, t, PARAMS, **extra)
      out.append((u, v))
  return s, t, out


def test_reduce_on_plateau_takes_its_value():
  """chain(adam, reduce_on_plateau(patience=1)): a loss that does not
  improve halves the scale after the patience runs out, as in optax."""
  make = lambda: optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(
      patience=1, factor=0.5, cooldown=0, accumulation_size=1))
  losses = [1.0, 0.5, 0.5, 0.5, 0.5]
  s, t, out = _both(make, [dict(value=jnp.float32(v)) for v in losses])
  for i, (u, v) in enumerate(out):
    _close(u, v, f"step {i}")
  assert float(s.inner[1].scale) == float(t[1].scale) < 1.0


class _Total(NamedTuple):
  total: jax.Array


class _AddendumSchedule(optax_base.StatefulSchedule):
  """optax's _inject_test ExampleStatefulSchedule: the step size is the
  running total of the ``addendum`` each update is given."""

  def init(self):
    return _Total(jnp.zeros([], jnp.float32))

  def update(self, state, **extra_args):
    return _Total(state.total + extra_args["addendum"])

  def __call__(self, state, **extra_args):
    return state.total


def test_inject_hyperparams_with_a_stateful_schedule():
  make = lambda: optax.inject_hyperparams(optax.scale)(
      step_size=_AddendumSchedule())
  s, t, out = _both(make, [dict(addendum=jnp.float32(0.3))] * 2)
  for i, (u, v) in enumerate(out):
    _close(u, v, f"step {i}")
  # read through the zero1 state (item 4), as optax's test reads its own
  np.testing.assert_allclose(s.hyperparams["step_size"], 0.3, atol=0)
  np.testing.assert_allclose(s.hyperparams_states["step_size"].total, 0.6,
                             rtol=2 ** -23)


def test_conditionally_mask_with_forwarded_arguments():
  """optax's _conditionality_test: updates pass while loss > 0.1."""
  def should_update(step, loss, **extra):
    del step, extra
    return loss > 0.1
  make = lambda: optax.conditionally_mask(optax.scale(2.0), should_update,
                                          forward_extra_args=True)
  _, _, out = _both(make, [dict(loss=jnp.float32(0.2)),
                           dict(loss=jnp.float32(0.0))])
  for (u, v), factor in zip(out, (2.0, 0.0)):
    _close(u, v, "")
    _close(u, jax.tree.map(lambda g: factor * g, GRADS), "")


def test_an_update_without_the_arguments_is_refused_naming_them():
  tx = z1.zero1(optax.chain(optax.adam(1e-2),
                            optax.contrib.reduce_on_plateau()), axis_name="data")
  with jax.set_mesh(mesh(N)):
    s = tx.init(PARAMS)
    with pytest.raises(ValueError) as e:
      jax.jit(tx.update)(GRADS, s, PARAMS)
  msg = str(e.value)
  assert msg.startswith(
      "zero1: the inner optimizer cannot run under zero1 (optax.contrib."
      "reduce_on_plateau (element 1 of optax.chain): its update(grads, "
      "state, params) cannot be traced"), msg
  assert "zero1 forwards tx.update's extra keyword arguments, tx.update(..., value=loss)" in msg, msg
  # z1.train_step passes none: refused at its first step, saying so.
  loss = lambda p, b: sum(jnp.sum(x) * jnp.mean(b) for x in jax.tree.leaves(p))
  p, s = z1.init(tx, PARAMS, mesh(N))
  with pytest.raises(ValueError, match="z1.train_step passes none"):
    z1.train_step(loss, tx, mesh(N))(p, s, jnp.ones(N))


def test_checked_with_scalars_at_init_then_with_the_real_arguments():
  """At tx.init the missing arguments are tried as float32 scalars: a
  condition on the loss in front of lamb is still lamb (a whole-leaf norm),
  refused there. An update scaled by an array argument is elementwise with
  a scalar, but with one value per row of w it is not (w's rows are split
  over the devices): refused at that update."""
  make = lambda: optax.conditionally_mask(
      optax.lamb(1e-2), lambda step, loss: loss > 0.1, forward_extra_args=True)
  with jax.set_mesh(mesh(N)), pytest.raises(
      ValueError, match=r"is not elementwise \(optax.scale_by_trust_ratio .*"
      r"reduce"):
    z1.zero1(make(), axis_name="data").init(PARAMS)

  def update(g, state, params=None, *, scale):
    return jax.tree.map(lambda x: x * scale, g), state
  scaled = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(),
                                                 update)
  tx = z1.zero1(scaled, axis_name="data")
  grads = {"w": GRADS["w"]}
  with jax.set_mesh(mesh(N)):
    s = tx.init({"w": PARAMS["w"]})
    u, _ = jax.jit(tx.update)(grads, s, {"w": PARAMS["w"]},
                              scale=jnp.float32(3))
    _close(u, {"w": 3 * GRADS["w"]}, "")
    with pytest.raises(ValueError, match=r"is not elementwise \(.*: mul "
                       r"broadcasts parameter-shaped data\)"):
      jax.jit(tx.update)(grads, s, {"w": PARAMS["w"]},
                         scale=jnp.arange(5.0).reshape(5, 1))
