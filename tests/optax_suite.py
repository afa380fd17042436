"""The adapter that runs optax's own shipped test files through zero1
(tests/test_optax_suite.py; issue #33, item 1).

Each test file is read from the installed optax wheel (``optax/<path>``),
never copied, and executed as a fresh module in one of two ways:

* ``zero1``: while the module body runs, its imports of optax's optimizer
  modules (``from optax._src import alias`` and the others in ``PROXIED``)
  receive a stand-in module. Every function taken from it unwraps any zero1
  transformation among its arguments (their ``.inner``) and wraps a
  GradientTransformation it returns as ``z1.zero1(result,
  axis_name="data")``, outermost. So ``chain(scale_by_adam(), scale(-1))`` is
  ``zero1(chain(scale_by_adam(), scale(-1)))``, ``masked(sgd(1), mask)`` is
  ``zero1(masked(sgd(1), mask))``, ``inject_hyperparams(adam)(lr)`` is
  ``zero1(inject_hyperparams(adam)(lr))`` and ``MultiSteps(opt, k)``'s
  ``init``, ``update`` and ``gradient_transformation()`` are zero1's around
  optax's MultiSteps. Objects built at import time (absl parameters) go
  through it too. ``jax.jit`` there is ``z1.bounded(jax.jit(...))`` (see
  _Jax). Everything else (``base``, ``update``, ``numerics``, ``optax.tree``,
  the tests' assertions) is optax's own, unchanged.
* ``optax``: the same file, unpatched (the baseline).

contrib/_common_test.py keeps its own factory patch (_patch_contrib_common:
it builds every optimizer through _get_opt_factory / _wrap_opt).

The outcome of a case (:func:`outcome`) is ``pass``, ``skip``,
``refused:<category>`` (zero1 refused the optimizer: its message's category),
``n/a:<why>`` (the test reads what zero1 changes by design: NOT_APPLICABLE),
or ``fail:assertion`` / ``error:<Type>``.
"""

from __future__ import annotations

import builtins
import functools
import importlib.util
import pathlib
import re
import types
import unittest

import jax
import optax

import zero1_jax as z1

OPTAX = pathlib.Path(optax.__file__).parent

# optax's modules whose functions build transformations: what the tests
# import from these is the zero1 stand-in.
PROXIED = frozenset({
    "optax._src.alias", "optax._src.transform", "optax._src.combine",
    "optax._src.linesearch", "optax.schedules._inject",
    "optax.transforms._accumulation", "optax.transforms._combining",
    "optax.transforms._constraining", "optax.transforms._masking",
    "optax.transforms._freezing", "optax.contrib._sam",
    "optax.contrib._schedule_free",
    # issue #38's files
    "optax.schedules", "optax.transforms", "optax._src.wrappers",
    "optax.transforms._clipping", "optax.transforms._conditionality",
    "optax.transforms._adding", "optax.transforms._layouts",
    "optax.transforms._monitoring", "optax._src.lookahead",
    "optax._src.factorized", "optax.contrib._mechanic", "optax.contrib._muon",
    "optax.contrib._reduce_on_plateau", "optax.contrib._complex_valued",
    "optax.contrib._galore", "optax.contrib._privacy",
    "optax.experimental._aggregating",
})


def wrap(opt):
  return z1.zero1(opt, axis_name="data")


def unwrapped(x):
  """The optax object under one of ours: a zero1 transformation's inner, a
  stand-in function's original, a MultiSteps stand-in's optax MultiSteps, a
  partial's (and a list's, tuple's, dict's) items unwrapped."""
  if isinstance(x, z1.Zero1Transformation):
    return x.inner
  if isinstance(x, functools.partial):
    return functools.partial(unwrapped(x.func),
                             *[unwrapped(a) for a in x.args],
                             **{k: unwrapped(v) for k, v in x.keywords.items()})
  if type(x) in (list, tuple):
    return type(x)(unwrapped(a) for a in x)
  if type(x) is dict:
    return {k: unwrapped(v) for k, v in x.items()}
  return getattr(x, "z1_original", x)


