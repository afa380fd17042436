"""Every optimizer in ``optax`` and ``optax.contrib`` under ``z1.zero1`` at
N=4: it either trains the same weights as unsharded optax, or ``z1.init``
refuses it with the documented message. Never a third outcome (silently
different weights, or a crash). The README's lists are checked against the
outcomes here, so they cannot rot. The sweep (the cases, the references and
the tolerance, derived there) is tests/elementwise_sweep.py.
"""

import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import zero1_jax as z1
from zero1_jax.core import elementwise as ew
from elementwise_sweep import (ADAM, CANNOT_RUN, CASES, FACTORIES, FAST_CASES,
                               NEST_INSIDE, LR, N, STEPS, Outcomes, ndim_mask, reference,
                               worst_ratio, zero1_init, zero1_train)
from helpers import (assert_close, batch, float_part, loss_fn, mesh, odd_params,
                     optax_run)
from tolerances import FP32_REORDER

README = pathlib.Path(__file__).resolve().parents[1] / "docs" / "elementwise.md"   # the checked list


def readme_lists() -> tuple[set, set]:
  text = README.read_text()
  block = re.search(r"<!-- optimizers: begin.*?-->(.*?)<!-- optimizers: end -->",
                    text, re.S).group(1)
  sup = re.search(r"Supported[^:]*:(.*?)(?:\n\n|\Z)", block, re.S).group(1)
  ref = re.search(r"Refused[^:]*:(.*?)(?:\n\n|\Z)", block, re.S).group(1)
  names = lambda s: set(re.findall(r"`([^`]+)`", s))
  return names(sup), names(ref)


@pytest.fixture(scope="module")
def batches():
  return [batch(16, seed=s) for s in range(STEPS)]


@pytest.fixture(scope="module")
def outcomes(batches):
  return Outcomes(batches)


@pytest.mark.parametrize("name", [
    pytest.param(k, marks=() if k in FAST_CASES else pytest.mark.slow)
    for k in sorted(CASES)])
def test_matches_unsharded_optax_or_is_refused(name, outcomes):
  kind, detail = outcomes[name]
  if kind == "refused":
    # "not elementwise" only when that is the reason; an API that does not
    # fit zero1's call (extra update arguments, a state that changes
    # structure) says so instead (it said "not elementwise ... would
    # silently change its result" for those too)
    api = detail.startswith("zero1: the inner optimizer cannot run under zero1 (")
    nest = detail.startswith(f"zero1: {name} cannot run inside zero1 (")
    assert api or nest or detail.startswith(
        "zero1: the inner optimizer is not elementwise ("), detail
    assert api == (name in CANNOT_RUN), (name, detail)
    # a wrapper that takes zero1 inside it says how, not "use it unsharded"
    assert nest == (name in NEST_INSIDE), (name, detail)
    assert ("Put zero1 inside it instead" if nest else "Use it unsharded"
            ) in detail, detail
  else:
    assert detail <= 1.0, f"{name}: error {detail:.3g} x the allowed tolerance"
  if name in FACTORIES:
    supported, refused = readme_lists()
    listed = "matched" if name in supported else "refused" if name in refused else None
    assert listed == kind, f"README lists {name} as {listed}, the test finds {kind}"


def test_refusals_for_the_api_say_what_zero1_calls(outcomes):
  """An optimizer that needs a loss value, or whose state grows, is told
  what zero1 calls and why that does not fit, not "not elementwise"."""
  kind, detail = outcomes["optax.contrib.reduce_on_plateau"]
  assert kind == "refused" and "'value'" in detail, detail
  assert "needs more (a loss value=" in detail, detail
  # needs value= too, checked with a scalar for it: its arithmetic refused
  kind, detail = outcomes["optax.polyak_sgd"]
  assert kind == "refused" and detail.startswith(
      "zero1: the inner optimizer is not elementwise (optax.scale_by_polyak "), detail
  kind, detail = outcomes["optax.monitor"]
  assert "(optax.monitor (element 0 of optax.chain): its updates or new " \
         "state have another structure than its inputs). zero1 calls " \
         "init(params) and update(grads, state, params)" in detail, detail


