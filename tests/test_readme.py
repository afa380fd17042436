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


def test_names_the_readme_uses_are_public():
  import zero1_jax as z1
  for name in ("zero1", "init", "train_step", "initialize", "load_config",
               "DynamicLossScale", "flax.TrainState", "flax.state_specs",
               "flax.NnxTrainer", "checkpoint.Checkpointer",
               "checkpoint.export_params", "checkpoint.load_params",
               "distributed.initialize", "distributed.global_batch",
               "inspect.collectives", "inspect.memory"):
    obj = z1
    for part in name.split("."):
      obj = getattr(obj, part)
  assert set(z1.__all__) <= set(dir(z1))
