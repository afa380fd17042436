"""The elementwise check remembers its verdict by what it depends on
(core/verdicts.py): an equal optimizer on an equal layout is not checked
twice in a process, and anything that could change the verdict changes the
key."""

import jax
import jax.numpy as jnp
import optax
import pytest

from zero1_jax.core import elementwise as ew
from zero1_jax.core import layout as lay
from zero1_jax.core import verdicts

PARAMS = {"kernel": jnp.zeros((64, 32)), "bias": jnp.zeros((32,))}
THRESHOLD = 1   # read by by_global_threshold below


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
  """Each test's own disk cache: the run's shared one is written by the
  other xdist workers at any moment (a count of its files raced them), and
  forgetting it would make their checks run again."""
  monkeypatch.setenv(verdicts.CACHE_ENV, str(tmp_path / "verdicts"))
  verdicts.forget()
  yield
  verdicts.forget()


def decay_if_larger_than(n):
  return optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.size >= n, p))


def by_global_threshold():
  return optax.adamw(1e-3, mask=lambda p: jax.tree.map(
      lambda x: x.size >= THRESHOLD, p))


def checks(monkeypatch):
  """Counts the traced checks that actually run."""
  ran = []
  real = ew.jaxpr_reason
  monkeypatch.setattr(ew, "jaxpr_reason", lambda *a: ran.append(1) or real(*a))
  return ran


def test_an_equal_optimizer_is_checked_once(monkeypatch):
  ran = checks(monkeypatch)
  for _ in range(3):   # three separate constructions, as in three z1.init calls
    ew.check_elementwise(optax.adamw(1e-3, weight_decay=0.01), PARAMS, 4)
  assert len(ran) == 1
  ew.check_elementwise(optax.adamw(1e-3, weight_decay=0.01), PARAMS, 8)
  ew.check_elementwise(optax.adamw(1e-3, weight_decay=0.01),
                       {**PARAMS, "bias": jnp.zeros((33,))}, 4)
  assert len(ran) == 3   # another N, another shape: checked again


def test_a_refusal_is_remembered_with_its_reason(monkeypatch):
  """The first check runs the jaxpr of lamb and of the parts it is built
  from (core/blame.py names the refused one); the second runs none and
  says the same, the part included."""
  ran = checks(monkeypatch)
  msgs, counts = [], []
  for _ in range(2):
    with pytest.raises(ew.Refused) as e:
      ew.check_elementwise(optax.lamb(1e-3), PARAMS, 4)
    msgs.append(str(e.value))
    counts.append(len(ran))
  assert counts[0] >= 1 and counts[1] == counts[0] and msgs[0] == msgs[1]
  assert "optax.scale_by_trust_ratio (element 2 of optax.chain)" in msgs[1]


def test_a_value_closed_over_changes_the_key():
  """A size-deciding mask: threshold 1 decays every leaf (elementwise);
  1000 decays the 2048-element kernel but not its 512-element shards at N=4
  (refused). A key blind to closures would hand the second the first's
  acceptance."""
  ew.check_elementwise(decay_if_larger_than(1), PARAMS, 4)
  with pytest.raises(ew.Refused):
    ew.check_elementwise(decay_if_larger_than(1000), PARAMS, 4)
  layout = lay.plan(PARAMS, 4)
  assert verdicts.key(optax.adam(1e-3), layout) != verdicts.key(optax.adam(2e-3), layout)
  assert verdicts.key(optax.adam(1e-3), layout) != verdicts.key(optax.adamw(1e-3), layout)


def test_a_module_constant_the_code_reads_changes_the_key():
  global THRESHOLD
  ew.check_elementwise(by_global_threshold(), PARAMS, 4)
  THRESHOLD = 1000
  try:
    with pytest.raises(ew.Refused):
      ew.check_elementwise(by_global_threshold(), PARAMS, 4)
  finally:
    THRESHOLD = 1


def test_what_a_value_cannot_pin_down_is_checked_every_time(monkeypatch):
  """A callable object of the user's own class: its behaviour is not its
  value, so no key, and the check runs each time."""

  class Schedule:
    def __call__(self, count):
      return 1e-3

  assert verdicts.key(optax.adam(Schedule())) is None
  ran = checks(monkeypatch)
  for _ in range(2):
    ew.check_elementwise(optax.adam(Schedule()), PARAMS, 4)
  assert len(ran) == 2


