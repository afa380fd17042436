"""zero1_jax's docstrings as the API page shows them (a griffe extension).

The docstrings are written for ``help()`` and for readers of the source:
Google-style sections, ````literal```` spans (Markdown reads double backticks
as code too), Sphinx cross-reference roles (``:func:`zero1_jax.zero1```) and
reST ``Example::`` blocks. Markdown has neither roles nor ``::`` blocks, so
mkdocstrings printed them as text. This extension rewrites, at build time
only, the docstrings of the objects the API page renders (the ``:::`` lines of
``api_page`` and their public, documented members):

- ``:role:`target``` becomes a cross-reference, ``[`target`][canonical.path]``,
  when the target is an object the page renders (so ``mkdocs build --strict``
  fails if it stops resolving), and inline code otherwise (a private helper,
  a module, jax's or optax's names). Targets resolve as Sphinx resolves them:
  the enclosing class, then the module, then the package, then the absolute
  path; an import (``zero1_jax.zero1``) is followed to where it is defined.
  A target that names nothing is a warning, an error under ``--strict``.
- ``Returns:`` whose first line is prose with a colon keeps it as prose
  (griffe would show the words before the colon as the returned type), and
  ````(params, state)````: loses backticks that would show inside that type.
- ``Example::`` followed by an indented block becomes a fenced ``python``
  block, and a doctest (``>>>``) after ``Example:`` or ``Example::`` griffe's
  Examples section, which renders it as highlighted console code.

mkdocs.yml loads it: ``extensions: [docs/_ext/docstrings.py: {api_page: ...}]``.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path
from typing import Any

try:
  import griffe
  _Extension = griffe.Extension
except ImportError:   # tests import the text functions without the docs tools
  griffe, _Extension = None, object

# mkdocs counts warnings of loggers under "mkdocs"; --strict fails on them
_log = logging.getLogger("mkdocs.plugins.zero1_jax_docstrings")

ROLE = re.compile(r":(?:py:)?(func|meth|class|mod|data|attr|obj|exc|const)"
                  r":`(?P<body>[^`]+)`")
EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Examples?(?P<colons>::?)[ \t]*$")
# names of other projects: shown as code, never looked up
EXTERNAL = ("jax", "jnp", "optax", "flax", "nnx", "nn", "orbax", "numpy",
            "np", "deepspeed", "torch", "equinox", "eqx", "logging", "os",
            "warnings", "threading", "signal", "json", "typing", "functools",
            "concurrent", "asyncio")


def role_to_markdown(body: str, resolve) -> str:
  """One role's text as Markdown. ``resolve(target) -> (path, rendered)``
  gives the canonical path (None: not found) and whether the page renders
  it; ``~a.b`` shows ``b``, ``title <a.b>`` shows ``title``, ``!a.b`` never
  links."""
  m = re.fullmatch(r"(?P<title>.*?)\s*<(?P<target>[^>]+)>", body.strip())
  title, target = ((m["title"], m["target"]) if m and m["title"]
                   else (None, body.strip()))
  nolink = target.startswith("!")
  target = target.lstrip("!~") if not m else target.lstrip("!")
  if title is None:
    title = target.rsplit(".", 1)[-1] if body.strip().startswith("~") else target
    title = title.lstrip(".")
  code = f"`{title}`"
  if nolink:
    return code
  path, rendered = resolve(target)
  return f"[{code}][{path}]" if path and rendered else code


def fence_examples(text: str) -> str:
  """``Example::`` + an indented block (reST's literal block) -> a Google
  ``Example:`` section holding a fenced python block; ``Example:`` or
  ``Example::`` + a doctest (``>>>``) -> an ``Examples:`` section (griffe
  renders its ``>>>`` lines as code); ``Example:`` + prose stays."""
  lines = text.split("\n")
  out, i = [], 0
  while i < len(lines):
    m = EXAMPLE.match(lines[i])
    if not m:
      out.append(lines[i])
      i += 1
      continue
    indent = len(m["indent"].expandtabs())
    j = i + 1
    while j < len(lines) and not lines[j].strip():
      j += 1
    block_start = j
    while j < len(lines) and (not lines[j].strip() or
                              len(lines[j]) - len(lines[j].lstrip()) > indent):
      j += 1
    block = lines[block_start:j]
    while block and not block[-1].strip():
      block.pop()
    if not block:
      out.append(lines[i])
      i += 1
      continue
    body_indent = min(len(l) - len(l.lstrip()) for l in block if l.strip())
    pad = " " * (indent + 2)
    code = [l[body_indent:] for l in block]
    if code[0].lstrip().startswith(">>>"):
      out.append(" " * indent + "Examples:")
      out.extend(pad + l if l.strip() else "" for l in code)
    elif m["colons"] == ":":        # a Google section of prose: as it is
      out.extend(lines[i:block_start + len(block)])
    else:
      out.append(" " * indent + "Example:")
      out.extend([pad + "```python"] + [pad + l if l.strip() else "" for l in code]
                 + [pad + "```"])
    out.extend(lines[block_start + len(block):j])
    i = j
  return "\n".join(out)


RETURNS = re.compile(r"^(?P<head>[ \t]*Returns:[ \t]*\n[ \t]*)(?P<line>[^\n]*)", re.M)


def _is_type(text: str) -> bool:
  """``Zero1State``, ``tuple[a, b]``, ``(params, state)``: an expression
  Google style's "type: description" may start with."""
  try:
    node = ast.parse(text, mode="eval").body
  except SyntaxError:
    return False
  return isinstance(node, (ast.Name, ast.Attribute, ast.Subscript, ast.Tuple,
                           ast.BinOp))


def plain_returns(text: str) -> str:
  """A ``Returns:`` block's first line as griffe reads it: the text before
  its first colon is the returned type, shown as code. ````(a, b)````: loses
  its backticks (they would show inside that code); prose with a colon
  ("True if started (or had been: ...") keeps its colon as ``&#58;``, so
  that the sentence stays the description."""
  def fix(m):
    line = m["line"]
    head, colon, rest = line.partition(":")
    if not colon:
      return m[0]
    bare = head.strip().strip("`")
    if _is_type(bare):
      return f"{m['head']}{bare}:{rest}"
    if head.count("`") % 2:        # the colon is inside a code span
      return m[0]
    return f"{m['head']}{head}&#58;{rest}"
  return RETURNS.sub(fix, text)


def _api_roots(page: Path) -> list[str]:
  return re.findall(r"^:::\s*([\w.]+)", page.read_text(encoding="utf-8"), re.M)


class Docstrings(_Extension):
  """Rewrites the rendered objects' docstrings once the package is loaded."""

  def __init__(self, api_page: str = "docs/api.md") -> None:
    super().__init__()
    self.api_page = Path(api_page)

  def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader,
                 **kwargs: Any) -> None:
    del kwargs
    if pkg.name != "zero1_jax":
      return
    self.modules = loader.modules_collection
    rendered: dict[str, griffe.Object] = {}
    for root in _api_roots(self.api_page):
      obj = self._find(root)
      if obj is None:
        _log.warning("%s: ::: %s names nothing in zero1_jax", self.api_page,
                     root)
        continue
      self._collect(obj, rendered, root=True)
    self.rendered = {o.path for o in rendered.values()}
    for obj in rendered.values():
      if obj.docstring is not None:
        obj.docstring.value = self.rewrite(obj)

  def _collect(self, obj, into: dict, root: bool = False) -> None:
    """``obj`` and the members mkdocstrings shows by default: declared here
    (not inherited, not imported), public (no single leading underscore),
    with a docstring."""
    if not root and (obj.is_alias or re.match(r"_[^_]", obj.name) or
                     obj.docstring is None):
      return
    into[obj.path] = obj
    if obj.is_class or obj.is_module and root:
      for member in obj.members.values():
        self._collect(member, into)

  def _find(self, path: str):
    try:
      obj = self.modules[path]
    except (KeyError, ValueError):
      return None
    if obj.is_alias:
      try:
        obj = obj.final_target
      except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None   # an import of another project's name
    return obj

  def _candidates(self, obj, target: str) -> list[str]:
    module = obj.module
    if target.startswith("."):       # relative to the enclosing package
      return [f"{p}{target}" for p in (module.path, module.path.rpartition(".")[0])]
    scopes = []
    cls = obj if obj.is_class else obj.parent if obj.parent and obj.parent.is_class else None
    if cls is not None:
      scopes.append(cls.path)
    scopes.append(module.path)
    package = module.path
    while "." in package:
      package = package.rpartition(".")[0]
      scopes.append(package)
    return [f"{s}.{target}" for s in scopes] + [target]

  def resolve(self, obj, target: str) -> tuple[str | None, bool]:
    for cand in self._candidates(obj, target):
      found = self._find(cand)
      if found is not None:
        return found.path, found.path in self.rendered
    if target.split(".")[0] not in EXTERNAL:
      _log.warning("%s: %r names nothing zero1_jax defines (docstring of %s)",
                   obj.filepath, target, obj.path)
    return None, False

  def rewrite(self, obj) -> str:
    text = ROLE.sub(lambda m: role_to_markdown(
        m["body"], lambda t: self.resolve(obj, t)), obj.docstring.value)
    return plain_returns(fence_examples(text))
