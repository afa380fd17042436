"""A refusal names the transformation refused and its place in the
optimizer (core/blame.py; issue #38 item 5). It named an operation only:
adafactor "reduce_sum on parameter-shaped data", lbfgs "state leaf
[0].diff_params_memory[...] is not shaped like any parameter shard".
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import zero1_jax as z1
from zero1_jax.core import blame
from helpers import mesh

N = 4
P = {"w": jnp.ones((6, 5)), "b": jnp.ones((5,))}
by_ndim = lambda ps: jax.tree.map(lambda x: "m" if x.ndim > 1 else "v", ps)


def _own_reduction():
  """A transformation of one's own that reduces a whole leaf."""
  return optax.stateless(lambda g, p: jax.tree.map(lambda x: x / jnp.sum(x), g))


def _clipped_adamw(learning_rate):
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate))


CASES = {
    "adafactor": (lambda: optax.adafactor(1e-3),
                  "optax.clip_by_block_rms (element 1 of optax.chain): "
                  "reduce_sum on parameter-shaped data"),
    "lbfgs": (lambda: optax.lbfgs(),
              "optax.scale_by_lbfgs (element 0 of optax.chain): state leaf "
              "[0].diff_params_memory"),
    "lamb in MultiSteps": (
        lambda: optax.MultiSteps(optax.lamb(1e-3), 2).gradient_transformation(),
        "optax.scale_by_trust_ratio (element 2 of optax.chain, in "
        "optax.MultiSteps): reduce_sum"),
    "multi_transform group": (
        lambda: optax.multi_transform({"m": optax.lamb(1e-3),
                                       "v": optax.adam(1e-3)}, by_ndim),
        "optax.scale_by_trust_ratio (element 2 of optax.chain, group 'm' of "
        "optax.partition): reduce_sum"),
    "named_chain": (
        lambda: optax.named_chain(("adam", optax.scale_by_adam()),
                                  ("norm", optax.normalize_by_update_norm())),
        "optax.normalize_by_update_norm ('norm' of optax.named_chain)"),
    "alone": (lambda: optax.scale_by_factored_rms(min_dim_size_to_factor=4),
              "optax.scale_by_factored_rms: state leaf .v_row['w']"),
    "inject_hyperparams": (
        lambda: optax.inject_hyperparams(optax.lamb)(learning_rate=1e-3),
        "optax.scale_by_trust_ratio (element 2 of optax.chain, in "
        "optax.inject_hyperparams(optax.lamb)): reduce_sum"),
    # levanter's optimizers: a factory of its own, a schedule as a
    # hyperparameter, the clip inside.
    "inject_hyperparams of one's own": (
        lambda: optax.inject_hyperparams(_clipped_adamw)(
            learning_rate=optax.linear_schedule(1e-3, 0.0, 10)),
        "optax.clip_by_global_norm (element 0 of optax.chain, in "
        "optax.inject_hyperparams(test_blame._clipped_adamw)): reduce_sum"),
    # Its 'muon' group cannot run alone on the 1-D params (Newton-Schulz
    # wants matrices), the 'adam' group passes: the group is named.
    "muon": (lambda: optax.contrib.muon(1e-3),
             "optax.chain (group 'muon' of optax.partition): reshape"),
    "one's own": (lambda: optax.chain(optax.scale_by_adam(), _own_reduction()),
                  "optax.stateless(test_blame._own_reduction.<locals>.<lambda>) "
                  "(element 1 of optax.chain): reduce_sum"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_refusal_names_the_transformation_and_its_place(case):
  make, named = CASES[case]
  for refuse in (lambda: z1.init(z1.zero1(make(), axis_name="data"), P, mesh(N)),
                 lambda: z1.zero1(make(), axis_name="data").init(P)):
    with jax.set_mesh(mesh(N)), pytest.raises(ValueError) as e:
      refuse()
    first = str(e.value).splitlines()[0]
    lead = re.match(r"zero1: the inner optimizer (is not elementwise|cannot "
                    r"run under zero1) \((.*?)\)?; ", first)
    assert lead and named in lead.group(2), first


def test_a_part_refused_for_another_reason_is_not_blamed():
  """Group 's' (clip_by_block_rms) sees only the scalar, where it is
  elementwise; checked alone on every leaf it reduces. The optimizer is
  refused for group 'm''s factored state: 'm' is named, not 's'."""
  params = {"w": jnp.ones((6, 5)), "b": jnp.ones((5,)), "g": jnp.ones(())}
  inner = optax.multi_transform(
      {"s": optax.clip_by_block_rms(1.0),
       "m": optax.scale_by_factored_rms(min_dim_size_to_factor=4)},
      lambda ps: jax.tree.map(lambda x: "s" if x.ndim == 0 else "m", ps))
  with jax.set_mesh(mesh(N)), pytest.raises(ValueError) as e:
    z1.zero1(inner, axis_name="data").init(params)
  assert ("(optax.scale_by_factored_rms (group 'm' of optax.partition): "
          "state leaf") in str(e.value), str(e.value)


def test_names():
  assert blame.name(optax.MultiSteps(optax.adam(1.0), 2)
                    .gradient_transformation()) == "optax.MultiSteps"
  assert blame.name(optax.contrib.schedule_free_adamw(1.0)) == \
      "optax.contrib.schedule_free"
  assert blame.name(optax.inject_hyperparams(optax.adamw)(learning_rate=1.0)) \
      == "optax.inject_hyperparams(optax.adamw)"
  assert blame.name(optax.with_extra_args_support(optax.scale(1.0))) \
      == "optax.scale"


def test_a_deprecated_alias_is_neither_named_nor_read_aloud():
  """optax still exports ``optax.differentially_private_aggregate``, reading
  it warns that it is deprecated: the refusal names the contrib one, and
  the user's screen gets no DeprecationWarning from zero1's lookup."""
  import warnings
  tx = optax.contrib.differentially_private_aggregate(1.0, 0.1, 0)
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    assert blame.name(tx) == "optax.contrib.differentially_private_aggregate"


@pytest.mark.parametrize("make", [
    lambda: optax.scale_by_zoom_linesearch(max_linesearch_steps=15),
    lambda: optax.chain(optax.sgd(1.0), optax.scale_by_backtracking_linesearch(
        max_backtracking_steps=15))])
def test_a_line_search_is_refused_as_one(make):
  """A line search's update needs value_fn, which evaluates the whole
  params: the refusal says so, rather than asking for arguments that would
  not make it run."""
  with jax.set_mesh(mesh(8)), pytest.raises(ValueError) as e:
    z1.zero1(make(), axis_name="data").init({"w": jnp.ones((16, 3))})
  msg = str(e.value)
  assert "It is a line search" in msg and "plain data parallel" in msg, msg
  assert "checks the optimizer with scalars" not in msg, msg