def _memory_only_forget():
  verdicts._VERDICTS.clear()


def test_a_later_process_finds_the_verdict_on_disk(monkeypatch):
  """The disk cache: with this process's memory emptied (as in a new
  process), an equal check reads the verdict from its file; a refusal
  keeps its reason word for word."""
  ew.check_elementwise(optax.adamw(1e-3), PARAMS, 4)
  with pytest.raises(ew.Refused) as first:
    ew.check_elementwise(optax.lamb(1e-3), PARAMS, 4)
  assert len(list(verdicts.cache_dir().glob("*.json"))) == 2
  _memory_only_forget()
  ran = checks(monkeypatch)
  ew.check_elementwise(optax.adamw(1e-3), PARAMS, 4)
  with pytest.raises(ew.Refused) as again:
    ew.check_elementwise(optax.lamb(1e-3), PARAMS, 4)
  assert ran == [] and str(again.value) == str(first.value)


def test_another_check_source_or_version_misses(monkeypatch):
  """The file name hashes the check's own source and the versions: a
  changed check (another zero1, a planted bug) never reads an old verdict."""
  ew.check_elementwise(optax.adamw(1e-3), PARAMS, 4)
  _memory_only_forget()
  monkeypatch.setattr(verdicts, "_salt", lambda: "another check")
  ran = checks(monkeypatch)
  ew.check_elementwise(optax.adamw(1e-3), PARAMS, 4)
  assert len(ran) == 1


def test_unreadable_or_disabled_cache_is_a_miss(monkeypatch, tmp_path):
  monkeypatch.setenv(verdicts.CACHE_ENV, str(tmp_path))
  ew.check_elementwise(optax.adamw(1e-3), PARAMS, 4)
  (f,) = tmp_path.glob("*.json")
  f.write_text("{not json")
  _memory_only_forget()
  ran = checks(monkeypatch)
  ew.check_elementwise(optax.adamw(1e-3), PARAMS, 4)   # no error: checked
  assert len(ran) == 1
  monkeypatch.setenv(verdicts.CACHE_ENV, "0")
  assert verdicts.cache_dir() is None
  verdicts.forget()
  ew.check_elementwise(optax.sgd(1e-3), PARAMS, 4)
  assert len(ran) == 2 and len(list(tmp_path.glob("*.json"))) == 1


def test_two_processes_check_once(tmp_path):
  """Two real processes: the second's check is never run (it would raise)."""
  import subprocess
  import sys
  code = (
      "import sys, jax.numpy as jnp, optax\n"
      "from zero1_jax.core import elementwise as ew\n"
      "if sys.argv[1] == 'second':\n"
      "  ew.jaxpr_reason = lambda *a: (_ for _ in ()).throw(AssertionError("
      "'checked again'))\n"
      "ew.check_elementwise(optax.adamw(1e-3, weight_decay=0.1),\n"
      "  {'k': jnp.zeros((64, 32)), 'b': jnp.zeros(32)}, 4)\n"
      "print('ok')\n")
  env = {**__import__("os").environ, verdicts.CACHE_ENV: str(tmp_path)}
  for which in ("first", "second"):
    r = subprocess.run([sys.executable, "-c", code, which], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, (which, r.stderr[-2000:])


def test_the_salt_reads_every_module_the_check_imports():
  """A verdict on disk is only as fresh as the sources its salt hashes: a
  module the check imports (directly or not) but the salt leaves out could
  change the verdict and still hit the old file. Read the imports with ast
  from elementwise.py down and hold them to verdicts.SOURCES."""
  import ast
  import pathlib
  core = pathlib.Path(verdicts.__file__).parent

  def imported(name):
    out = set()
    for node in ast.walk(ast.parse((core / f"{name}.py").read_text())):
      if isinstance(node, ast.ImportFrom) and node.module == "zero1_jax.core":
        out |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
          "zero1_jax.core."):
        out.add(node.module.split(".")[2])
      elif isinstance(node, ast.Import):
        out |= {a.name.split(".")[2] for a in node.names
                if a.name.startswith("zero1_jax.core.")}
    return out

  seen, todo = set(), ["elementwise", "verdicts"]
  while todo:
    name = todo.pop()
    if name not in seen:
      seen.add(name)
      todo += sorted(imported(name))
  assert seen <= set(verdicts.SOURCES), sorted(seen - set(verdicts.SOURCES))
