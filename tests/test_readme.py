"""The README's complete example runs as written."""

import pathlib
import re


def test_readme_complete_example_runs():
  text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  example = next(b for b in blocks if "for _ in range(10)" in b)
  scope: dict = {}
  exec(compile(example, "README.md", "exec"), scope)
  assert float(scope["metrics"]["loss"]) < 1.0
