"""Wrappers zero1 goes inside of: ``optax.lookahead`` and
``optax.contrib.sam``.

Both call their optimizer on whole gradients and do something around it
that does not fit zero1's ``update(grads, state, params)`` on shards:
lookahead's params are ``LookaheadParams`` (fast and slow weights) while the
gradients are the fast weights'; sam's adversarial step normalizes the whole
gradient, and with ``opaque_mode=True`` its update evaluates the loss's
gradient at perturbed params. Put around them, zero1 refuses and names the
form that works; put inside them, around their optimizer, it shards that
optimizer's state 1/N and trains as optax.

Plain ``jax.jit`` on an 8-device mesh, as a user's loop runs them.

Bound (FP32_SAME_MATH): both sides compute the same elementwise Adam steps
on the same gradients (here no sum is split: the gradients are computed
whole, then sliced), and lookahead's slow update and sam's adversarial step
run on whole arrays in both. Only the two XLA programs' rounding differs
(fusion, FMA contraction): at most ~1 ulp of each weight per step where the
update is added back, and an Adam update that differs by an ulp of its
inputs moves the weight by ~lr * 1e-7. Over 6 steps: 6 ulps of max|w| =
6 * 2^-23 = 7e-7 of it; we allow 2e-6 (3x, for another CPU's code
generation). Measured: 5.3e-8 (lookahead), 5.4e-8 (sam, opaque), 1.3e-8
(sam). A lost or doubled Adam step moves a weight by ~lr = 1e-2: thousands
of times the bound, for max|w| of a few units.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from optax import contrib

import zero1_jax as z1
from helpers import mesh

N = 8
STEPS = 6
FP32_SAME_MATH = 2e-6


def _params():
  r = np.random.default_rng(0)
  return {"w": jnp.asarray(r.normal(size=(16, 5)) * 0.5, jnp.float32),
          "b": jnp.asarray(r.normal(size=(5,)) * 0.5, jnp.float32)}


def _loss(p):
  return jnp.sum(jnp.sin(3 * p["w"]) ** 2) + jnp.sum((p["b"] - 1.0) ** 2)


def _assert_close(got, want):
  for (k, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                       jax.tree.leaves(want)):
    err = float(jnp.max(jnp.abs(g - w)))
    assert err <= FP32_SAME_MATH * float(jnp.max(jnp.abs(w))), (k, err)


def _array(leaf):
  """A state leaf's array: zero1(mesh=) outside jax.set_mesh boxes sharded
  leaves in flax's nn.Partitioned once flax is loaded (core/boxes.py)."""
  return getattr(leaf, "value", leaf)


def _zero1_adam(m):
  return z1.zero1(optax.adam(1e-2), axis_name="data", mesh=m)


# --- optax.lookahead ---------------------------------------------------------

def test_lookahead_around_zero1_trains_as_optax_with_the_fast_state_sharded():
  m = mesh(N)
  params = optax.LookaheadParams.init_synced(_params())
  ref = optax.lookahead(optax.adam(1e-2), 2, 0.5)
  tx = optax.lookahead(_zero1_adam(m), 2, 0.5)

  @jax.jit
  def step(p, s):
    u, s = tx.update(jax.grad(_loss)(p.fast), s, p)
    return optax.apply_updates(p, u), s

  p, s = params, tx.init(params)
  q, t = params, ref.init(params)
  for _ in range(STEPS):
    p, s = step(p, s)
    v, t = ref.update(jax.grad(_loss)(q.fast), t, q)
    q = optax.apply_updates(q, v)
  _assert_close(p, q)                       # fast and slow weights
  assert not np.allclose(p.slow["w"], params.slow["w"])   # the slow ones moved
  mu = _array(s.fast_state.inner[0].mu["w"])
  assert mu.sharding.spec == P("data", None)
  assert mu.addressable_shards[0].data.shape == (16 // N, 5)


@pytest.mark.parametrize("check", [True, False])
def test_zero1_around_lookahead_names_the_form_that_works(check):
  tx = z1.zero1(optax.lookahead(optax.adam(1e-2), 2, 0.5), axis_name="data",
                mesh=mesh(N), check_elementwise=check)
  params = optax.LookaheadParams.init_synced(_params())
  with pytest.raises(ValueError, match=r"optax.lookahead cannot run inside "
                     r"zero1 .*optax.lookahead\(z1.zero1\(fast_optimizer"):
    tx.init(params)


def test_zero1_around_lookahead_on_plain_params_names_the_form_that_works():
  tx = z1.zero1(optax.lookahead(optax.adam(1e-2), 2, 0.5), axis_name="data",
                mesh=mesh(N))
  with pytest.raises(ValueError, match=r"Put zero1 inside it instead: "
                     r"optax.lookahead\(z1.zero1"):
    tx.init(_params())


# --- optax.contrib.sam ---------------------------------------------------------

def _sam(opt, opaque):
  # optax's usual adversarial step: the gradient normalized over the tree
  adv = optax.chain(contrib.normalize(), optax.sgd(0.05))
  return contrib.sam(opt, adv, sync_period=2, opaque_mode=opaque)


@pytest.mark.parametrize("opaque", [True, False])
def test_sam_around_zero1_trains_as_optax(opaque):
  m = mesh(N)
  kw = {"grad_fn": lambda p, _: jax.grad(_loss)(p)} if opaque else {}
  ref, tx = _sam(optax.adam(1e-2), opaque), _sam(_zero1_adam(m), opaque)

  @jax.jit
  def step(p, s):
    u, s = tx.update(jax.grad(_loss)(p), s, p, **kw)
    return optax.apply_updates(p, u), s

  p = q = _params()
  s, t = tx.init(p), ref.init(q)
  for _ in range(STEPS):
    p, s = step(p, s)
    v, t = ref.update(jax.grad(_loss)(q), t, q, **kw)
    q = optax.apply_updates(q, v)
  _assert_close(p, q)
  assert _array(s.opt_state.inner[0].nu["w"]).sharding.spec == P("data", None)


@pytest.mark.parametrize("opaque", [True, False])
def test_zero1_around_sam_names_the_form_that_works(opaque):
  # opaque: its update needs grad_fn; transparent: normalize reads the tree
  tx = z1.zero1(_sam(optax.adam(1e-2), opaque), axis_name="data",
                mesh=mesh(N))
  with pytest.raises(ValueError, match=r"optax.contrib.sam cannot run inside "
                     r"zero1 .*optax.contrib.sam\(z1.zero1\(optimizer"):
    tx.init(_params())