def wrapped_factory(f):
  """``f`` with its arguments unwrapped and a transformation it returns
  wrapped in zero1 (a function it returns, e.g. inject_hyperparams' factory,
  gets the same treatment); signature kept (inject_hyperparams reads it)."""
  @functools.wraps(f)
  def make(*a, **k):
    out = f(*unwrapped(list(a)), **unwrapped(dict(k)))
    if isinstance(out, optax.GradientTransformation) and not isinstance(
        out, z1.Zero1Transformation):
      return wrap(out)
    if isinstance(out, types.FunctionType):
      return wrapped_factory(out)
    return out
  make.z1_original = f
  return make


class _MultiSteps:
  """optax.MultiSteps(opt, k) with zero1 around it: ``init``, ``update`` and
  ``gradient_transformation()`` are zero1's; the rest is optax's object."""

  def __init__(self, *a, **k):
    self.z1_original = optax.MultiSteps(*unwrapped(list(a)),
                                        **unwrapped(dict(k)))
    self._tx = wrap(self.z1_original.gradient_transformation())
    self.init, self.update = self._tx.init, self._tx.update

  def gradient_transformation(self):
    return self._tx

  def __getattr__(self, name):
    return getattr(self.z1_original, name)


class _Standin(types.ModuleType):
  """A module whose functions are :func:`wrapped_factory` of the real one's."""

  def __init__(self, real):
    super().__init__(real.__name__)
    self._real = real

  def __getattr__(self, name):
    v = getattr(self._real, name)
    if name == "MultiSteps":
      return _MultiSteps
    if isinstance(v, types.ModuleType) and v.__name__ in PROXIED:
      return _standin(v)   # `from optax.schedules import _inject`
    if isinstance(v, types.FunctionType):
      v = wrapped_factory(v)
      setattr(self, name, v)
    return v


_STANDINS: dict = {}


def _standin(mod):
  if mod.__name__ not in _STANDINS:
    _STANDINS[mod.__name__] = _Standin(mod)
  return _STANDINS[mod.__name__]


class _Package:
  """What ``from pkg import a, b`` reads: ``pkg`` with the PROXIED names
  replaced by their stand-ins."""

  def __init__(self, real):
    self._real = real

  def __getattr__(self, name):
    v = getattr(self._real, name)
    if isinstance(v, types.ModuleType) and v.__name__ in PROXIED:
      return _standin(v)
    return v


class _Jax(types.ModuleType):
  """``jax`` whose ``jit`` is ``z1.bounded(jax.jit(...))``: the one-line fix
  a plain-jit loop on simulated CPU devices needs (docs/cpu_rendezvous.md;
  alias_test.py's 10,000-step loops never block, and deadlocked XLA's CPU
  client here before it). Scheduling only: the values are jax.jit's."""

  def __init__(self):
    super().__init__("jax")

  def __getattr__(self, name):
    return getattr(jax, name)

  @staticmethod
  def jit(fun=None, *a, **k):
    if fun is None:
      return lambda f: _Jax.jit(f, *a, **k)
    return z1.bounded(jax.jit(fun, *a, **k))


def _import(name, globals=None, locals=None, fromlist=(), level=0):
  mod = builtins.__import__(name, globals, locals, fromlist, level)
  if name == "jax" and not fromlist and not level:
    return _Jax()
  if fromlist:
    if mod.__name__ in PROXIED:   # `from optax._src.alias import adam`
      return _standin(mod)
    return _Package(mod)
  return mod


def _patch_contrib_common(mod):
  """contrib/_common_test.py builds every optimizer by _get_opt_factory
  (name)(**kwargs), then maybe _wrap_opt(opt, wrapper, kwargs), or
  inject_hyperparams(factory): zero1 goes around the result, and a wrapper
  or inject_hyperparams inside zero1, around its inner."""
  get, wrap_opt = mod._get_opt_factory, mod._wrap_opt
  mod._get_opt_factory = lambda name: wrapped_factory(get(name))
  mod._wrap_opt = lambda opt, name, kwargs: wrap(
      wrap_opt(unwrapped(opt), name, kwargs))
  mod._inject = types.SimpleNamespace(
      inject_hyperparams=wrapped_factory(mod._inject.inject_hyperparams))


