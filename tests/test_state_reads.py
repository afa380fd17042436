"""A zero1 state reads like its inner optimizer's state (issue #38 item 4).

Training loops read and set ``opt_state.hyperparams["learning_rate"]``
(inject_hyperparams) and read ``opt_state.gradient_step`` / ``mini_step`` /
``acc_grads`` (optax.MultiSteps; google-deepmind/nanodo's train and metrics
code); on ``Zero1State`` they raised AttributeError. Here: attribute reads,
``optax.tree_utils.tree_get`` / ``tree_set`` by name, and setting the
learning rate taking effect, in plain jit, in a flax ``TrainState`` and in
``nnx.Optimizer``.

Comparisons are zero1 against zero1 (the same program: bitwise), or against
optax within tests/test_updates.py's bound (8 ulps of max|u|, measured
bitwise).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import zero1_jax as z1
from zero1_jax.core import state as zstate
from helpers import assert_equal, mesh

N = 8
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 15, dtype=jnp.float32).reshape(5, 3),
          "b": jnp.arange(7, dtype=jnp.float32) / 7}
GRADS = jax.tree.map(lambda x: jnp.cos(3 * x) + 0.25, PARAMS)
inject = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)


def _step(tx, state, params=PARAMS):
  return jax.jit(tx.update)(GRADS, state, params)


def test_hyperparams_read_and_set_in_plain_jit():
  tx = z1.zero1(inject(), axis_name="data")
  with jax.set_mesh(mesh(N)):
    s = tx.init(PARAMS)
    assert float(s.hyperparams["learning_rate"]) == pytest.approx(1e-2)
    assert s.hyperparams is s.inner.hyperparams
    _, s = _step(tx, s)
    assert int(s.count) == 1                       # inject_hyperparams' count
    base, _ = _step(tx, s)
    # Set as inject_hyperparams' docs do: in the state's dict ...
    s.hyperparams["learning_rate"] = jnp.asarray(0.5)
    by_attr, _ = _step(tx, s)
    # ... or with optax.tree_utils.tree_set by name.
    s.hyperparams["learning_rate"] = jnp.asarray(1e-2)
    s2 = optax.tree_utils.tree_set(s, learning_rate=jnp.asarray(0.5))
    assert float(optax.tree_utils.tree_get(s2, "learning_rate")) == 0.5
    by_tree_set, _ = _step(tx, s2)
  # adam's step scales with the rate: 50 times the step at 1e-2, the same
  # arithmetic (one multiply by the rate): within 2 roundings of each.
  for k in PARAMS:
    np.testing.assert_allclose(np.asarray(by_attr[k]), 50 * np.asarray(base[k]),
                               rtol=4 * 2 ** -24, atol=0)
  assert_equal(by_tree_set, by_attr)


def test_multisteps_counters_and_acc_grads():
  """MultiSteps(adam, 3): gradient_step and mini_step as optax counts them;
  acc_grads as zero1 holds it (each leaf padded on its shard dim, zeros,
  sharded over the data axis), said once with where optax's shapes are."""
  opt = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3)
  tx = z1.zero1(opt.gradient_transformation(), axis_name="data")
  t = opt.init(PARAMS)
  zstate._SAID.discard("acc_grads")
  with jax.set_mesh(mesh(N)):
    s = tx.init(PARAMS)
    for _ in range(4):
      _, s = _step(tx, s)
      _, t = opt.update(GRADS, t, PARAMS)
      assert int(s.gradient_step) == int(t.gradient_step)
      assert int(s.mini_step) == int(t.mini_step)
    assert (int(s.gradient_step), int(s.mini_step)) == (1, 1)
    with pytest.warns(UserWarning, match=r"opt_state.acc_grads reads the inner "
                      r"optimizer's state as zero1 holds it: .*padded.*"
                      r"z1.inner_state\(tx, opt_state, params\).acc_grads"):
      acc = s.acc_grads
    with warnings.catch_warnings():
      warnings.simplefilter("error")   # once per name; scalars never
      s.acc_grads, s.gradient_step
    whole = z1.inner_state(tx, s, PARAMS).acc_grads
  assert acc["w"].shape == (8, 3) and acc["b"].shape == (8,)
  for k in PARAMS:
    want = np.asarray(t.acc_grads[k])
    np.testing.assert_allclose(np.asarray(whole[k]), want, rtol=2 ** -20)
    np.testing.assert_array_equal(np.asarray(acc[k])[:want.shape[0]],
                                  np.asarray(whole[k]))
    assert not np.any(np.asarray(acc[k])[want.shape[0]:])   # the padding


