"""One version everywhere: pyproject takes it from zero1_jax.__version__,
the installed metadata reports it, and the CHANGELOG has its section.
(`make dist` builds and checks the wheel itself: .ci/check_dist.py.)"""

import importlib.metadata
import pathlib
import re
import tomllib

import zero1_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_version_is_one_and_the_same():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert "version" not in project["project"]          # not a second copy
  assert project["project"]["dynamic"] == ["version"]
  assert project["tool"]["setuptools"]["dynamic"]["version"] == {
      "attr": "zero1_jax.__version__"}
  assert re.fullmatch(r"\d+\.\d+\.\d+", zero1_jax.__version__)
  assert importlib.metadata.version("zero1_jax") == zero1_jax.__version__
  changelog = (ROOT / "CHANGELOG.md").read_text()
  assert f"\n## {zero1_jax.__version__}\n" in changelog


def test_extras_pin_the_docs_and_release_tools():
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())[
      "project"]["optional-dependencies"]
  for name in ("docs", "release"):
    assert extras[name] and all("==" in r for r in extras[name]), extras[name]
