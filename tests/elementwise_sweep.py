"""The sweep behind tests/test_elementwise.py: every optimizer in ``optax``
and ``optax.contrib`` under ``z1.zero1`` at N=4, run, or refused by
``z1.init``, and compared with unsharded optax.

Tolerance. The reference is a jitted unsharded optax step on the global
batch. Its gradient sums the batch in one order; zero1 sums 4 per-device
gradients. How much an optimizer amplifies that is its own property (sign-
based ones flip on near-zero gradients, adaptive ones divide by small
moments), so it is measured: the same jitted reference run with the gradient
taken as the mean of the 4 per-device gradients (the other summation order)
with every element then moved one ulp up or down (so that no element's
sensitivity hides behind a sum that happens to round the same way) gives
``sens`` = max|ref_alt - ref| per leaf. Rounding *inside* the optimizer also
differs between two XLA programs (acprop: jitted and eager optax alone differ
by 5e-6 relative after 5 steps, far more than a 1-ulp gradient moves it), so
``sens`` also takes max|ref_eager - ref|, optax run op by op. We require per leaf
``max|z1 - ref| <= 4 * sens + 1e-6 * max(max|ref|, 1e-3)``: a few times the
optimizer's own sensitivity plus the fp32 floor of tests/test_equivalence.py.

Cost. Compiles dominate, so optimizers that the jaxpr check accepts (no
compile) share them in groups of GROUP: one ``z1.zero1(multi_transform({name:
optimizer}))`` over ``{name: odd_params()}`` (one z1.init with its probe, one
step) and one reference program; each name is judged on its own subtree by
the rule above, and reported under its own name. A group that fails as a whole
falls back to running each of its optimizers alone. The jaxpr check refuses
the others before any compile, and each is then refused by z1.init alone.
"""

import functools
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib

import zero1_jax as z1
from zero1_jax.core import elementwise as ew
from helpers import float_part, loss_fn, mesh, odd_params

N, STEPS, LR = 4, 5, 1e-2
GROUP = 8    # optimizers sharing one zero1 run (see group_outcomes)
ADAM = lambda: optax.adam(LR)
ndim_mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)

# Constructor arguments beyond ``learning_rate=LR`` (wrappers get adam).
ARGS = {
    "adaptive_grad_clip": dict(clipping=0.1),
    "add_noise": dict(eta=0.01, gamma=0.55, key=0),
    "apply_if_finite": lambda: optax.apply_if_finite(ADAM(), 3),
    # chain itself is what users write everywhere; chain(centralize, adam) is
    # an extra case below (refused for centralize's reduction).
    "chain": lambda: optax.chain(optax.scale_by_adam(), optax.scale(-LR)),
    "clip": dict(max_delta=1.0),
    "clip_by_block_rms": dict(threshold=1.0),
    "clip_by_global_norm": dict(max_norm=1.0),
    "conditionally_mask": lambda: optax.conditionally_mask(ADAM(), lambda c: c % 2 == 0),
    "conditionally_transform": lambda: optax.conditionally_transform(
        ADAM(), lambda c: c % 2 == 0),
    "ema": dict(decay=0.9),
    "flatten": lambda: optax.flatten(ADAM()),
    "freeze": lambda: optax.freeze(ndim_mask),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(LR, 0.0, STEPS), weight_decay=0.01),
    "inject_stateful_hyperparams": lambda: optax.inject_stateful_hyperparams(
        optax.adamw)(learning_rate=optax.linear_schedule(LR, 0.0, STEPS)),
    "lookahead": lambda: optax.lookahead(ADAM(), 2, 0.5),
    "masked": lambda: optax.masked(ADAM(), ndim_mask),
    "measure_with_ema": lambda: optax.measure_with_ema(lambda u: u, 0.9),
    # its state gains the measurements' entries at the first update
    "monitor": lambda: optax.monitor(
        {"ema": optax.measure_with_ema(lambda u: u, 0.9)}),
    "multi_transform": lambda: optax.multi_transform(
        {"a": ADAM(), "s": optax.sgd(LR)},
        lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "s", p)),
    "partition": lambda: optax.partition(
        {"a": ADAM(), "s": optax.sgd(LR)},
        lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "s", p)),
    "noisy_sgd": dict(learning_rate=LR, key=0),
    "scale": dict(step_size=-LR),
    "scale_by_backtracking_linesearch": dict(max_backtracking_steps=5),
    "scale_by_schedule": lambda: optax.scale_by_schedule(optax.linear_schedule(1.0, 0.1, 5)),
    "scale_by_zoom_linesearch": dict(max_linesearch_steps=5),
    "selective_transform": lambda: optax.selective_transform(
        ADAM(), freeze_mask=jax.tree.map(lambda x: x.ndim == 1, float_part(odd_params()))),
    "snapshot": lambda: optax.snapshot("m", lambda u: u),
    "stateless": lambda: optax.stateless(lambda g, p: jax.tree.map(lambda x: -LR * x, g)),
    "stateless_with_tree_map": lambda: optax.stateless_with_tree_map(lambda g, p: -LR * g),
    "trace": dict(decay=0.9),
    "with_extra_args_support": lambda: optax.with_extra_args_support(ADAM()),
    "differentially_private_aggregate": dict(l2_norm_clip=1.0, noise_multiplier=0.1, key=0),
    "dpsgd": dict(learning_rate=LR, l2_norm_clip=1.0, noise_multiplier=0.1, seed=0),
    "mechanize": lambda: optax.contrib.mechanize(ADAM()),
    "sam": lambda: optax.contrib.sam(ADAM(), optax.sgd(LR)),
    "schedule_free": lambda: optax.contrib.schedule_free(optax.sgd(LR), LR),
    "split_real_and_imaginary": lambda: optax.contrib.split_real_and_imaginary(ADAM()),
}
# Built above with a learning rate inside (no chain with scale(-LR)).
LR_INSIDE = {"inject_hyperparams", "inject_stateful_hyperparams", "chain",
             "apply_if_finite", "conditionally_mask", "conditionally_transform",
             "multi_transform", "partition", "mechanize", "sam", "lookahead",
             "selective_transform", "with_extra_args_support", "stateless",
             "stateless_with_tree_map", "split_real_and_imaginary",
             "scale", "flatten"}