def test_multisteps_methods_on_the_wrapped_optimizer():
  """``opt.has_updated(state)`` after only the optimizer line changed
  (``tx = z1.zero1(optax.MultiSteps(...))``; before: AttributeError), as
  optax's MultiSteps answers it each step; ``gradient_transformation()``
  is the zero1 transformation itself, never the unsharded one."""
  opt = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3)
  tx = z1.zero1(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3),
                axis_name="data")
  assert tx.gradient_transformation() is tx
  t = opt.init(PARAMS)
  with jax.set_mesh(mesh(N)):
    s = tx.init(PARAMS)
    said = []
    for _ in range(4):
      _, s = _step(tx, s)
      _, t = opt.update(GRADS, t, PARAMS)
      said.append((bool(tx.has_updated(s)), bool(opt.has_updated(t))))
  assert said == [(False, False), (False, False), (True, True), (False, False)]
  with pytest.raises(AttributeError, match="not optax.MultiSteps"):
    z1.zero1(optax.adam(1e-2), axis_name="data").has_updated(s)


def test_reduce_on_plateaus_scale_reads_and_sets_by_name_as_in_optax():
  """``optax.tree_utils.tree_get(state, "scale")`` / ``tree_set(state,
  scale=0.5)``, how loops read and set ``reduce_on_plateau``'s scale, find
  that scale alone, as in optax: zero1's own loss-scale state (a dataclass,
  which optax's tree functions do not match by field name) is not it.
  Before, ``tree_get`` raised KeyError (two ``scale``s) and ``tree_set``
  set both: with fp16's dynamic loss scaling, the loss scale too."""
  make = lambda: optax.chain(optax.sgd(1e-2), optax.contrib.reduce_on_plateau())
  opt, tx = make(), z1.zero1(make(), axis_name="data")
  t = optax.tree_utils.tree_set(opt.init(PARAMS), scale=jnp.asarray(0.5))
  want, _ = opt.update(GRADS, t, PARAMS, value=jnp.asarray(1.0))
  dyn = z1.zero1(make(), axis_name="data",
                 loss_scale=z1.DynamicLossScale(initial_scale_power=8))
  with jax.set_mesh(mesh(N)):
    s = tx.init(PARAMS)
    assert float(optax.tree_utils.tree_get(s, "scale")) == 1.0
    s = optax.tree_utils.tree_set(s, scale=jnp.asarray(0.5))
    assert float(optax.tree_utils.tree_get(s, "scale")) == 0.5
    got, _ = jax.jit(tx.update)(GRADS, s, PARAMS, value=jnp.asarray(1.0))
    d = optax.tree_utils.tree_set(dyn.init(PARAMS), scale=jnp.asarray(0.5))
  for k in PARAMS:   # -lr * g rounds once, * 0.5 is exact: bitwise
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
  assert float(optax.tree_utils.tree_get(d, "scale")) == 0.5
  assert float(d.loss_scale.scale) == 2.0 ** 8   # zero1's own, untouched


def test_flax_serialization_reads_every_leaf_and_restores_the_state():
  """``flax.serialization`` names a state's leaves (big_vision's sharding
  rules and checkpoints walk ``to_state_dict``) and writes it with
  ``to_bytes``: the loss-scale state, a dataclass since ``tree_get`` must
  not match its ``scale``, is a dict of its fields there, as the NamedTuple
  it was (unregistered, it stayed an object and ``to_bytes`` refused it)."""
  from flax import serialization, traverse_util
  tx = z1.zero1(optax.adam(1e-2), axis_name="data",
                loss_scale=z1.DynamicLossScale(initial_scale_power=8))
  with jax.set_mesh(mesh(N)):
    s = tx.init(PARAMS)
  d = serialization.to_state_dict(s)
  assert set(d["loss_scale"]) == {"scale", "step", "last_overflow", "hysteresis"}
  flat = traverse_util.flatten_dict(d)
  assert all(v is None or isinstance(v, jax.Array) for v in flat.values()), flat
  back = serialization.from_bytes(s, serialization.to_bytes(s))
  assert type(back.loss_scale) is type(s.loss_scale)
  assert float(back.loss_scale.scale) == 2.0 ** 8
  assert_equal(jax.tree.map(np.asarray, back), jax.tree.map(np.asarray, s))