# name -> (file under optax/, how its optimizers get zero1: "import" = the
# stand-in modules above, or a function patching the loaded module).
SUITES = {
    "contrib_common": ("contrib/_common_test.py", _patch_contrib_common),
    "alias": ("_src/alias_test.py", "import"),
    "transform": ("_src/transform_test.py", "import"),
    "combine": ("_src/combine_test.py", "import"),
    "combining": ("transforms/_combining_test.py", "import"),
    "accumulation": ("transforms/_accumulation_test.py", "import"),
    "masking": ("transforms/_masking_test.py", "import"),
    "freezing": ("transforms/_freezing_test.py", "import"),
    "schedule_free": ("contrib/_schedule_free_test.py", "import"),
    "sam": ("contrib/_sam_test.py", "import"),
    # issue #38: the rest of optax's files that build transformations
    "inject": ("schedules/_inject_test.py", "import"),
    "clipping": ("transforms/_clipping_test.py", "import"),
    "conditionality": ("transforms/_conditionality_test.py", "import"),
    "adding": ("transforms/_adding_test.py", "import"),
    "constraining": ("transforms/_constraining_test.py", "import"),
    "layouts": ("transforms/_layouts_test.py", "import"),
    "monitoring": ("transforms/_monitoring_test.py", "import"),
    "lookahead": ("_src/lookahead_test.py", "import"),
    "update": ("_src/update_test.py", "import"),
    "float64": ("_src/float64_test.py", "import"),
    "factorized": ("_src/factorized_test.py", "import"),
    "linesearch": ("_src/linesearch_test.py", "import"),
    "utils": ("_src/utils_test.py", "import"),
    "mechanic": ("contrib/_mechanic_test.py", "import"),
    "muon": ("contrib/_muon_test.py", "import"),
    "reduce_on_plateau": ("contrib/_reduce_on_plateau_test.py", "import"),
    "complex_valued": ("contrib/_complex_valued_test.py", "import"),
    "galore": ("contrib/_galore_test.py", "import"),
    "privacy": ("contrib/_privacy_test.py", "import"),
    "state_utils": ("tree_utils/_state_utils_test.py", "import"),
    "aggregating": ("experimental/_aggregating_test.py", "import"),
}


def load(name: str, zero1: bool):
  """The test module of suite ``name``, its optimizers zero1's or optax's."""
  rel, how = SUITES[name]
  side = "zero1" if zero1 else "optax"
  spec = importlib.util.spec_from_file_location(
      f"optax_suite_{name}_{side}", OPTAX / rel)
  mod = importlib.util.module_from_spec(spec)
  if zero1 and how == "import":
    mod.__dict__["__builtins__"] = dict(vars(builtins), __import__=_import)
  spec.loader.exec_module(mod)
  if zero1 and callable(how):
    how(mod)
  return mod


def cases() -> list[str]:
  """``suite::Class::method`` of every test case in the installed files."""
  out = []
  for name, (rel, _) in SUITES.items():
    if not (OPTAX / rel).exists():
      continue
    mod = load(name, zero1=False)
    for cls_name in sorted(vars(mod)):
      cls = getattr(mod, cls_name)
      if isinstance(cls, type) and issubclass(cls, unittest.TestCase) \
          and cls.__module__ == mod.__name__:
        for meth in unittest.defaultTestLoader.getTestCaseNames(cls):
          out.append(f"{name}::{cls_name}::{meth}")
  return out


def params_repr(cls, meth: str) -> str:
  """The case's parameters as absl names them, without object addresses."""
  text = getattr(cls, "_test_params_reprs", {}).get(meth, "")
  return re.sub(r" at 0x[0-9a-f]+", "", text)