def test_readme_lists_exactly_the_enumerated_optimizers():
  supported, refused = readme_lists()
  assert not supported & refused, supported & refused
  assert supported | refused == set(FACTORIES), (
      f"missing from README: {sorted(set(FACTORIES) - supported - refused)}; "
      f"not an optax optimizer: {sorted((supported | refused) - set(FACTORIES))}")


@pytest.mark.parametrize("name,why", [
    ("chain(centralize, adam)", "reduce_sum on parameter-shaped data"),
    ("optax.contrib.dadapt_adamw", "dot_general on parameter-shaped data"),
    ("optax.noisy_sgd", "random numbers drawn with a shape of the shard"),
    ("optax.lamb", "reduces across elements"),
])
def test_the_issue_cases_are_refused_for_the_right_reason(name, why):
  with pytest.raises(ValueError, match=re.escape(why)) as e:
    z1.init(z1.zero1(CASES[name](), axis_name="data"), odd_params(), mesh(N))
  # The escape hatch for an optimizer the user knows to be elementwise.
  assert "zero1(..., check_elementwise=False) skips this check" in str(e.value)


def test_probe_alone_catches_whole_tree_scalar_state():
  """The second line on its own: dadapt_adamw's scalar state differs."""
  layout = z1.plan(float_part(odd_params()), N)
  why = ew.probe_reason(optax.contrib.dadapt_adamw(), layout)
  assert "its state on N=4 shards differs" in why, why
  assert "at state.numerator_weighted (" in why, why   # the leaf, by path
  assert ew.probe_reason(optax.adam(LR), layout) is None
  # A PRNG key in the state is compared, not a crash.
  assert ew.probe_reason(optax.add_noise(0.01, 0.55, key=0), layout)


def test_size_dependent_scale_is_caught_by_the_trace_and_the_probe():
  """Elementwise in its jaxpr, yet scaled by the leaf size: the trace on the
  real shapes (size_check: the constant 1/sqrt(7) whole, 1/sqrt(2) on the
  shard) refuses it first; the probe, which runs on real shard dims, sees it
  on its own too."""
  by_size = optax.stateless(
      lambda g, p: jax.tree.map(lambda x: x / np.sqrt(x.size), g))
  layout = z1.plan(float_part(odd_params()), N)
  assert ew.jaxpr_reason(by_size, layout) is None
  why = ew.probe_reason(by_size, layout)
  assert "its update on N=4 shards differs" in why, why
  # Named by its path in the parameter tree (was "(leaf 0)").
  assert "whole parameters at ['dense']['bias'] (step 1, by " in why, why
  with pytest.raises(ValueError) as e:
    z1.init(z1.zero1(by_size, axis_name="data"), odd_params(), mesh(N))
  msg = str(e.value)
  assert ("its update runs other operations on the whole parameters than on "
          "a shard (`div(grads['dense']['bias'], 2.64575) -> float32[7]` "
          "against `div(grads['dense']['bias'], 1.41421) -> float32[2]`)"
          in msg), msg
  assert "check_elementwise=False" in msg, msg


def test_schedule_free_warmup_is_accepted_and_matches_optax(batches):
  """schedule_free_adamw(warmup_steps=2): at step 0 the learning rate is 0,
  so its update (y_new - params) is pure rounding of the params, ~1e-7. The
  whole and the sharded probe programs round the scalar ``gain``'s update
  1 ulp of ``gain`` apart; measured against the update's own ~1e-7 that was
  a refusal (the extra leaf ``a``, unused by the loss, moves the probe's
  random draws onto such a case at N=4). The probe's floor is now in ulps of
  the parameters an update is added to."""
  make_tx = lambda: optax.contrib.schedule_free_adamw(LR, warmup_steps=2)
  params = {**odd_params(), "a": jnp.zeros(5)}
  state, tx = zero1_init(make_tx(), params)          # was: Refused
  p = zero1_train(state, tx, loss_fn, batches)
  ref = reference({"x": make_tx()}, params, batches)["x"]
  assert worst_ratio(float_part(p), *ref) <= 1.0


