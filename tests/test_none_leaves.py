"""A None in the params is no leaf: Equinox's filtered-out parts
(``eqx.filter(model, eqx.is_array)`` leaves None where an activation, a
frozen layer or a ``Lambda`` was) and its ``Linear(use_bias=False)`` hold
one, before or between the arrays. Every path trains them as optax does.

Integer params and gradients (test_lookup.py's tied linear model): every
sum exact, so each path equals optax bitwise; a gradient or update handed
to the neighbouring leaf would not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero1_jax as z1
from test_lookup import _int_batch, _int_params, _mesh, _optax_steps, _tied_linear

N, LR = 4, 0.5


def _with_nones(params):
  """None first, between and last (dict keys sort: a < emb < m < w < z)."""
  return {"a": None, "emb": params["emb"], "m": None, "w": params["w"], "z": None}


def _jit_grad_steps(params, batches, n):
  tx = z1.zero1(optax.sgd(LR), axis_name="data")
  with jax.set_mesh(_mesh(n)):
    state = tx.init(params)
    step = jax.jit(lambda p, s, b: _apply(tx, jax.grad(_tied_linear)(p, b), s, p))
    for b in batches:
      params, state = step(params, state, b)
  return params


def _vg_steps(params, batches, n):
  tx = z1.zero1(optax.sgd(LR), axis_name="data")
  with jax.set_mesh(_mesh(n)):
    state = tx.init(params)

    @jax.jit
    def step(p, s, b):   # the lookups on: the table's gradient added by leaf
      _, g = z1.value_and_grad(_tied_linear, tx, shard_lookups=True)(p, b)
      return _apply(tx, g, s, p)

    for b in batches:
      params, state = step(params, state, b)
  return params


def _train_step_steps(params, batches, n):
  mesh = _mesh(n)
  tx = z1.zero1(optax.sgd(LR), axis_name="data")
  p, s = z1.init(tx, params, mesh)
  step = z1.train_step(_tied_linear, tx, mesh, shard_params=True, shard_lookups=True)
  for b in batches:
    p, s, _ = step(p, s, b)
  return p


def _apply(tx, g, s, p):
  u, s = tx.update(g, s, p)
  return optax.apply_updates(p, u), s


@pytest.mark.parametrize("path", [_jit_grad_steps, _vg_steps, _train_step_steps],
                         ids=["jax.grad+tx.update", "z1.value_and_grad", "train_step"])
def test_nones_before_between_and_after_the_arrays_train_as_optax(path):
  params = _with_nones(_int_params())
  batches = [_int_batch(jax.random.key(i), 8) for i in range(2)]
  want = _optax_steps(_tied_linear, params, batches, LR)
  got = path(params, batches, N)
  assert jax.tree.structure(got) == jax.tree.structure(params)
  for k in ("emb", "w"):
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


def test_an_adam_state_on_params_with_nones_is_sharded():
  """The moments of the arrays split over the data axis; no state for a None."""
  params = {"a": None, "w": jnp.ones((16, 16)), "b": jnp.ones((3,))}
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  with jax.set_mesh(_mesh(N)):
    state = tx.init(params)
    grads = jax.tree.map(lambda p: p * 0.5, params)
    u, state = jax.jit(tx.update)(grads, state, params)
  ref = optax.adam(1e-2)
  want, _ = ref.update(grads, ref.init(params), params)
  for k in ("w", "b"):   # one Adam step: the same element-wise arithmetic
    np.testing.assert_allclose(u[k], want[k], rtol=0, atol=2e-9, err_msg=k)
  mu = state.inner[0].mu
  assert mu["a"] is None and mu["w"].addressable_shards[0].data.shape == (4, 16)
