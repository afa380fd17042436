"""Choices by a leaf's size or shape are refused (core/size_check.py; issue
#38 item 1): the check compares the programs ``inner.init`` and
``inner.update`` trace on the real whole parameters and on their real
shards, operand by operand, literals, constants and shapes included.

Before, it compared the sequence of primitives only ("sizes and constants
aside"), and the numeric probe runs small stand-in leaves that never cross a
real size threshold: ``multi_transform({"big": sgd(0.01), "small":
sgd(0.1)}, labels by x.size > 64)`` on a 16 x 8 kernel ran the same ``mul``
with the other constant on every shard and trained ``w[0, 0]`` to 0.700
where optax gives 0.970 after 3 steps.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import zero1_jax as z1
from zero1_jax.core import elementwise as ew
from zero1_jax.core import layout as lay
from zero1_jax.core import size_check as sc
from helpers import assert_equal, mesh, optax_and_zero1_steps

P = {"w": jnp.ones((16, 8)), "b": jnp.ones((3,))}   # w: 128 elements, 16 per shard at N=8
by_size = lambda ps: jax.tree.map(lambda x: "big" if x.size > 64 else "small", ps)
by_ndim = lambda ps: jax.tree.map(lambda x: "big" if x.ndim > 1 else "small", ps)
SAME_OPS = ("its update runs other operations on the whole parameters than on "
            "a shard (")

# The issue's three: the same operations in every branch, other constants.
ISSUE = {
    "multi_transform": lambda: optax.multi_transform(
        {"big": optax.sgd(0.01), "small": optax.sgd(0.1)}, by_size),
    "partition": lambda: optax.partition(
        {"big": optax.sgd(0.01), "small": optax.sgd(0.1)}, by_size),
    "stateless_with_tree_map": lambda: optax.stateless_with_tree_map(
        lambda g, p: g * (0.1 if p.size > 64 else 1)),
}


def _check(tx_inner, params, n):
  layout = lay.plan(params, n)
  return sc.size_reason(tx_inner, layout, jnp.float32,
                        ew.state_shard_dims(tx_inner, layout)[3])


@pytest.mark.parametrize("name", sorted(ISSUE))
def test_the_issue_choices_by_size_are_refused(name):
  make = ISSUE[name]
  # The jaxpr on the shards is elementwise; the probe's small leaves never
  # reach 64 elements: neither sees it (what let these through).
  layout = lay.plan(P, 8)
  assert ew.jaxpr_reason(make(), layout) is None
  assert ew.probe_reason(make(), layout) is None
  for n in (2, 8):   # at N=2 the shard is 8 x 8 = 64: "small" as well
    with pytest.raises(ValueError, match=re.escape(SAME_OPS)) as e:
      z1.init(z1.zero1(make(), axis_name="data"), P, mesh(n))
    assert "decide by ndim or by path" in str(e.value)
  # The step names the operation each side runs, with its operand's path.
  why = _check(make(), P, 8)
  if name == "stateless_with_tree_map":
    assert ("`mul(grads['w'], 0.1) -> float32[16,8]` against "
            "`mul(grads['w'], 1) -> float32[2,8]`") in why, why
  else:
    assert ("`mul(-0.01, grads['w']) -> float32[16,8]` against "
            "`mul(-0.1, grads['b']) -> float32[1]`") in why, why
  # Plain jit (tx.init under a mesh: TrainState.create, nnx.Optimizer).
  with jax.set_mesh(mesh(8)), pytest.raises(ValueError, match=re.escape(SAME_OPS)):
    z1.zero1(make(), axis_name="data").init(P)


def test_the_same_choices_by_ndim_train_as_optax_bitwise():
  """Labels by ndim see the same on a shard: accepted, and 3 sgd steps give
  optax's weights bitwise (one multiply and one add per element, the same
  on the shard; jit's gradient is whole on every device)."""
  make = lambda: optax.partition({"big": optax.sgd(0.01),
                                  "small": optax.sgd(0.1)}, by_ndim)
  loss = lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(jnp.sin(p["b"]))
  got, want = optax_and_zero1_steps(make, loss, P)
  assert_equal(got, want)
  assert float(got["w"][0, 0]) == pytest.approx(0.98 ** 3, rel=1e-6)   # lr 0.01


def _stateless(fn):
  return optax.GradientTransformation(
      lambda p: optax.EmptyState(), lambda g, s, p=None: (fn(g), s))


def test_operands_are_compared_not_only_the_operations():
  """The same operations with the same constants in the same order, on other
  leaves of the same shape: whole, u x 2 and w x 3; on a shard, w x 2 and
  u x 3. Neither a sequence of (primitive, constant) nor the shapes tell
  them apart; the operands do."""
  def swap(g):
    if g["w"].size > 64:
      u = g["u"] * 2.0
      w = g["w"] * 3.0
    else:
      w = g["w"] * 2.0
      u = g["u"] * 3.0
    return {"u": u, "w": w}
  why = _check(_stateless(swap), {"u": P["w"], "w": P["w"]}, 8)
  assert why and why.startswith(SAME_OPS), why
  assert ("`mul(grads['u'], 2) -> float32[16,8]` against "
          "`mul(grads['w'], 2) -> float32[2,8]`") in why, why


def test_shapes_are_compared():
  """A size-dependent shape with the same operations and constants: a sum of
  4 ones whole, of 6 on a shard (the slice bounds are not literals)."""
  def count(g):
    k = 4 if g["w"].size > 64 else 6
    c = jnp.ones(8)[:k].sum()
    return jax.tree.map(lambda x: x * c, g)
  assert ew.jaxpr_reason(_stateless(count), lay.plan(P, 8)) is None
  why = _check(_stateless(count), P, 8)
  assert why and why.startswith(SAME_OPS), why
  assert "-> float32[4]` against" in why and "-> float32[6]`" in why, why


def test_init_is_compared_too():
  """A state initialised by size (0.5 for large leaves, else 1) that the
  update multiplies in: the update's program is the same on both, its init
  is not. The probe's small leaves stay under the threshold."""
  init = lambda p: jax.tree.map(
      lambda x: jnp.full_like(x, 0.5 if x.size > 64 else 1.0), p)
  tx = optax.GradientTransformation(
      init, lambda g, s, p=None: (jax.tree.map(jnp.multiply, g, s), s))
  assert ew.probe_reason(tx, lay.plan(P, 8)) is None
  why = _check(tx, P, 8)
  assert why and why.startswith("its init runs other operations on the whole "
                                "parameters than on a shard ("), why
  assert "full_like" not in why and "0.5" in why, why


def test_legitimate_optimizers_trace_alike():
  """What every shard runs the same way stays accepted: adam, adamw with a
  mask by ndim, inject_hyperparams with a schedule, MultiSteps, on odd
  shapes and a scalar."""
  params = {"k": jnp.ones((5, 7)), "v": jnp.ones((13,)), "s": jnp.ones(())}
  for inner in (optax.adam(1e-3),
                optax.adamw(1e-3, mask=lambda p: jax.tree.map(
                    lambda x: x.ndim > 1, p)),
                optax.inject_hyperparams(optax.adamw)(
                    learning_rate=optax.cosine_decay_schedule(1e-3, 10)),
                optax.MultiSteps(optax.lion(1e-3), 2).gradient_transformation(),
                optax.chain(optax.clip(1.0), optax.scale_by_rms(),
                            optax.scale(-0.1))):
    for n in (2, 3, 8):
      assert _check(inner, params, n) is None, (inner, n)
