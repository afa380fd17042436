"""Every python block of the README runs as written: pasted into a file of
its own and run from an unrelated directory, in a fresh process whose
environment has no XLA_FLAGS (each block sets up its own 8 CPU devices), it
exits 0 and prints what shows it worked."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _blocks() -> list[str]:
  return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


BLOCKS = _blocks()


def _run(block: str, cwd: pathlib.Path) -> str:
  (cwd / "user.py").write_text(block)
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["PYTHONPATH"] = str(ROOT)
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "user.py"], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  # on CPU with too few devices the library warns "nothing is sharded"
  assert "nothing is sharded" not in proc.stderr, proc.stderr[-2000:]
  return proc.stdout


def test_readme_has_the_three_scripts_first_the_two_flax_loops():
  assert len(BLOCKS) == 3, len(BLOCKS)
  assert "TrainState.create" in BLOCKS[0] and "nnx.Optimizer" in BLOCKS[1]
  assert "z1.initialize(" in BLOCKS[2]
  for b in BLOCKS:   # each sets its own devices before jax is imported
    head = b.split("import jax", 1)[0]
    assert "xla_force_host_platform_device_count=8" in head, head


_STATE = re.compile(r"loss (?P<loss>[0-9.e+-]+); Adam state on device 0: "
                    r"(?P<mine>[0-9,]+) of (?P<whole>[0-9,]+) bytes \(1/8\)")


@pytest.mark.parametrize("index", [0, 1], ids=["TrainState", "nnx"])
def test_flax_loop_blocks_train_and_shard_the_state(index, tmp_path):
  out = _run(BLOCKS[index], tmp_path).strip().splitlines()
  m = _STATE.fullmatch(out[-1])
  assert m, out
  mine, whole = (int(m[k].replace(",", "")) for k in ("mine", "whole"))
  # 1/8 of the state, plus padding (each leaf padded to a multiple of 8
  # elements) and the replicated scalar count: at least whole/8, and far
  # below whole/4 (a replicated state would be whole)
  assert whole / 8 <= mine < whole / 4, (mine, whole)
  # targets sin(x).sum over 16 features: variance ~16 x 0.43 ~ 7 at the
  # start; 100 Adam steps of a 256-unit MLP fit it well below 1
  assert float(m["loss"]) < 1.0, out


def test_deepspeed_block_trains_checkpoints_and_shards(tmp_path):
  out = _run(BLOCKS[2], tmp_path).strip().splitlines()
  m = re.fullmatch(r"step 100, loss (?P<loss>[0-9.]+), lr 5e-02; optimizer "
                   r"state on device 0: (?P<mine>\d+) of (?P<whole>\d+) bytes",
                   out[-1])
  assert m, out
  # a linear target y = x.sum(1): the loss starts at ~16 (the target's
  # variance); 100 AdamW steps at 5e-2 after a 10-step warm-up fit it
  assert float(m["loss"]) < 0.1, out
  assert int(m["mine"]) < int(m["whole"]) / 4, out
  assert (tmp_path / "ckpt_readme" / "latest").exists()


def test_readme_links_resolve():
  """Every relative link of the README names a file of the repository."""
  links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
  rel = [l for l in links if "://" not in l]
  assert rel
  missing = [l for l in rel if not (ROOT / l).exists()]
  assert not missing, missing


def test_readme_states_what_make_test_runs_and_its_time():
  text = README.read_text()
  assert "make test" in text and "make demo" in text
  # The count and time the README gives are those docs/testing.md records
  # with its provenance line (one measurement, stated in both places).
  import re
  m = re.search(r"(\d+) passed in (\d+):(\d\d)", text)
  assert m, "the README gives make test's count and time"
  testing = (ROOT / "docs" / "testing.md").read_text()
  assert (f"{m[1]} passed in {int(m[2])} min {int(m[3])} s" in testing), (
      m[0], "docs/testing.md's provenance line differs")


def test_readme_is_a_guide_not_a_reference():
  words = len(README.read_text().split())
  assert words <= 1600, words


def test_names_the_readme_and_docs_use_are_public():
  import zero1_jax as z1
  for name in ("zero1", "zero2", "init", "train_step", "initialize",
               "load_config", "loss_scale", "inner_state", "from_optax_state",
               "DynamicLossScale", "StaticLossScale", "NoLossScale",
               "flax.TrainState", "flax.state_specs", "flax.NnxTrainer",
               "checkpoint.Checkpointer", "checkpoint.export_params",
               "checkpoint.load_params", "distributed.initialize",
               "distributed.global_batch", "inspect.collectives",
               "inspect.memory", "inspect.device_bytes", "inspect.overlap",
               "inspect.overlap_summary", "reduced_params"):
    obj = z1
    for part in name.split("."):
      obj = getattr(obj, part)
  assert set(z1.__all__) <= set(dir(z1))
