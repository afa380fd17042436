"""Choices by a parameter's dtype are refused (core/dtype_check.py): zero1
runs the inner optimizer on each bf16 / fp16 param's fp32 master, so a mask
or label decided by dtype decides otherwise than optax on the same params.

Before, nothing said so: ``multi_transform({"train": sgd(0.1), "frozen":
set_to_zero()}, labels by x.dtype == float32)`` moved a bf16 kernel it meant
to freeze by 0.340 in 3 steps where optax left it at 1.0, and ``masked(sgd,
mask by dtype)`` stepped the bf16 leaf optax passes through. The check
compares the programs init and update trace on the params in their own
dtypes and on their masters; arithmetic at the param's precision (bf16
rounding, a bf16 literal, ``finfo(dtype).eps``, conversions, random draws at
the dtype's width) is not a decision.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import zero1_jax as z1
from zero1_jax.core import dtype_check as dc
from zero1_jax.core import layout as lay
import elementwise_sweep as sweep
from helpers import assert_equal, mesh, optax_and_zero1_steps

P = {"w32": jnp.ones((16, 8), jnp.float32), "wbf": jnp.ones((16, 8), jnp.bfloat16)}
is_f32 = lambda p: jax.tree.map(lambda x: x.dtype == jnp.float32, p)
label = lambda p: jax.tree.map(
    lambda x: "train" if x.dtype == jnp.float32 else "frozen", p)
by_path = lambda p: jax.tree_util.tree_map_with_path(
    lambda k, x: "train" if "32" in jax.tree_util.keystr(k) else "frozen", p)
DECIDES = "zero1: the inner optimizer decides by dtype ("

BY_DTYPE = {
    "multi_transform freezing by dtype": lambda: optax.multi_transform(
        {"train": optax.sgd(0.1), "frozen": optax.set_to_zero()}, label),
    "masked sgd by dtype": lambda: optax.masked(optax.sgd(0.1), is_f32),
    "adamw decaying by dtype": lambda: optax.adamw(
        1e-2, weight_decay=0.1, mask=is_f32),
    "masked adam by dtype (another state)": lambda: optax.masked(
        optax.adam(1e-2), is_f32),
}


def _reason(inner, params, n=8):
  return dc.dtype_reason(inner, lay.plan(params, n), jnp.float32)


@pytest.mark.parametrize("name", sorted(BY_DTYPE))
def test_choices_by_dtype_are_refused(name):
  make = BY_DTYPE[name]
  with pytest.raises(ValueError, match=re.escape(DECIDES)) as e:
    z1.init(z1.zero1(make(), axis_name="data"), P, mesh(8))
  assert "Decide by path or name" in str(e.value)
  assert "keep those params in float32" in str(e.value)
  # Plain jit (tx.init under a mesh: TrainState.create, nnx.Optimizer).
  with jax.set_mesh(mesh(4)), pytest.raises(ValueError, match=re.escape(DECIDES)):
    z1.zero1(make(), axis_name="data").init(P)
  # The same optimizer on float32 params decides as optax: nothing to refuse.
  assert _reason(make(), jax.tree.map(lambda x: x.astype(jnp.float32), P)) is None


def test_the_refusal_names_what_each_side_runs():
  why = _reason(BY_DTYPE["multi_transform freezing by dtype"](), P)
  assert why.startswith("its update runs other operations on params in their "
                        "own dtypes than on their fp32 masters ("), why
  # optax zeroes the bf16 leaf's update; on its master zero1 would step it.
  assert "`mul(-0.1, grads['wbf']) -> float32[16,8]`" in why, why
  why = _reason(BY_DTYPE["masked adam by dtype (another state)"](), P)
  assert why.startswith("its state has another structure"), why


def test_the_same_choice_by_path_trains_as_optax():
  """Labels by path see the same on the master: accepted, and 3 steps give
  optax's float32 kernel bitwise and leave the frozen bf16 one at 1."""
  make = lambda: optax.multi_transform(
      {"train": optax.sgd(0.1), "frozen": optax.set_to_zero()}, by_path)
  loss = lambda p: (jnp.sum(p["w32"] ** 2)
                    + jnp.sum(p["wbf"].astype(jnp.float32) ** 2))
  got, want = optax_and_zero1_steps(make, loss, P)
  assert_equal(got, want)
  assert float(got["w32"][0, 0]) == pytest.approx(0.8 ** 3, rel=1e-6)
  assert float(got["wbf"][0, 0]) == 1.0


def _stateless(fn):
  return optax.GradientTransformation(
      lambda p: optax.EmptyState(), lambda g, s, p=None: (fn(g), s))


def test_precision_is_not_a_decision_a_constant_by_dtype_is():
  """A literal rounded to bf16, the dtype's own epsilon and a conversion to
  float32 and back are the same program; a constant chosen by dtype with the
  same operations is not."""
  rounded = _stateless(lambda g: jax.tree.map(lambda x: x * 0.1, g))
  eps = _stateless(lambda g: jax.tree.map(
      lambda x: x + jnp.finfo(x.dtype).eps, g))
  cast = _stateless(lambda g: jax.tree.map(
      lambda x: (x.astype(jnp.float32) * 2).astype(x.dtype), g))
  for tx in (rounded, eps, cast):
    assert _reason(tx, P) is None
  chosen = _stateless(lambda g: jax.tree.map(
      lambda x: x * (0.5 if x.dtype == jnp.bfloat16 else 0.1), g))
  why = _reason(chosen, P)
  assert why and "`mul(grads['wbf'], 0.5) -> bfloat16[16,8]` against " \
      "`mul(grads['wbf'], 0.1) -> float32[16,8]`" in why, why


def test_no_optimizer_in_optax_decides_by_dtype():
  """Every optimizer of the elementwise sweep (optax and optax.contrib, with
  the sweep's arguments) on bf16 and fp16 params beside fp32 ones: none is
  refused for its dtype (those optax cannot trace on them pass: there is
  nothing to differ from). add_noise draws its noise at the param's width."""
  for half in (jnp.bfloat16, jnp.float16):
    params = {"k": jnp.ones((5, 7), half), "v": jnp.ones((13,), half),
              "s": jnp.ones((), half), "f": jnp.ones((4, 3), jnp.float32)}
    for name, make in sorted(sweep.CASES.items()):
      assert _reason(make(), params, 4) is None, (name, half)

@pytest.mark.parametrize("half", [jnp.bfloat16, jnp.float16])
def test_an_explicit_state_dtype_is_not_a_decision(half):
  """Moments kept in an explicit dtype (optax's test_explicit_dtype: adam's
  mu_dtype, sgd's accumulator_dtype) are that dtype on the params and on
  their masters alike: accepted."""
  params = {"k": jnp.ones((5, 7), half), "f": jnp.ones((4, 3), jnp.float32)}
  for tx in (optax.adam(1e-3, mu_dtype=half), optax.adam(1e-3, mu_dtype=jnp.float32),
             optax.sgd(1e-3, momentum=0.9, accumulator_dtype=half),
             optax.contrib.schedule_free_sgd(1e-3, state_dtype=half)):
    assert _reason(tx, params, 4) is None