def test_multisteps_inside_zero1_matches(outcomes):
  """The README's accumulation advice (z1.zero1(optax.MultiSteps(opt, k)))
  trains optax's weights; a MultiSteps around z1.zero1 is refused with that
  fix by z1.init (tests/test_step_errors.py)."""
  kind, detail = outcomes["MultiSteps(adam, 2)"]
  assert kind == "matched" and detail <= 1.0, (kind, detail)


# Decisions by size or shape. Each shard's computation is elementwise, so the
# jaxpr (read on the shards) and the probe (small stand-in leaves) accept
# them; under zero1 they would silently run another optimizer: measured
# before the check, factored_rms at N=8 was 76% off optax after one update,
# and the size mask left a 512-element kernel undecayed (2.6% after 5 steps).
BIG = {"w": jnp.ones((256, 256)), "k": jnp.ones((64, 8)), "b": jnp.ones(3)}
size_mask = lambda p: jax.tree.map(lambda x: x.size >= 256, p)


@pytest.mark.parametrize("make_tx,why", [
    (lambda: optax.scale_by_factored_rms(),
     "state leaf .v_row['w'] has shape (256,) for the whole parameter ['w'] "
     "(256, 256) but (1,) for its 1/N shard"),
    (lambda: optax.adamw(LR, weight_decay=0.1, mask=size_mask),
     "its update runs other operations on the whole parameters than on a shard"),
    (lambda: optax.multi_transform(
        {"big": ADAM(), "small": optax.sgd(LR)},
        lambda p: jax.tree.map(lambda x: "big" if x.size >= 256 else "small", p)),
     "its state has another structure for the whole parameters than for a shard"),
], ids=["factored_rms", "mask_by_size", "labels_by_size"])
def test_decisions_by_leaf_size_are_refused(make_tx, why):
  # w: factored whole, not as a (32, 256) or (64, 256) shard; k: 512
  # elements whole, 64 or 128 per shard. (At N=2 factored_rms's (128, 256)
  # shard is factored too; its state is then refused as not shard-shaped.)
  for n in (8, 4):
    with pytest.raises(ValueError) as e:
      z1.init(z1.zero1(make_tx(), axis_name="data"), BIG, mesh(n))
    assert why in str(e.value), str(e.value)
    assert "decide by ndim or by path" in str(e.value), str(e.value)
  # The plain-jit path (tx.init under a mesh, as TrainState.create) as well.
  with jax.set_mesh(mesh(8)), pytest.raises(ValueError, match=re.escape(why)):
    z1.zero1(make_tx(), axis_name="data").init(BIG)
  # The same decisions by ndim are elementwise: accepted.
  z1.init(z1.zero1(optax.adamw(LR, weight_decay=0.1, mask=ndim_mask),
                   axis_name="data"), BIG, mesh(8))


