"""Equinox programs (docs/equinox.md): the page's program on Auto and
Explicit meshes, the example's replicated (model, opt_state) warned with the
one change, tx.init before anything is placed, and z1.value_and_grad on an
eqx.partition'ed model.

Weights bound: as tests/test_flax_programs.py (plain-jit mode, the same
Adam chain on the gradient jit reduced): 36 K u relative over K steps.
"""

import pathlib
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zero1_jax as z1
from zero1_jax.core import placement
from helpers import assert_close

K = 5
RTOL = 36 * K * 2.0 ** -24
PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "equinox.md"


@pytest.fixture(scope="module")
def page():
  """The page's program, its definitions only (the loop at its end is what
  tests/test_docs.py runs)."""
  block = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)[0]
  scope = {"__name__": "equinox_page"}
  exec(compile(block.split("\nfor kind in")[0], str(PAGE), "exec"), scope)  # noqa: S102
  return scope


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_page_program_matches_optax_with_an_eighth_of_the_state(page, kind):
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ref, ref_state = page["train"](False, kind, K)
    got, state = page["train"](True, kind, K)
  assert not [m for m in w if "zero1" in str(m.message)], [str(m.message) for m in w]
  assert_close(jax.tree.leaves(eqx.filter(got, eqx.is_array)),
               jax.tree.leaves(eqx.filter(ref, eqx.is_array)), RTOL, "eqx ")
  zb, ob = z1.inspect.device_bytes(state), z1.inspect.device_bytes(ref_state)
  for x in jax.tree.leaves(state):
    if x.ndim:
      assert x.addressable_shards[0].data.size * 8 == x.size, x.sharding
  assert zb * 8 < ob * 1.5, (zb, ob)


def _mlp():
  return eqx.nn.MLP(6, 3, width_size=16, depth=1, key=jax.random.key(0))


def _auto_program():
  """An Auto mesh of 8, P() on it, the MLP, zero1's adam and its state."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  model = _mlp()
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh)
  return (mesh, NamedSharding(mesh, P()), model, tx,
          tx.init(eqx.filter(model, eqx.is_inexact_array)))


@pytest.mark.parametrize("with_params", [False, True])
def test_replicating_model_and_state_warns_with_the_one_change(with_params):
  """Equinox's parallelism example: eqx.filter_shard((model, opt_state),
  replicated) inside the step, and optim.update(grads, opt_state) without
  params as it writes it. The warning names the change."""
  mesh, replicated, model, tx, opt_state = _auto_program()

  @eqx.filter_jit
  def step(model, opt_state, x):
    model, opt_state = eqx.filter_shard((model, opt_state), replicated)
    grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = (tx.update(grads, opt_state, params) if with_params
                          else tx.update(grads, opt_state))
    return eqx.apply_updates(model, updates), opt_state

  x = jax.device_put(jnp.ones((16, 6)), NamedSharding(mesh, P("data")))
  with pytest.warns(UserWarning, match="places zero1's optimizer state") as w:
    step(model, opt_state, x)
  msg = next(str(m.message) for m in w if "zero1" in str(m.message))
  assert placement.EQUINOX_FIX in msg, msg
  assert "Every misplaced leaf is whole on each device" in msg, msg


def test_a_state_replicated_on_the_way_out_warns_once_a_compile():
  """The state constrained replicated only as the step returns it: the
  first step takes it as tx.init placed it (nothing to say); the next one,
  handed it replicated, compiles the cached trace again on Auto axes and
  runs the placement callbacks again. One warning, with every leaf's bytes,
  not one a leaf with the totals of a mix of the two compiles."""
  mesh, replicated, model, tx, opt_state = _auto_program()

  @eqx.filter_jit
  def step(model, opt_state, x):
    grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    updates, opt_state = tx.update(grads, opt_state)
    return eqx.filter_shard((eqx.apply_updates(model, updates), opt_state),
                            replicated)

  x = jax.device_put(jnp.ones((16, 6)), NamedSharding(mesh, P("data")))
  model = eqx.filter_shard(model, replicated)
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    model, opt_state = step(model, opt_state, x)
    assert not [m for m in w if "zero1" in str(m.message)]
    for _ in range(2):
      model, opt_state = step(model, opt_state, x)
  got = [str(m.message) for m in w if "zero1" in str(m.message)]
  leaves = sum(1 for a in jax.tree.leaves(opt_state) if a.ndim)
  assert len(got) == 1, got
  assert f"{leaves} of {leaves} state leaves" in got[0], got[0]


def test_init_before_anything_is_placed_names_mesh_keyword():
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  with pytest.raises(ValueError, match=r"no mesh with axis 'data'.*Equinox.*"
                     r"z1\.zero1\(opt, axis_name='data', mesh=mesh\)"):
    tx.init(eqx.filter(_mlp(), eqx.is_inexact_array))


def _cnn():
  """Equinox's CNN example in small: its filtered tree holds None where the
  pooling, the Lambda and the activations are (before and between the
  arrays), and its static part MaxPool2d's Python float init, -inf."""
  k1, k2 = jax.random.split(jax.random.key(0))
  return eqx.nn.Sequential([
      eqx.nn.Conv2d(1, 2, 3, key=k1), eqx.nn.MaxPool2d(2),
      eqx.nn.Lambda(jax.nn.relu), eqx.nn.Lambda(jnp.ravel),
      eqx.nn.Linear(2 * 5 * 5, 3, key=k2)])