# Tracebacks of tests that read what zero1 changes by design (a text, or
# texts that must all be in it) -> why.
NOT_APPLICABLE = {
    "'Zero1State' object has no attribute 'inner_state'": (
        "n/a:reads state.inner_state (inject_hyperparams', masked's "
        "state field; zero1's state holds the inner optimizer's as "
        "state.inner)"),
    ("in test_explicit_dtype",
     "AssertionError: dtype(bfloat16) != dtype('float32')"): (
        "n/a:expects bf16 moments for bf16 params; zero1 runs the inner "
        "optimizer on its fp32 master, so its state is fp32 (master_dtype="
        "jnp.bfloat16 keeps bf16)"),
    ("assert_trees_all_equal(state, new_state)",
     "ACTUAL: array(0, dtype=int32)\n DESIRED: array(1, dtype=int32)"): (
        "n/a:asserts that a step leaves the state as it was (zero1's state "
        "counts steps: Zero1State.loss_scale.step)"),
    "'Zero1State' object has no attribute": (
        "n/a:reads the inner optimizer's state from zero1's "
        "(there: z1.inner_state(tx, state, params))"),
    ("in test_hyperparam_default_dtype",
     "AssertionError: dtype('float32') != <class 'jax.numpy.bfloat16'>"): (
        "n/a:expects bf16 hyperparameters for bf16 params; zero1 runs the "
        "inner optimizer on its fp32 master, so inject_hyperparams makes "
        "them fp32 (master_dtype=jnp.bfloat16 keeps bf16)"),
    ("Trees have different structures", "namedtuple[Zero1State]"): (
        "n/a:compares the whole optimizer state with optax's; zero1's is "
        "Zero1State(master, inner, loss_scale) around the inner optimizer's "
        "(z1.inner_state gives that)"),
    ("AssertionError: ", "Zero1State(", " != "): (
        "n/a:compares the whole optimizer state with optax's; zero1's is "
        "Zero1State(master, inner, loss_scale) around the inner optimizer's "
        "(z1.inner_state gives that)"),
    "NamedTupleKey(tuple_name='Zero1State'": (
        "n/a:compares the paths of the state's leaves with optax's; zero1's "
        "state holds the inner optimizer's under Zero1State.inner"),
}
# A parameter-shaped state leaf read through zero1's state is padded at the
# end of its shard dim to a multiple of N (documented; z1.inner_state gives
# optax's shapes): an assertion that compares it with optax's shape.
PADDED = "n/a:reads a parameter-shaped state leaf as zero1 holds it, padded " \
         "to a multiple of N on its shard dim (z1.inner_state gives optax's shapes)"


def _padded(text: str, n: int = 8) -> bool:
  """``text`` reports two shapes (an assertion's "shapes (a), (b)
  mismatch", an op's "incompatible shapes for broadcasting: (a), (b)")
  that differ only in one dim, one of them the other's padded to a multiple
  of ``n``."""
  m = re.search(r"shapes(?: for broadcasting:)? \(([\d, ]*)\), "
                r"\(([\d, ]*)\)", text)
  if not m:
    return False
  a, b = ([int(x) for x in g.replace(" ", "").split(",") if x]
          for g in m.groups())
  diff = [sorted((x, y)) for x, y in zip(a, b) if x != y]
  return (len(a) == len(b) and len(diff) == 1
          and diff[0][1] == -(-diff[0][0] // n) * n)


def outcome(result: unittest.TestResult) -> str:
  bad = result.errors + result.failures
  if not bad:
    return "skip" if result.skipped else "pass"
  text = bad[0][1]
  last = [l for l in text.strip().splitlines() if l and not l.startswith(" ")]
  line = last[-1] if last else text
  for needle, why in NOT_APPLICABLE.items():
    if all(n in text for n in ((needle,) if isinstance(needle, str)
                               else needle)):
      return why
  if _padded(text):
    return PADDED
  if "is not elementwise" in text:
    return "refused:not-elementwise"
  if "cannot run under zero1" in text:
    return "refused:cannot-run"
  if "cannot run inside zero1" in text:   # refusal.NESTED: zero1 goes inside
    return "refused:nest-inside"
  m = re.search(r"zero1: ([^.(:]{0,60})", text)
  if m:
    return f"refused:{m.group(1).strip()}"
  if line.startswith("AssertionError") or result.failures:
    return "fail:assertion"
  return f"error:{line.split(':')[0].split('.')[-1]}"
