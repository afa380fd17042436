"""The README's complete example runs as written."""

import os
import pathlib
import re
import subprocess
import sys


def test_readme_complete_example_runs():
  text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  example = next(b for b in blocks if "for _ in range(10)" in b)
  scope: dict = {}
  exec(compile(example, "README.md", "exec"), scope)
  assert float(scope["metrics"]["loss"]) < 1.0


def test_readme_checkpoint_example_runs_as_written_from_another_dir(tmp_path):
  """The complete example, then the Checkpoints block, pasted into a new
  file and run from an unrelated directory: relative paths, no extra calls,
  exit 0 only if the steps were committed and exported."""
  root = pathlib.Path(__file__).parent.parent
  blocks = re.findall(r"```python\n(.*?)```", (root / "README.md").read_text(), re.S)
  example = next(b for b in blocks if "for _ in range(10)" in b)
  ckpt = next(b for b in blocks if "z1.checkpoint.Checkpointer(" in b)
  (tmp_path / "user.py").write_text(example + ckpt)
  env = {**os.environ, "PYTHONPATH": str(root), "XLA_FLAGS": ""}
  for _ in range(2):   # and again, as users rerun a script
    proc = subprocess.run([sys.executable, "user.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
  assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
      "1", "2", "3", "latest"]     # latest: the last save, as DeepSpeed's
  assert (tmp_path / "fp32_params" / "_METADATA").exists()


def test_names_the_readme_uses_are_public():
  import zero1_jax as z1
  for name in ("zero1", "init", "train_step", "initialize", "load_config",
               "DynamicLossScale", "flax.TrainState", "flax.state_specs",
               "flax.NnxTrainer", "checkpoint.Checkpointer",
               "checkpoint.export_params", "checkpoint.load_params",
               "distributed.initialize", "distributed.global_batch",
               "inspect.collectives", "inspect.memory", "inspect.overlap",
               "inspect.overlap_summary", "reduced_params"):
    obj = z1
    for part in name.split("."):
      obj = getattr(obj, part)
  assert set(z1.__all__) <= set(dir(z1))


def test_readme_plain_jit_example_runs(capsys):
  """The plain-jit block (flax TrainState, plain and reduced params): both
  train, and the reduced run's step has no full-size all-reduce."""
  text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  example = next(b for b in blocks if "z1.reduced_params(" in b)
  exec(compile(example, "README.md", "exec"), {})
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 2, lines
  (loss_plain, coll_plain), (loss_red, coll_red) = (
      l.split(" ", 1) for l in lines)
  assert float(loss_plain) < 0.05 and float(loss_red) < 0.05, lines
  assert "all-reduce" in coll_plain and "reduce-scatter" not in coll_plain
  assert "reduce-scatter" in coll_red and "all-reduce" not in coll_red


def test_readme_2d_mesh_example_runs(capsys):
  """The 2-D mesh block: params keep "model", the moments add "data"."""
  text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  example = next(b for b in blocks if '("data", "model")' in b)
  scope: dict = {}
  exec(compile(example, "README.md", "exec"), scope)
  out = capsys.readouterr().out.strip().splitlines()
  assert out == ["P(None, 'model') P('data', 'model')"], out
  assert float(scope["metrics"]["loss"]) < 2.0


def test_readme_linen_shard_map_example_trains(capsys):
  """The linen shard_map block: the pcast view gives each device its own
  gradient, zero1 averages them, and 20 SGD steps fit the data (at N=8 the
  N-times gradient of P() params would diverge: lr 0.8 on curvature 3.3)."""
  example = next(b for b in _blocks() if "pcast(state.params" in b)
  exec(compile(example, "README.md", "exec"), {})
  loss = float(capsys.readouterr().out.strip().splitlines()[-1])
  assert loss < 1e-6, loss


def _blocks() -> list[str]:
  text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
  return re.findall(r"```python\n(.*?)```", text, re.S)


def test_every_readme_block_runs_alone_or_after_the_complete_example():
  """Each python block runs as pasted: on its own if it imports what it
  uses, else right after the complete example (the README says which it
  continues). A fragment that leans on names it never defines fails here
  with a NameError, as it would for a user."""
  blocks = _blocks()
  example = next(b for b in blocks if "for _ in range(10)" in b)
  ran = 0
  for b in blocks:
    if "Checkpointer(" in b:    # writes files: run from another dir above
      continue
    scope: dict = {}
    if not b.startswith("import "):
      exec(compile(example, "README.md", "exec"), scope)
    exec(compile(b, "README.md", "exec"), scope)
    ran += 1
  assert ran == len(blocks) - 1


def test_readme_first_block_and_engine_block_train():
  blocks = _blocks()
  first = blocks[0]
  scope: dict = {}
  exec(compile(first, "README.md", "exec"), scope)
  assert float(scope["metrics"]["loss"]) == 1.0     # zero weights, targets 1
  example = next(b for b in blocks if "for _ in range(10)" in b)
  engine_block = next(b for b in blocks if "z1.initialize(" in b)
  scope = {}
  exec(compile(example + engine_block, "README.md", "exec"), scope)
  assert scope["engine"].global_steps == 1
  assert float(scope["metrics"]["loss"]) < 1.0


def test_readme_json_is_the_repositorys_seed_config():
  """The JSON printed for pip users is the file the commands use in the
  repository (make demo), key for key."""
  import json
  root = pathlib.Path(__file__).parent.parent
  (block,) = re.findall(r"```json\n(.*?)```", (root / "README.md").read_text(), re.S)
  assert json.loads(block) == json.loads(
      (root / "experiments/configs/ds_zero_stage1.json").read_text())