@pytest.mark.parametrize("grad", ["jax", "z1"])
def test_a_cnn_with_pooling_and_lambdas_trains_as_optax(grad):
  """eqx.filter_value_and_grad's loop (grad="jax") and z1.value_and_grad on
  the eqx.partition'ed model (grad="z1": the static half's Python numbers
  reach the loss as numbers, as jax.value_and_grad hands them)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  data = NamedSharding(mesh, P("data"))
  xs = jax.random.normal(jax.random.key(1), (K, 16, 1, 8, 8))
  ys = jax.random.normal(jax.random.key(2), (K, 16, 3))
  loss = lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2)

  def train(tx, zero1_grad):
    model = _cnn()
    state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, x, y):
      diff, static = eqx.partition(model, eqx.is_inexact_array)
      if zero1_grad:
        _, g = z1.value_and_grad(lambda d, s, x, y: loss(eqx.combine(d, s), x, y),
                                 tx, batch_argnums=(2, 3))(diff, static, x, y)
      else:
        _, g = eqx.filter_value_and_grad(loss)(model, x, y)
      u, state = tx.update(g, state, diff)
      return eqx.apply_updates(model, u), state

    for x, y in zip(xs, ys):
      model, state = step(model, state, *jax.device_put((x, y), data))
    return model, state

  want, _ = train(optax.adam(1e-2), False)
  got, state = train(z1.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh),
                     grad == "z1")
  assert_close(jax.tree.leaves(eqx.filter(got, eqx.is_array)),
               jax.tree.leaves(eqx.filter(want, eqx.is_array)), RTOL, "cnn ")
  for x in jax.tree.leaves(state):
    if x.ndim:
      assert x.addressable_shards[0].data.size * 8 == x.size, x.sharding


class _Scaled(eqx.Module):
  """A model whose leaves are not all float arrays: an int field (a leaf
  ``eqx.filter_grad`` gives None) and the MLP's activation functions."""
  n: int
  mlp: eqx.nn.MLP

  def __call__(self, x):
    return self.mlp(x) * self.n


@pytest.mark.parametrize("init", ["filtered", "whole"])
def test_the_whole_model_given_to_init_and_update_trains_as_optax(init):
  """Equinox's examples hand the optimizer the whole model: its
  frozen-layer example ``optim.init(model)`` (activation functions among
  the leaves; optax's sgd ignores them), its vision transformer
  ``optimizer.update(grads, state, model)`` (int fields, whose grads are
  None). zero1 raised "Cannot determine dtype" and "grads tree does not
  match the parameter tree" there; both now train as optax does."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  data = NamedSharding(mesh, P("data"))
  xs = jax.random.normal(jax.random.key(1), (K, 16, 6))
  loss = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)

  def train(tx, whole):
    model = _Scaled(2, _mlp())
    state = tx.init(model if whole else eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, x):
      g = eqx.filter_grad(loss)(model, x)
      u, state = tx.update(g, state, model)
      return eqx.apply_updates(model, u), state

    for x in xs:
      model, state = step(model, state, jax.device_put(x, data))
    return model, state

  want, _ = train(optax.adamw(1e-2), False)
  got, state = train(z1.zero1(optax.adamw(1e-2), axis_name="data", mesh=mesh),
                     init == "whole")
  assert got.n == 2
  assert_close(jax.tree.leaves(eqx.filter(got, eqx.is_array)),
               jax.tree.leaves(eqx.filter(want, eqx.is_array)), RTOL, "eqx ")
  for x in jax.tree.leaves(state):
    if x.ndim:
      assert x.addressable_shards[0].data.size * 8 == x.size, x.sharding
