"""The package layout as a specification: imports point one way.

Every import in ``zero1_jax`` (function-level ones included) is read with
``ast``; the module graph must have no cycle, no module may import another's
private name, and each layer imports only the layers below it
(docs/architecture.md):

  cli -> deepspeed -> {checkpoint, flax, distributed, inspect} -> core
  models, data: leaves the CLI uses (nothing of zero1_jax below them)
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "zero1_jax"

# layer of each top-level part -> the parts it may import
ALLOWED = {
    "core": {"core"},
    "checkpoint": {"core", "checkpoint"},
    "flax": {"core"},
    "distributed": {"distributed"},
    "inspect": {"inspect"},
    "data": set(),
    "models": {"models"},
    "deepspeed": {"core", "checkpoint", "distributed", "inspect", "deepspeed"},
    "cli": {"cli", "deepspeed", "checkpoint", "distributed", "inspect", "data",
            "models", "core"},
}


def _module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(PKG.parent).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: pathlib.Path, mods) -> list[tuple[str, str | None]]:
  """(imported zero1_jax module, imported name or None) for every import."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out += [(a.name, None) for a in node.names if a.name.startswith("zero1_jax")]
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "zero1_jax"):
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        out.append((sub, None) if sub in mods else (node.module, a.name))
  return out


def _graph():
  mods = _modules()
  return mods, {m: {t for t, _ in _imports(p, mods) if t != "zero1_jax"}
                for m, p in mods.items()}


def _part(mod: str) -> str:
  return mod.split(".")[1] if "." in mod else ""


def test_no_import_cycles_even_deferred():
  _, graph = _graph()
  state: dict[str, int] = {}

  def visit(m, stack):
    state[m] = 1
    for t in sorted(graph.get(m, ())):
      if t not in graph:
        continue
      if state.get(t) == 1:
        pytest.fail("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
      if not state.get(t):
        visit(t, stack + [t])
    state[m] = 2

  for m in sorted(graph):
    if not state.get(m):
      visit(m, [m])


def test_no_module_imports_private_names():
  mods = _modules()
  bad = [f"{m} imports {src}.{name}" for m, p in mods.items()
         for src, name in _imports(p, mods)
         if name and name.startswith("_") and name != "__version__"]
  assert not bad, bad


def test_layers_import_only_downwards():
  mods, graph = _graph()
  bad = []
  for m, targets in graph.items():
    part = _part(m)
    if not part:  # zero1_jax/__init__.py: the public API re-exports all
      continue
    for t in targets:
      if t in mods and _part(t) not in ALLOWED[part]:
        bad.append(f"{m} -> {t}")
  assert not bad, bad


def test_every_part_has_a_layer():
  assert {_part(m) for m in _modules()} - {""} == set(ALLOWED)


def test_the_library_never_imports_experiments():
  """experiments/ runs from the repo and is not installed (pyproject)."""
  import tomllib
  cfg = tomllib.loads((PKG.parent / "pyproject.toml").read_text())
  assert cfg["tool"]["setuptools"]["packages"]["find"]["include"] == ["zero1_jax*"]
  bad = []
  for m, p in _modules().items():
    for node in ast.walk(ast.parse(p.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom)
               else [])
      bad += [f"{m} imports {n}" for n in names
              if n.split(".")[0] == "experiments"]
  assert not bad, bad


def test_installed_package_from_another_directory(tmp_path):
  """As a user sees it: outside the repo, `experiments` is not importable and
  the console script works (the venv `make test` installs into)."""
  import os
  import subprocess
  import sys
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  r = subprocess.run([sys.executable, "-c", "import experiments"],
                     cwd=tmp_path, env=env, capture_output=True, text=True)
  assert r.returncode != 0 and "No module named 'experiments'" in r.stderr
  script = pathlib.Path(sys.executable).with_name("zero1-train")
  if not script.exists():
    pytest.skip(f"no console script next to {sys.executable}")
  r = subprocess.run([str(script), "--help"], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and "--deepspeed" in r.stdout, r.stderr


def test_importing_the_package_or_the_cli_loads_no_jax():
  """zero1-train must load jax itself, with Ctrl-C held (a Ctrl-C inside
  jaxlib's initialisation crashed the interpreter): so neither the package
  nor the CLI module imports jax, and every public name still resolves."""
  import subprocess
  import sys
  code = ("import sys, zero1_jax, zero1_jax.cli.train, zero1_jax.cli.export\n"
          "assert not [m for m in sys.modules if m.split('.')[0] in "
          "('jax', 'jaxlib', 'flax', 'optax', 'orbax')], 'loaded'\n"
          "[getattr(zero1_jax, n) for n in zero1_jax.__all__]\n"
          "print(zero1_jax.zero1.__name__, zero1_jax.specs.__name__)")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                     text=True, timeout=120, cwd=PKG.parent)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == ["zero1", "zero1_jax.core.specs"]


def test_the_file_map_names_every_module():
  """docs/architecture.md's file map is where a newcomer looks a module up:
  each module's file name appears there (a new module is added to it)."""
  doc = (PKG.parent / "docs" / "architecture.md").read_text()
  doc = doc.split("```")[1]   # the map: the page's first code block
  missing = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                   if p.name != "__init__.py" and p.name not in doc)
  assert not missing, missing