# Combinations the issue and the README name.
EXTRA = {
    "chain(centralize, adam)": lambda: optax.chain(optax.centralize(), ADAM()),
    "chain(clip_by_global_norm, adam)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), ADAM()),
    "inject_hyperparams(adamw, schedule)": lambda: optax.inject_hyperparams(
        optax.adamw)(learning_rate=optax.warmup_cosine_decay_schedule(
            0.0, LR, 2, STEPS), weight_decay=0.01),
    "adamw(mask)": lambda: optax.adamw(LR, weight_decay=0.1, mask=ndim_mask),
    # A class, not a function: the enumeration above cannot find it.
    "MultiSteps(adam, 2)": lambda: optax.MultiSteps(ADAM(), every_k_schedule=2),
}


def _factories() -> dict:
  """Public callables of optax/optax.contrib returning a transformation."""
  out = {}
  for mod in (optax, optax.contrib):
    for name in sorted(dir(mod)):
      f = getattr(mod, name)
      # nadam / nadamw are functools.partial(adam / adamw, nesterov=True)
      wrapped = f.func if isinstance(f, functools.partial) else f
      if name.startswith("_") or not inspect.isfunction(wrapped):
        continue
      ret = str(inspect.signature(f).return_annotation)
      if "GradientTransformation" not in ret and name not in ARGS:
        needed = [p for p in inspect.signature(f).parameters.values()
                  if p.default is p.empty and p.kind != p.VAR_KEYWORD]
        if needed or ret != str(inspect.Signature.empty):
          continue
        try:   # unannotated, no required args: a transformation?
          with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not isinstance(f(), optax.GradientTransformation):
              continue
        except Exception:  # noqa: BLE001
          continue
      out[f"{mod.__name__}.{name}"] = (f, name)
  return out


def make(f, name):
  """``f`` built with ARGS (else learning_rate=LR); a transformation without
  a learning rate is followed by ``scale(-LR)`` so that it descends."""
  a = ARGS.get(name)
  params = inspect.signature(f).parameters
  if callable(a):
    tx = a()
  else:
    kw = dict(a) if a else {}
    if "learning_rate" in params and "learning_rate" not in kw:
      kw["learning_rate"] = LR
    tx = f(**kw)
  has_lr = "learning_rate" in params or name in LR_INSIDE
  return tx if has_lr else optax.chain(tx, optax.scale(-LR))


FACTORIES = _factories()
# Refused because their API does not fit zero1's init(params) /
# update(grads, state, params) on the shards, not for their arithmetic.
CANNOT_RUN = {
    "optax.monitor",              # state structure grows at the first update
    "optax.contrib.differentially_private_aggregate",  # per-example grads
    "optax.contrib.dpsgd", "optax.contrib.hutchinson_estimator_diag_hessian",
    "optax.contrib.sophia", "optax.contrib.scale_by_muon",
    # needs value= (z1.train_step passes none; in plain jit, tx.update(...,
    # value=loss) trains it: tests/test_extra_args.py). polyak_sgd and momo
    # need it too, but are checked with a scalar for it at init: refused as
    # not elementwise (whole-tree norms and dot products).
    "optax.contrib.reduce_on_plateau",
    "optax.scale_by_backtracking_linesearch",
    "optax.scale_by_zoom_linesearch",
    # their init fails on the tree zero1 hands (None at integer leaves)
    "optax.contrib.galore", "optax.contrib.scale_by_galore",
    "optax.selective_transform"}
