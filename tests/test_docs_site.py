"""The docs site's own code: docs/_ext/docstrings.py, which turns the
docstrings' Sphinx roles and reST example blocks into the Markdown
mkdocstrings renders. (The built site itself is checked by `make docs`,
--strict, and `make docs-check` in Chromium.)"""

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _ext():
  spec = importlib.util.spec_from_file_location(
      "zero1_docstrings", ROOT / "docs" / "_ext" / "docstrings.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)   # griffe not needed for the text functions
  return mod


EXT = _ext()


def _roles(text, known):
  """Rewrites ``text``'s roles; ``known``: target -> (path, rendered)."""
  return EXT.ROLE.sub(lambda m: EXT.role_to_markdown(
      m["body"], lambda t: known.get(t, (None, False))), text)


def test_a_role_to_a_rendered_object_becomes_a_cross_reference():
  known = {"zero1_jax.zero1": ("zero1_jax.core.transform.zero1", True)}
  assert _roles("refused by :func:`zero1_jax.zero1`.", known) == (
      "refused by [`zero1_jax.zero1`][zero1_jax.core.transform.zero1].")


def test_a_role_to_anything_else_becomes_code():
  known = {"hook_groups": ("zero1_jax.core.zero2.hook_groups", False)}
  # found but not on the API page (a private helper), a module, jax's name:
  # code, never a link that would not resolve
  assert _roles("(:func:`hook_groups`), :mod:`.layout`, :func:`jax.jit`",
                known) == "(`hook_groups`), `layout`, `jax.jit`"


def test_sphinx_role_spellings():
  known = {t: ("zero1_jax.core.step.init", True)
           for t in ("zero1_jax.init", ".step.init")}
  link = "[`{}`][zero1_jax.core.step.init]"
  assert _roles(":func:`~zero1_jax.init`", known) == link.format("init")
  assert _roles(":py:func:`zero1_jax.init`", known) == link.format("zero1_jax.init")
  assert _roles(":func:`init it <zero1_jax.init>`", known) == link.format("init it")
  assert _roles(":func:`.step.init`", known) == link.format("step.init")
  assert _roles(":func:`!zero1_jax.init`", known) == "`zero1_jax.init`"


def test_rest_literal_example_becomes_a_fenced_block():
  doc = ("Restores.\n\nExample::\n\n  state = make()\n  state = restore(state)"
         "   # optax or zero1\n\nRaises:\n  ValueError: bad.\n")
  out = EXT.fence_examples(doc)
  assert out == ("Restores.\n\nExample:\n  ```python\n  state = make()\n"
                 "  state = restore(state)   # optax or zero1\n  ```\n\n"
                 "Raises:\n  ValueError: bad.\n"), out


def test_doctest_example_becomes_an_examples_section():
  doc = "Does it.\n\nExample:\n  >>> f(1)\n  2\n"
  assert EXT.fence_examples(doc) == "Does it.\n\nExamples:\n  >>> f(1)\n  2\n"


def test_prose_example_section_stays_as_it_is():
  doc = "Does it.\n\nExample:\n  Call it twice; the second call is free.\n"
  assert EXT.fence_examples(doc) == doc


def test_returns_first_line_prose_stays_a_description():
  # griffe reads the words before the first colon as the returned type
  prose = "Returns:\n  True if started (or had been: a second call), False else.\n"
  assert EXT.plain_returns(prose) == (
      "Returns:\n  True if started (or had been&#58; a second call), False else.\n")
  typed = "Returns:\n  ``(params, opt_state)``: params replicated.\n"
  assert EXT.plain_returns(typed) == "Returns:\n  (params, opt_state): params replicated.\n"
  named = "Returns:\n  Zero1State: the state.\n"
  assert EXT.plain_returns(named) == named


def test_every_role_in_the_api_pages_docstrings_has_a_known_spelling():
  """What ROLE does not match stays on the page as text: every ``:x:`y```
  in the library's docstrings must be one of the spellings handled."""
  loose = re.compile(r":[a-z:]+:`")
  for path in (ROOT / "zero1_jax").rglob("*.py"):
    text = path.read_text()
    for m in loose.finditer(text):
      assert EXT.ROLE.match(text, m.start()), (path, text[m.start():m.start() + 60])