def test_multisteps_with_max_grad_norm_clips_each_micro_batch_and_says_so(batches):
  """zero1 clips the gradient it is handed; a MultiSteps inside then
  accumulates clipped micro-batch gradients: optax's chain(clip,
  MultiSteps(adam)), not MultiSteps(chain(clip, adam)) nor DeepSpeed's clip
  of the accumulated gradient. It trains as the former, and warns naming the
  difference and grad_accum_steps. Tolerance as tests/test_equivalence.py."""
  c, multi = 0.05, lambda: optax.MultiSteps(ADAM(), 2)
  with pytest.warns(UserWarning, match=r"clips each micro-batch's gradient "
                    r"before MultiSteps.*z1.train_step\(\.\.\., grad_accum_steps=k\)"):
    tx = z1.zero1(multi(), axis_name="data", max_grad_norm=c)
  p = zero1_train(z1.init(tx, odd_params(), mesh(N)), tx, loss_fn, batches)
  clip_each = optax_run(optax.chain(optax.clip_by_global_norm(c),
                                    multi().gradient_transformation()),
                        odd_params(), batches)
  assert_close(float_part(p), clip_each, FP32_REORDER, "vs chain(clip, MultiSteps) ")
  clip_sum = optax_run(optax.MultiSteps(optax.chain(
      optax.clip_by_global_norm(c), ADAM()), 2).gradient_transformation(),
                       odd_params(), batches)
  with pytest.raises(AssertionError):   # the two orders differ here
    assert_close(float_part(p), clip_sum, 1e-3, "")
  with warnings.catch_warnings():
    warnings.simplefilter("error")      # neither alone warns
    z1.zero1(multi(), axis_name="data")
    z1.zero1(ADAM(), axis_name="data", max_grad_norm=c)


def test_the_probe_runs_on_one_device_inside_the_users_mesh():
  """Inside ``jax.set_mesh`` (where users call ``tx.init``) the probe's
  small program runs on one device, not partitioned over the mesh: for
  bert-large's 369 leaves that halved the first ``tx.init``'s check, 20.2 s
  to 10.0 s (docs/results.md, start-up)."""
  from zero1_jax.core import probe
  layout = z1.plan(float_part(odd_params()), N)
  small = probe.probe_layout(layout, N)
  full_p, full_g = probe._probe_values(small, jnp.float32, 0)
  inner = optax.adam(LR)
  update = lambda g, s, p, values: inner.update(g, s, p)
  with jax.set_mesh(mesh(N)):
    whole, parts = probe._run_both(inner, update, None, small, full_p, full_g)
  assert {len(x.sharding.device_set) for x in whole + parts} == {1}


def test_the_check_runs_under_a_programs_transfer_guard():
  """A program that forbids implicit transfers (big_vision sets
  ``jax_transfer_guard="disallow"``) still gets the check's verdict: its
  numbers are zero1's own. Before, every optimizer, ``optax.sgd``
  included, was refused as failing "on the probe"."""
  layout = z1.plan(float_part(odd_params()), N)
  with jax.transfer_guard("disallow"):
    assert ew.probe_reason(optax.sgd(LR), layout) is None
    why = ew.probe_reason(optax.contrib.dadapt_adamw(), layout)
  assert "its state on N=4 shards differs" in why, why   # refused for its own reason


def test_selective_transform_with_a_mask_of_the_params_trains_as_optax():
  """The sweep lists ``optax.selective_transform`` as refused because its
  mask there leaves out the tree's integer and zero-size leaves (zero1
  hands the inner init None there). A mask mirroring the params, as optax
  asks, trains as optax: the frozen leaves kept, the others optax's."""
  params = float_part(odd_params())
  mask = jax.tree.map(lambda x: x.ndim == 1, params)
  make = lambda: optax.selective_transform(optax.adam(LR), freeze_mask=mask)
  batches = [batch(16, seed=s) for s in range(STEPS)]
  want = optax_run(make(), params, batches)
  tx = z1.zero1(make(), axis_name="data")
  step = jax.jit(lambda p, s, b: (lambda u_s: (optax.apply_updates(p, u_s[0]), u_s[1]))(
      tx.update(jax.grad(loss_fn)(p, b), s, p)))
  with jax.set_mesh(mesh(N)):
    p, s = params, tx.init(params)
    for b in batches:
      p, s = step(p, s, jax.device_put(b, jax.sharding.NamedSharding(
          mesh(N), jax.sharding.PartitionSpec("data"))))
  assert_close(p, want, FP32_REORDER, "selective ")
  np.testing.assert_array_equal(p["dense"]["bias"], params["dense"]["bias"])