def test_a_name_neither_has_says_where_to_look():
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  with jax.set_mesh(mesh(N)):
    s = tx.init(PARAMS)
  with pytest.raises(AttributeError, match=r"'Zero1State' object has no "
                     r"attribute 'hyperparams', nor has its inner optimizer's "
                     r"state \(tuple\)"):
    s.hyperparams


def test_train_state_reads_and_sets_the_learning_rate():
  """flax.training TrainState around zero1 in plain jit (its
  apply_gradients calls tx.update): the rate read, set, and used."""
  tx = z1.zero1(inject(), axis_name="data")
  step = jax.jit(lambda st: st.apply_gradients(grads=GRADS))
  with jax.set_mesh(mesh(N)):
    st = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    assert float(st.opt_state.hyperparams["learning_rate"]) == pytest.approx(1e-2)
    st = step(st)
    lr = st.opt_state.hyperparams["learning_rate"]
    assert float(lr) == pytest.approx(1e-2)
    slow = step(st)
    st.opt_state.hyperparams["learning_rate"] = jnp.asarray(0.5)
    fast = step(st)
    assert float(fast.opt_state.hyperparams["learning_rate"]) == 0.5
    st2 = st.replace(opt_state=optax.tree_utils.tree_set(
        st.opt_state, learning_rate=jnp.asarray(0.5)))
    assert_equal(step(st2).params, fast.params)
  for k in PARAMS:   # adam's step x 50 (see the plain-jit test)
    np.testing.assert_allclose(
        np.asarray(fast.params[k] - st.params[k]),
        50 * np.asarray(slow.params[k] - st.params[k]), rtol=1e-5, atol=1e-7)


class Lin(nnx.Module):
  def __init__(self, rngs):
    self.l = nnx.Linear(5, 3, rngs=rngs)

  def __call__(self, x):
    return self.l(x)


def test_nnx_optimizer_reads_and_sets_the_learning_rate():
  """nnx.Optimizer holds the state in Variables: the rate is read and set
  through them (``[...]``), as nnx's docs do, and takes effect."""
  loss = lambda m: jnp.sum(m(jnp.ones((2, 5))) ** 2)

  @nnx.jit
  def step(model, opt):
    opt.update(model, nnx.grad(loss)(model))

  def kernel_step(lr):
    with jax.set_mesh(mesh(N)):
      model = Lin(nnx.Rngs(0))
      opt = nnx.Optimizer(model, z1.zero1(inject(), axis_name="data"),
                          wrt=nnx.Param)
      assert float(opt.opt_state.hyperparams["learning_rate"][...]) == \
          pytest.approx(1e-2)
      if lr is not None:
        opt.opt_state.hyperparams["learning_rate"][...] = lr
      before = np.asarray(model.l.kernel[...])
      step(model, opt)
      assert float(optax.tree_utils.tree_get(
          opt.opt_state, "learning_rate")[...]) == pytest.approx(lr or 1e-2)
      return np.asarray(model.l.kernel[...]) - before
  slow, fast = kernel_step(None), kernel_step(jnp.asarray(0.5))
  np.testing.assert_allclose(fast, 50 * slow, rtol=1e-5, atol=1e-7)


def test_a_state_leaf_replaced_at_the_params_shape_is_named_with_the_fix():
  """``optax.tree_utils.tree_set(state, mu=zeros_like(params))``: zero1's
  moments are padded to a multiple of N, so a param-shaped one cannot be
  its; the error names the leaf and the replacement that works (built from
  the state's own leaf), which then steps as Adam from zero moments."""
  m = mesh(8)
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")

  @jax.jit
  def step(p, s):
    g = jax.grad(lambda q: jnp.sum(q["b"] ** 2))(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  with jax.set_mesh(m):
    p = jax.device_put({"b": jnp.ones((7,))}, jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec()))
    p, s = step(p, tx.init(p))
    bad = optax.tree_utils.tree_set(s, mu=jax.tree.map(jnp.zeros_like, p))
    with pytest.raises(ValueError, match=r"opt_state\.inner\[0\]\.mu\['b'\] has "
                       r"shape \(7,\).*tree_get\(state, 'mu'\)"):
      step(p, bad)
    good = optax.tree_utils.tree_set(
        s, mu=jax.tree.map(jnp.zeros_like, optax.tree_utils.tree_get(s, "mu")))
    p2, _ = step(p, good)
  np.testing.assert_array_less(np.asarray(p2["b"]), np.asarray(p["b"]))
