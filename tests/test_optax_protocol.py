"""zero1 called the way optax's protocol and optax's own tests call a
transformation (issue #38 item 3): ``update(updates=, state=, params=)``,
``state=None`` for a stateless inner optimizer, an optimizer built under
``jax.set_mesh`` on an Explicit mesh, ``optax.tree_utils.tree_map_params``.
Each crashed before (TypeError, "Expected named tuple, got None",
NotImplementedError from shard_map, a pytree structure error).

Plain jit under an 8-device mesh with gradients handed whole (as optax's
tests do): zero1 runs optax's arithmetic on slices of the same inputs, so
its updates are optax's bitwise where the comparison is zero1 against zero1
(the same program) and within tests/test_updates.py's bound against optax.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zero1_jax as z1
from helpers import assert_equal, mesh

N = 8
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 15, dtype=jnp.float32).reshape(5, 3),
          "b": jnp.arange(7, dtype=jnp.float32) / 7, "s": jnp.float32(0.5)}
GRADS = jax.tree.map(lambda x: jnp.cos(3 * x) + 0.25, PARAMS)


def test_update_takes_optax_argument_names():
  """optax.TransformUpdateFn names the gradients `updates`;
  reduce_on_plateau's own tests call update(updates=..., state=...,
  params=...). grads= (zero1's name before) is taken too."""
  tx = z1.zero1(optax.adam(0.1), axis_name="data")
  with jax.set_mesh(mesh(N)):
    s = tx.init(PARAMS)
    want, ws = tx.update(GRADS, s, PARAMS)
    for kw in (dict(updates=GRADS, state=s, params=PARAMS),
               dict(grads=GRADS, state=s, params=PARAMS)):
      got, gs = tx.update(**kw)
      assert_equal(got, want)
      assert_equal(gs, ws)
    with pytest.raises(TypeError, match="both updates= and grads="):
      tx.update(GRADS, s, PARAMS, grads=GRADS)


@pytest.mark.parametrize("make", [
    lambda: optax.scale(-0.1),
    lambda: optax.stateless(lambda g, p: jax.tree.map(lambda x, y: -x * y, g, p)),
    lambda: optax.clip(0.5),
], ids=["scale", "stateless", "clip"])
def test_stateless_inner_updates_with_state_none(make):
  """optax's tests update stateless transformations with state=None: zero1
  starts a fresh state (eager and under jit) and returns the next one."""
  opt, tx = make(), z1.zero1(make(), axis_name="data")
  want, _ = opt.update(GRADS, None, PARAMS)
  with jax.set_mesh(mesh(N)):
    for update in (tx.update, jax.jit(tx.update)):
      got, state = update(GRADS, None, PARAMS)
      # the same arithmetic on slices of the same inputs: bitwise
      assert_equal(got, want)
      assert isinstance(state, z1.Zero1State)


def test_state_none_is_refused_where_the_inner_keeps_state():
  tx = z1.zero1(optax.adam(0.1), axis_name="data")
  with jax.set_mesh(mesh(N)), pytest.raises(
      ValueError, match=r"state=None, but the inner optimizer keeps state "
      r"\(7 arrays\)\. Pass the state tx.init\(params\) returned"):
    tx.update(GRADS, None, PARAMS)


def test_optimizer_built_under_an_explicit_mesh():
  """inject_hyperparams(adam)(learning_rate=jnp.asarray(1e-3)) made under
  jax.set_mesh closes over a scalar typed {Explicit: ('data',)}, which
  shard_map cannot close over. It trains in plain jit and z1.train_step as
  the same optimizer built from a Python float (bitwise: same program), and
  the caller's optimizer keeps its array."""
  m = mesh(N)
  with jax.set_mesh(m):
    lr = jnp.asarray(1e-3)
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
  assert "Explicit" in str(lr.sharding.mesh.axis_types)
  plain = z1.zero1(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
                   axis_name="data")
  tx = z1.zero1(inner, axis_name="data")
  with jax.set_mesh(m):
    got, want = [], []
    for t, out in ((tx, got), (plain, want)):
      s = t.init(PARAMS)
      u, s = jax.jit(t.update)(GRADS, s, PARAMS)
      out.append(u)
  assert_equal(got, want)
  # z1.init / z1.train_step (shard_map over the data axis).
  loss = lambda p, b: sum(jnp.sum(jnp.sin(x) * jnp.mean(b))
                          for x in jax.tree.leaves(p))
  res = []
  for t in (tx, plain):
    p, s = z1.init(t, PARAMS, m)
    p, s, _ = z1.train_step(loss, t, m)(p, s, jnp.ones(N))
    res.append(p)
  assert_equal(res[0], res[1])
  cells = [c.cell_contents for c in inner.init.__closure__]
  assert any(x is lr for c in cells if isinstance(c, dict) for x in c.values())


def test_tree_map_params_as_optax_docstring_shows():
  """optax.tree_map_params(opt, lambda _, spec: spec, state, specs,
  transform_non_params=lambda _: None): f maps the inner optimizer's
  parameter-shaped trees (adam's mu and nu), everything else, the master
  copies included, goes to transform_non_params."""
  tx = z1.zero1(optax.adam(0.1), axis_name="data")
  specs = jax.tree.map(lambda _: P("model"), PARAMS)
  with jax.set_mesh(mesh(N)):
    state = tx.init(PARAMS)
  out = optax.tree_map_params(tx, lambda _, spec: spec, state, specs,
                              transform_non_params=lambda _: None)
  adam = out.inner[0]
  assert adam.mu == specs and adam.nu == specs, adam
  assert adam.count is None and out.master is None
  assert jax.tree.leaves(out.loss_scale) == []
  # Without transform_non_params the rest is kept; f sees zero1's arrays.
  doubled = optax.tree_map_params(tx, lambda v: v * 2, state)
  np.testing.assert_array_equal(np.asarray(doubled.inner[0].count),
                                np.asarray(state.inner[0].count))
  assert doubled.master == state.master


def test_typed_prng_keys_closed_over_are_moved_too():
  """A typed key made under the mesh (differentially_private_aggregate's
  key=jax.random.key(0) in optax's tests): moved with its bits, not turned
  into numpy (which a typed key refuses)."""
  from zero1_jax.core import explicit_consts
  with jax.set_mesh(mesh(N)):
    key = jax.random.key(3)
  tx = optax.stateless(lambda g, p, k=key: g)
  moved = explicit_consts.movable(tx)
  k2 = moved.update.__closure__[0].cell_contents.__defaults__[0]
  assert jax.dtypes.issubdtype(k2.dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.key_data(k2), jax.random.key_data(key))
  assert not isinstance(k2.sharding, jax.sharding.NamedSharding)