# Wrappers zero1 goes inside of (core/refusal.py NEST_INSIDE); their refusal
# names that form (tests/test_nesting.py trains it).
NEST_INSIDE = {"optax.lookahead"}   # params must be LookaheadParams
CASES = {**{k: (lambda f=f, n=n: make(f, n)) for k, (f, n) in FACTORIES.items()},
         **EXTRA}


def up(tree):
  """Fixed random signs per leaf (seeded by its size), True: 1 ulp up."""
  return jax.tree.map(
      lambda x: np.random.default_rng(x.size).random(x.shape) < 0.5, tree)


def reference(txs: dict, params, batches) -> dict:
  """Per name in ``txs``: jitted unsharded optax, twice in one program: on
  the gradient of the global batch, and on the mean of the N per-device
  gradients (the same batch summed in another order, each element then moved
  by one ulp); and the same optax op by op (eager: its own arithmetic rounded
  as another program rounds it). Returns ``{name: [ref, alt, eager]}`` final
  params. All of ``txs`` share one jitted program; each keeps its own
  params, state and gradients (nothing is shared but the batch)."""
  p = float_part(params)
  s = {k: tx.init(p) for k, tx in txs.items()}

  def both(tx, ps, ss, b):
    chunks = jax.tree.map(lambda x: x.reshape((N, -1) + x.shape[1:]), b)
    g_full = jax.grad(loss_fn)(ps[0], b)
    g_dev = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(ps[1], chunks)
    g_split = jax.tree.map(lambda x: jnp.mean(x, 0), g_dev)
    # ... and every element 1 ulp off, up or down (fixed random signs), so
    # that no element's sensitivity hides behind an order that happens to
    # round the same way.
    g_split = jax.tree.map(
        lambda x, d: jnp.nextafter(x, jnp.where(d, jnp.inf, -jnp.inf)),
        g_split, up(g_split))
    out = [tx.update(g, st, q) for g, st, q in zip((g_full, g_split), ss, ps)]
    return ([optax.apply_updates(q, u) for q, (u, _) in zip(ps, out)],
            [st for _, st in out])

  one = jax.jit(lambda ps, ss, b: {k: both(tx, ps[k], ss[k], b)
                                   for k, tx in txs.items()})
  ps, ss = {k: [p, p] for k in txs}, {k: [s[k], s[k]] for k in txs}
  eager, es = dict.fromkeys(txs, p), dict(s)
  for b in batches:
    out = one(ps, ss, b)
    ps, ss = {k: v[0] for k, v in out.items()}, {k: v[1] for k, v in out.items()}
    for k, tx in txs.items():
      u, es[k] = tx.update(jax.grad(loss_fn)(eager[k], b), es[k], eager[k])
      eager[k] = optax.apply_updates(eager[k], u)
  return {k: ps[k] + [eager[k]] for k in txs}


def worst_ratio(got, ref, alt, eager) -> float:
  """max over leaves of max|got - ref| / the allowed error (see top)."""
  worst = 0.0
  for k, g in jax.tree_util.tree_flatten_with_path(got)[0]:
    want = np.asarray(_at(ref, k), np.float64)
    sens = max(np.max(np.abs(np.asarray(_at(o, k), np.float64) - want),
                      initial=0) for o in (alt, eager))
    err = np.max(np.abs(np.asarray(g, np.float64) - want), initial=0)
    allowed = 4 * sens + 1e-6 * max(np.max(np.abs(want), initial=0), 1e-3)
    worst = max(worst, err / allowed if np.isfinite(err) else np.inf)
  return worst


def zero1_init(inner, params):
  """z1.init at N (ValueError if it refuses ``inner``) and the step."""
  tx = z1.zero1(inner, axis_name="data")
  return z1.init(tx, params, mesh(N)), tx


def zero1_train(state, tx, loss, batches):
  p, s = state
  step = z1.train_step(loss, tx, mesh(N))
  for b in batches:
    p, s, _ = step(p, s, b)
  return p


