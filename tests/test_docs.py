"""Every python block of docs/*.md runs as written, each in a fresh scope
from an empty directory (a block that leans on a name it never defines
fails with a NameError, as it would for a reader). Blocks not meant to run
(shell, JSON, output, fragments) use other fence languages. The docs site
itself is built by `make docs` (mkdocs build --strict: links, anchors)."""

import json
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PRELUDE = "xla_force_host_platform_device_count=8"


def _blocks(page: str) -> list[str]:
  return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


CASES = [(p.name, i) for p in sorted(DOCS.glob("*.md"))
         for i in range(len(_blocks(p.name)))]


def _find(page: str, needle: str) -> str:
  (block,) = [b for b in _blocks(page) if needle in b]
  return block


def _exec(block: str, where: str, tmp_path, monkeypatch) -> dict:
  monkeypatch.chdir(tmp_path)
  # the block appends to XLA_FLAGS (too late to matter here: conftest set 8
  # devices); restored after the test so that other tests' subprocesses see
  # the environment as it was
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  scope: dict = {"__name__": "__main__"}
  exec(compile(block, where, "exec"), scope)   # noqa: S102 - our own docs
  return scope


def test_the_docs_have_runnable_blocks():
  assert len(CASES) >= 5, CASES


@pytest.mark.parametrize("page,index", CASES,
                         ids=[f"{p}-{i}" for p, i in CASES])
def test_docs_block_runs(page, index, tmp_path, monkeypatch, capsys):
  block = _blocks(page)[index]
  # standalone on CPU: the block sets up its devices before importing jax
  head = block.split("import jax", 1)[0]
  assert PRELUDE in head, f"{page} block {index} does not set its devices"
  _exec(block, f"docs/{page}", tmp_path, monkeypatch)
  assert capsys.readouterr().out.strip(), f"{page} block {index} prints nothing"


def test_home_page_quickstart_prints_what_the_page_says(tmp_path, monkeypatch,
                                                      capsys):
  """index.md's TrainState script: the loss falls well below what a model
  that learned nothing scores (y = sum of 16 sin(x), variance ~6.9), and the
  state line is the one the text under the block quotes, byte for byte."""
  _exec(_find("index.md", "TrainState.create"), "docs/index.md", tmp_path,
        monkeypatch)
  out = capsys.readouterr().out.strip()
  m = re.fullmatch(r"loss ([0-9.]+); (Adam state on device 0: .* \(1/8\))", out)
  assert m, out
  assert float(m[1]) < 1.0, out
  quoted = re.search(r"It prints the loss and `([^`]+)`",
                     (DOCS / "index.md").read_text())
  assert quoted and quoted[1] == m[2], (quoted and quoted[1], m[2])


def test_plain_jit_block_plain_vs_reduced_collectives(tmp_path, monkeypatch, capsys):
  """forms.md's plain-jit block (flax TrainState, plain and reduced params):
  both train, and the reduced run's step has no full-size all-reduce."""
  _exec(_find("forms.md", "z1.reduced_params("), "docs/forms.md", tmp_path,
        monkeypatch)
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 2, lines
  (loss_plain, coll_plain), (loss_red, coll_red) = (l.split(" ", 1) for l in lines)
  # x, y all ones: 30 adamw steps at 1e-2 from zero weights fit w.sum = 1
  assert float(loss_plain) < 0.05 and float(loss_red) < 0.05, lines
  assert "all-reduce" in coll_plain and "reduce-scatter" not in coll_plain
  assert "reduce-scatter" in coll_red and "all-reduce" not in coll_red


def test_shard_map_block_gets_each_devices_gradient(tmp_path, monkeypatch, capsys):
  """forms.md's linen shard_map block: the pcast view gives each device its
  own gradient, zero1 averages them, and 20 SGD steps fit the data (with the
  N-times gradient of P() params, lr 0.8 on curvature 3.3 would diverge)."""
  _exec(_find("forms.md", "pcast(state.params"), "docs/forms.md", tmp_path,
        monkeypatch)
  loss = float(capsys.readouterr().out.strip().splitlines()[-1])
  assert loss < 1e-6, loss


def test_train_step_block(tmp_path, monkeypatch, capsys):
  scope = _exec(_find("forms.md", "z1.train_step(loss_fn, tx, mesh)\nbatch"),
                "docs/forms.md", tmp_path, monkeypatch)
  assert float(scope["metrics"]["loss"]) < 1.0    # 1.0 at zero weights
  assert "state on device 0" in capsys.readouterr().out


def test_mesh2d_block_keeps_model_and_adds_data(tmp_path, monkeypatch, capsys):
  scope = _exec(_blocks("mesh2d.md")[0], "docs/mesh2d.md", tmp_path, monkeypatch)
  out = capsys.readouterr().out.strip().splitlines()
  assert out == ["P(None, 'model') P('data', 'model')"], out
  assert float(scope["metrics"]["loss"]) < 2.0


def test_checkpoint_block_commits_and_exports(tmp_path, monkeypatch, capsys):
  for _ in range(2):   # and again, as users rerun a script (force=True)
    _exec(_blocks("checkpoint.md")[0], "docs/checkpoint.md", tmp_path, monkeypatch)
  assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
      "1", "2", "3", "latest"]
  assert (tmp_path / "fp32_params" / "_METADATA").exists()
  assert "restored step 3" in capsys.readouterr().out


def test_cli_json_is_the_repositorys_demo_config():
  """The JSON printed for pip users is the file make demo uses, key for key."""
  (block,) = re.findall(r"```json\n(.*?)```", (DOCS / "cli.md").read_text(), re.S)
  assert json.loads(block) == json.loads(
      (ROOT / "experiments/configs/ds_zero_stage1.json").read_text())


def test_every_docs_page_is_in_the_site_nav():
  nav = (ROOT / "mkdocs.yml").read_text()
  pages = {p.name for p in DOCS.glob("*.md")}
  listed = set(re.findall(r":\s*([\w.]+\.md)\s*$", nav, re.M))
  assert pages == listed, (pages - listed, listed - pages)
