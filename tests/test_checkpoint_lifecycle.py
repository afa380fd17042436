"""Issue 11, case 1: relative paths work everywhere; a failed save is never
silent (next call, wait/close, or the exit status); pending saves finish
before a normal interpreter exit."""

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import zero1_jax as z1
from zero1_jax.checkpoint import lifecycle, reshard
from helpers import mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": ""}

SETUP = """
import jax, jax.numpy as jnp, numpy as np, optax, zero1_jax as z1
mesh = jax.make_mesh((jax.device_count(),), ("data",))
tx = z1.zero1(optax.adam(1e-2), axis_name="data")
params, opt_state = z1.init(tx, {"w": jnp.zeros((5, 3)), "b": jnp.zeros(3)}, mesh)
"""


def script(tmp_path, body: str):
  """Runs SETUP + body as a user's script, from tmp_path (relative paths)."""
  path = tmp_path / "user.py"
  path.write_text(SETUP + textwrap.dedent(body))
  return subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=ENV,
                        capture_output=True, text=True, timeout=180)


def small():
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  p, s = z1.init(tx, {"w": jnp.zeros((5, 3)), "b": jnp.zeros(3)}, mesh(2))
  return tx, p, s


def test_relative_paths_everywhere(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  tx, p, s = small()
  ck = z1.checkpoint.Checkpointer("ckpt")
  ck.save(1, p, s)
  monkeypatch.chdir("/")            # resolved once, when the path came in
  ck.wait()
  assert ck.all_steps() == [1] and (tmp_path / "ckpt" / "1").is_dir()
  monkeypatch.chdir(tmp_path)
  z1.checkpoint.Checkpointer("ckpt").restore(None, tx, p, mesh(2))
  assert z1.checkpoint.export_params("ckpt", "fp32") == 1
  assert set(z1.checkpoint.load_params("fp32")) == {"w", "b"}


def test_latest_is_the_last_save_for_every_reader(tmp_path):
  """Saves 1, 2, 3, then 2 again (a run resumed from 1): step 3 is left from
  the run before. latest_step(), restore(None) and export_params took the
  highest step, 3, while the engine and zero1-train --resume took the last
  save, 2 (seen: zero1-export wrote the abandoned run's weights). Now all
  take 2 (DeepSpeed's 'latest' file), and 3 only if 2 never committed."""
  tx, p, s = small()
  with z1.checkpoint.Checkpointer(tmp_path / "ck") as ck:
    for i in (1, 2, 3):
      ck.save(i, p, s, extra={"i": i})
    ck.save(2, jax.tree.map(lambda x: x + 1, p), s, extra={"i": 20}, force=True)
  ck = z1.checkpoint.Checkpointer(tmp_path / "ck")
  assert ck.all_steps() == [1, 2, 3] and ck.latest_step() == 2
  assert ck.restore(None, tx, p, mesh(2))[2]["i"] == 20
  assert z1.checkpoint.export_params(tmp_path / "ck", tmp_path / "fp32") == 2
  assert z1.checkpoint.steps.latest_step(tmp_path / "ck") == 2
  (tmp_path / "ck" / "latest").write_text("7\n")   # a save that never committed
  assert ck.latest_step() == 3


def test_export_cli_with_relative_paths(tmp_path, monkeypatch):
  from zero1_jax.cli import export
  monkeypatch.chdir(tmp_path)
  _, p, s = small()
  with z1.checkpoint.Checkpointer("ck/checkpoints") as ck:
    ck.save(3, p, s)
  assert export.main(["--checkpoint_dir", "./ck/checkpoints",
                      "--output_dir", "out"]) == 0
  assert (tmp_path / "out" / "_METADATA").exists()


def test_no_wait_still_commits_at_exit(tmp_path):
  """The README's earlier code: async save, no wait(), relative path."""
  proc = script(tmp_path, """
      ckpt = z1.checkpoint.Checkpointer("ckpt", max_to_keep=3)
      ckpt.save(50, params, opt_state, extra={"data_step": 50})
  """)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "cannot schedule new futures" not in proc.stderr
  assert z1.checkpoint.Checkpointer(tmp_path / "ckpt").all_steps() == [50]
  assert not list((tmp_path / "ckpt").glob("*tmp*"))


def inject_background_failure(monkeypatch):
  """The 'extra' JSON item fails while orbax writes it in its thread."""
  class Fails(dict):
    def items(self):
      raise OSError("No space left on device (injected)")
  real = reshard.jsonable
  monkeypatch.setattr(reshard, "jsonable", lambda x, what: Fails(real(x, what))
                      if what == "extra" else real(x, what))
  return lambda: monkeypatch.setattr(reshard, "jsonable", real)


@pytest.mark.parametrize("surfaces_at", ["wait", "next_save", "with_block"])
def test_background_save_failure_is_raised(tmp_path, monkeypatch, surfaces_at):
  _, p, s = small()
  ck = z1.checkpoint.Checkpointer(tmp_path)
  undo = inject_background_failure(monkeypatch)
  with pytest.raises(z1.checkpoint.CheckpointSaveError,
                     match="saving step 2 .* failed: No space left"):
    if surfaces_at == "with_block":
      with z1.checkpoint.Checkpointer(tmp_path) as ck:
        ck.save(2, p, s, extra={"a": 1})
    else:
      ck.save(2, p, s, extra={"a": 1})      # returns: the write is async
      undo()
      ck.wait() if surfaces_at == "wait" else ck.save(3, p, s)
  undo()
  assert 2 not in ck.all_steps()
  if surfaces_at == "with_block":           # closed by the block: a new one
    ck = z1.checkpoint.Checkpointer(tmp_path)
  ck.save(4, p, s)                          # the Checkpointer still works
  ck.wait()
  assert 4 in ck.all_steps()


def test_foreground_save_failure_is_raised(tmp_path, monkeypatch):
  _, p, s = small()
  ck = z1.checkpoint.Checkpointer(tmp_path, async_save=False)
  inject_background_failure(monkeypatch)
  with pytest.raises(z1.checkpoint.CheckpointSaveError, match="step 7"):
    ck.save(7, p, s, extra={"a": 1})


def test_failure_pending_at_exit_is_reported_with_status_1(tmp_path):
  proc = script(tmp_path, """
      from zero1_jax.checkpoint import lifecycle, reshard
      class Fails(dict):
          def items(self):
              raise OSError("No space left on device (injected)")
      real = reshard.jsonable
      reshard.jsonable = lambda x, w: Fails(real(x, w)) if w == "extra" else real(x, w)
      ckpt = z1.checkpoint.Checkpointer("ckpt")
      ckpt.save(5, params, opt_state, extra={"a": 1})
  """)
  assert proc.returncode == 1
  if lifecycle.SAVE_AT_EXIT_WORKS:
    assert ("zero1 checkpoint: error at exit: zero1 checkpoint: saving step 5"
            in proc.stderr)
  else:   # saves are synchronous on this Python: save() itself raised
    assert ("CheckpointSaveError: zero1 checkpoint: saving step 5"
            in proc.stderr)


@pytest.mark.parametrize("version,works", [
    ((3, 11, 7), True), ((3, 12, 0), False), ((3, 12, 2), False),
    ((3, 12, 3), True), ((3, 13, 0), True)])
def test_pythons_that_cannot_save_at_exit_save_synchronously(
    tmp_path, monkeypatch, version, works):
  """CPython 3.12.0-3.12.2 cannot start the threads a save needs once the
  interpreter is shutting down (measured here on 3.12.1: the no-wait save
  above exits with status 1 and no step). There save() writes the step
  before it returns, and says so once."""
  monkeypatch.setattr(lifecycle.sys, "version_info", version + ("final", 0))
  monkeypatch.setattr(lifecycle, "SAVE_AT_EXIT_WORKS", lifecycle.works_at_exit())
  monkeypatch.setattr(lifecycle, "_WARNED", False)
  assert lifecycle.SAVE_AT_EXIT_WORKS is works
  _, p, s = small()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ck = z1.checkpoint.Checkpointer(tmp_path, async_save=True)
    z1.checkpoint.Checkpointer(tmp_path / "b", async_save=True)
  said = [w for w in caught if "3.12.3" in str(w.message)]
  assert len(said) == (0 if works else 1), [str(w.message) for w in said]
  # At the program's line (here), not inside zero1_jax or orbax.
  assert all(w.filename == __file__ for w in said), [w.filename for w in said]
  ck.save(1, p, s)
  # Synchronous: committed (and listed in zero1_files.json) on return.
  assert (tmp_path / "1" / "zero1_files.json").exists() is (not works)
  ck.wait()
  assert ck.all_steps() == [1]



def test_the_synchronous_save_warning_names_the_programs_line(
    tmp_path, monkeypatch):
  """Through the DeepSpeed engine the checkpointer is built two calls
  inside zero1: the warning still points at the program's
  ``save_checkpoint`` line, not at the library's."""
  monkeypatch.setattr(lifecycle, "SAVE_AT_EXIT_WORKS", False)  # as on 3.12.1
  monkeypatch.setattr(lifecycle, "_WARNED", False)
  cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
  engine = z1.initialize(cfg, loss_fn=lambda p, b: jnp.sum(p["w"] * b),
                         params={"w": jnp.zeros((4, 3))}, mesh=mesh(2))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine.save_checkpoint(tmp_path)
  said = [w for w in caught if "3.12.3" in str(w.message)]
  assert [w.filename for w in said] == [__file__], [
      (w.filename, w.lineno) for w in said]

def test_a_step_killed_before_its_file_list_gets_it_at_the_next_restore(
    tmp_path):
  """Killed between orbax's commit and zero1_files.json (the day-one trial's
  kill -9): the step restores, and the restore, having read every file,
  lists them, so a later truncation is named with its sizes."""
  tx, p, s = small()
  ck = z1.checkpoint.Checkpointer(tmp_path, async_save=False)
  ck.save(1, p, s)
  listed = tmp_path / "1" / "zero1_files.json"
  saved = listed.read_text()
  listed.unlink()
  z1.checkpoint.Checkpointer(tmp_path).restore(1, tx, p, mesh(2))
  assert listed.read_text() == saved
  biggest = max((f for f in (tmp_path / "1" / "state").rglob("*")
                 if f.is_file()), key=lambda f: f.stat().st_size)
  os.truncate(biggest, 10)
  with pytest.raises(z1.checkpoint.UnreadableCheckpointError,
                     match=r"damaged: file 1/state/.* has 10 bytes, \d+ when saved"):
    z1.checkpoint.Checkpointer(tmp_path).restore(1, tx, p, mesh(2))


def test_directory_that_is_a_file(tmp_path):
  f = tmp_path / "f"
  f.write_text("x")
  with pytest.raises(z1.checkpoint.CheckpointError, match="is a file"):
    z1.checkpoint.Checkpointer(f)