def outcome(make_tx, batches):
  """One optimizer alone: ("refused", message) or ("matched", worst error /
  allowed error). Refused by z1.init, or at the first step where its update
  needs extra arguments (a loss value=) that z1.train_step does not pass
  (core/extra_args.py: checked with the arguments an update is given)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      state, tx = zero1_init(make_tx(), odd_params())
      p = zero1_train(state, tx, loss_fn, batches)
    except ew.Refused as e:
      return "refused", str(e)
    except ValueError as e:
      if "zero1:" not in str(e):
        raise
      return "refused", str(e)
    ref = reference({"x": make_tx()}, odd_params(), batches)["x"]
  return "matched", worst_ratio(float_part(p), *ref)


def by_label(params):
  """multi_transform labels: each top-level key's leaves go to its optimizer
  (None, where zero1 hands the inner optimizer none, stays None)."""
  return {k: jax.tree.map(lambda _: k, v) for k, v in params.items()}


def group_outcomes(names, batches) -> dict:
  """Outcomes of ``names``, all accepted by the jaxpr check alone, from one
  shared zero1 run: ``{name: odd_params()}`` trained with
  ``multi_transform({name: optimizer}, by_label)`` as the inner optimizer of
  ONE zero1 (so z1.init's probe and the step compile once) on the sum of the
  per-name losses (each name's gradient is its own loss's gradient), and one
  shared reference program. Each name is then judged on its own subtree
  exactly as alone. If the group as a whole is refused or fails, every name
  is run alone instead (its own outcome, its own failure message)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      inner = optax.multi_transform({k: CASES[k]() for k in names}, by_label)
      loss = lambda p, b: sum(loss_fn(p[k], b) for k in names)
      state, tx = zero1_init(inner, {k: odd_params() for k in names})
      p = zero1_train(state, tx, loss, batches)
      refs = reference({k: CASES[k]() for k in names}, odd_params(), batches)
    except Exception:  # noqa: BLE001 - judged one by one below
      return {k: outcome(CASES[k], batches) for k in names}
  return {k: ("matched", worst_ratio(float_part(p[k]), *refs[k])) for k in names}


class Outcomes:
  """Each case's outcome, computed on first request. A case the jaxpr check
  refuses (no compile) runs z1.init alone; the rest run in fixed groups of
  GROUP through :func:`group_outcomes`, similar optimizers together (sorted by
  the primitives of their update: XLA compiles a kernel they share once)."""

  def __init__(self, batches):
    self.batches, self.done = batches, {}
    layout = z1.plan(odd_params(), N)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      # FAST_CASES group among themselves: the fast suite, which runs only
      # them, compiles their groups and no others.
      ok = sorted((k for k in CASES if _jaxpr_accepts(CASES[k], layout)),
                  key=lambda k: (k not in FAST_CASES, _primitives(CASES[k]), k))
    self.group = {k: ok[i - i % GROUP:i - i % GROUP + GROUP]
                  for i, k in enumerate(ok)}

  def __getitem__(self, name):
    if name not in self.done:
      if name in self.group:
        self.done.update(group_outcomes(self.group[name], self.batches))
      else:
        self.done[name] = outcome(CASES[name], self.batches)
    return self.done[name]


def _jaxpr_accepts(make_tx, layout) -> bool:
  try:
    return ew.jaxpr_reason(make_tx(), layout) is None
  except Exception:  # noqa: BLE001 - run alone, where it fails by its name
    return False


def _primitives(make_tx) -> tuple:
  """The sorted primitive names of one update on the float params."""
  tx, p = make_tx(), float_part(odd_params())
  jaxpr = jax.make_jaxpr(tx.update)(p, jax.eval_shape(tx.init, p), p)
  return tuple(sorted({str(e.primitive) for e in jaxpr.eqns}))


def _at(tree, path):
  for k in path:
    tree = tree[k.key]
  return tree


# The fast suite's share of the sweep: the optimizers users reach for first,
# a refusal of each kind (whole-leaf statistic, size-deciding, loss value=,
# state that changes structure, per-example randomness) and the wrappers.
# `make test-slow` (CI) runs every enumerated optimizer.
FAST_CASES = {
    "optax.adam", "optax.adamw", "adamw(mask)", "optax.sgd", "optax.lion",
    "optax.nadam", "optax.rmsprop", "optax.adagrad", "MultiSteps(adam, 2)",
    "inject_hyperparams(adamw, schedule)", "chain(clip_by_global_norm, adam)",
    "optax.lamb", "optax.lars", "optax.scale_by_factored_rms",
    "optax.polyak_sgd", "optax.contrib.reduce_on_plateau", "optax.monitor",
    "optax.noisy_sgd", "optax.contrib.muon",
}
