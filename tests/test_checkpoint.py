"""Checkpoints: exact resume, restore at another N, loss-scale state, export,
and the errors for bad or damaged checkpoints.

One N=8 run (adamw on the odd-shaped tree) is checkpointed at step K while it
keeps training to 2K; the tests restore that checkpoint in different ways and
continue. Same N: bitwise. Other N: within the 1e-6 relative tolerance of
test_equivalence.py (N devices sum the gradients in another order).
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import zero1_jax as z1
from helpers import (assert_close, assert_equal, batch, float_part, loss_fn,
                     mesh, odd_params)
from tolerances import FP32_REORDER
from zero1_jax import checkpoint as zc
from zero1_jax.cli import export as export_cli

K = 3
B = 24   # divisible by 8, 4, 3, 2 and 1
BATCHES = [batch(B, seed=s) for s in range(2 * K)]
TX = z1.zero1(optax.adamw(1e-2, weight_decay=0.1), axis_name="data",
              bucket_bytes=96)
_STEPS = {}


def run(tx, p, s, n, batches, loss=loss_fn):
  key = (id(tx), n, loss)
  if key not in _STEPS:
    _STEPS[key] = z1.train_step(loss, tx, mesh(n))
  for b in batches:
    p, s, _ = _STEPS[key](p, s, b)
  return p, s


def host(tree):
  return jax.tree.map(np.array, tree)


def masters(params, state):
  """The master weights (numpy): each stored master leaf cut to its
  parameter's shape, and the parameter itself where it is its own master
  (params already in the master dtype store none)."""
  return jax.tree.map(
      lambda p, m: np.asarray(p) if m is None
      else np.asarray(m)[tuple(map(slice, p.shape))],
      float_part(params), float_part(state.master))


def checkpointed_run(d, tx, params, n, batches, extra=None, config=None):
  """Trains len(batches) steps at N=n, saving after K; returns host copies."""
  p, s = z1.init(tx, params, mesh(n))
  p, s = run(tx, p, s, n, batches[:K])
  at_save = host((p, s))
  ck = zc.Checkpointer(d)
  ck.save(K, p, s, extra=extra, config=config)
  # Keep training (the step donates p and s) while the save is in flight.
  p, s = run(tx, p, s, n, batches[K:])
  ck.wait()
  return ck, at_save, host((p, s))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("n8")
  params = odd_params()
  extra = {"step": K, "data_position": K * B, "seed": np.int64(7)}
  ck, at_save, final = checkpointed_run(d, TX, params, 8, BATCHES, extra,
                                        {"lr": 1e-2, "optimizer": "adamw"})
  return types.SimpleNamespace(dir=d, ck=ck, params=params, at_save=at_save,
                               final=final)


def assert_state_layout(state, params, n):
  want = z1.state_shardings(TX, params, mesh(n))
  for got, sh in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    assert got.sharding == sh


def test_resume_same_n_is_bitwise(saved):
  ck = zc.Checkpointer(saved.dir)
  assert ck.all_steps() == [K] and ck.latest_step() == K
  p, s, extra = ck.restore(None, TX, saved.params, mesh(8))
  assert extra == {"step": K, "data_position": K * B, "seed": 7}
  assert ck.metadata(K)["config"] == {"lr": 1e-2, "optimizer": "adamw"}
  assert ck.metadata(K)["num_shards"] == 8
  assert_state_layout(s, saved.params, 8)
  # The whole state (padding included) and the params come back bit for bit.
  for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves(saved.at_save)):
    np.testing.assert_array_equal(np.asarray(a), b)
  p, s = run(TX, p, s, 8, BATCHES[K:])
  for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves(saved.final)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_saved_state_stays_sharded(saved):
  """Each sharded leaf was written from its shards (sharded over "data" on
  disk metadata), never gathered to one device or host."""
  with ocp.PyTreeCheckpointer() as c:
    meta = c.metadata((saved.dir / str(K) / "state").absolute()).item_metadata.tree
  specs = {name: tuple(m.sharding.partition_spec) for name, m in meta.items()}
  for name in ("inner.0.mu.dense.kernel", "inner.0.nu.out.kernel",
               "inner.0.mu.out.bias"):
    assert "data" in specs[name], (name, specs[name])
  assert specs["loss_scale.scale"] == ()
  assert "master.empty" not in specs and "master.step_id" not in specs
  # fp32 params are their own master: no copy is saved (a bf16 master is
  # checked in test_fp32_master.py).
  assert not [name for name in specs if name.startswith("master.")]


@pytest.mark.parametrize("n", [4, 3, 2, 1])
def test_restore_at_another_n_then_continue(saved, n):
  p, s, _ = zc.Checkpointer(saved.dir).restore(K, TX, saved.params, mesh(n))
  assert_state_layout(s, saved.params, n)
  assert_equal(masters(p, s), masters(*saved.at_save), f"N=8->{n} master ")
  specs = z1.plan(saved.params, n).leaves
  for tree in (s.master, s.inner[0].mu, s.inner[0].nu):   # padding is zero
    for got, spec in zip(jax.tree.leaves(tree, is_leaf=lambda x: x is None),
                         specs):
      if got is not None:
        rest = np.array(got)
        rest[tuple(map(slice, spec.shape))] = 0
        assert rest.shape == spec.padded_shape and not rest.any()
  p, s = run(TX, p, s, n, BATCHES[K:])
  assert_close(float_part(p), float_part(saved.final[0]), FP32_REORDER, f"N=8->{n} ")
  np.testing.assert_array_equal(p["step_id"], saved.params["step_id"])


def test_restore_from_1_to_8(tmp_path):
  params = odd_params(seed=3)
  _, _, final = checkpointed_run(tmp_path, TX, params, 1, BATCHES)
  p, s, _ = zc.Checkpointer(tmp_path).restore(K, TX, params, mesh(8))
  assert_state_layout(s, params, 8)
  p, s = run(TX, p, s, 8, BATCHES[K:])
  assert_close(float_part(p), float_part(final[0]), FP32_REORDER, "N=1->8 ")


def overflow_loss(params, b):
  return loss_fn(params, b) * jnp.where(jnp.any(b["boom"] > 0), jnp.inf, 1.0)


def test_fp16_loss_scale_state_survives(tmp_path):
  params = odd_params(jnp.float16)
  tx = z1.zero1(optax.adam(1e-2), axis_name="data",
                loss_scale=z1.DynamicLossScale(initial_scale_power=8))
  bs = [{**batch(B, seed=i, dtype=np.float16), "boom": np.zeros(B, np.float32)}
        for i in range(2 * K)]
  bs[1]["boom"][:] = 1     # an overflow before the save: hysteresis 2 -> 1
  p, s = z1.init(tx, params, mesh(8))
  p, s = run(tx, p, s, 8, bs[:K], overflow_loss)
  ls = host(s.loss_scale)
  assert (float(ls.scale), int(ls.step), int(ls.last_overflow),
          int(ls.hysteresis)) == (256.0, K, 1, 1)
  at_save = host((p, s))
  ck = zc.Checkpointer(tmp_path)
  ck.save(K, p, s)
  p, s = run(tx, p, s, 8, bs[K:], overflow_loss)
  final = host((p, s))
  for n in (8, 2):
    p, s, _ = ck.restore(K, tx, params, mesh(n))
    assert all(x.dtype == jnp.float16 for x in jax.tree.leaves(float_part(p)))
    assert_equal(s.loss_scale._asdict(), ls._asdict(), f"N={n} loss scale ")
  # Same N: the continuation is bitwise.
  p, s, _ = ck.restore(K, tx, params, mesh(8))
  p, s = run(tx, p, s, 8, bs[K:], overflow_loss)
  for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves(final)):
    np.testing.assert_array_equal(np.asarray(a), b)
  # Export gives the fp32 masters, not the fp16 params.
  zc.export_params(tmp_path, tmp_path / "fp32", K)
  got = zc.load_params(tmp_path / "fp32")
  want = masters(*at_save)
  assert_equal(float_part(got), want, "fp16 export ")
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(float_part(got)))
  assert_equal(jax.tree.map(lambda x: x.astype(np.float16), float_part(got)),
               float_part(at_save[0]), "fp16 params = cast master ")


def test_export_loads_into_plain_optax(saved, tmp_path):
  out = tmp_path / "fp32"
  assert zc.export_params(saved.dir, out) == K
  got = zc.load_params(out)
  p_saved, s_saved = saved.at_save
  assert_equal(float_part(got), masters(p_saved, s_saved), "export ")
  np.testing.assert_array_equal(got["step_id"], saved.params["step_id"])
  assert got["empty"].shape == (0, 3) and got["empty"].dtype == np.float32
  # Plain orbax reads it too (zero-size leaves are listed in zero1_export.json).
  plain = ocp.StandardCheckpointer().restore(out.absolute())
  assert_equal(float_part(plain), float_part(got), "plain orbax ")
  # A plain optax user trains from it like from the in-memory parameters.
  tx = optax.adamw(1e-2)

  def train(p):
    s = tx.init(p)
    for b in BATCHES[K:]:
      u, s = tx.update(jax.grad(loss_fn)(p, b), s, p)
      p = optax.apply_updates(p, u)
    return p

  assert_equal(train(float_part(jax.tree.map(jnp.asarray, got))),
               train(float_part(jax.tree.map(jnp.asarray, p_saved))), "optax ")
  # The output directory is not overwritten by accident.
  with pytest.raises(zc.CheckpointError, match="already exists"):
    zc.export_params(saved.dir, out)


def test_export_cli(saved, tmp_path, capsys):
  out = tmp_path / "cli"
  assert export_cli.main(["--checkpoint_dir", str(saved.dir),
                          "--output_dir", str(out)]) == 0
  assert f"step {K}" in capsys.readouterr().out
  assert_equal(float_part(zc.load_params(out)),
               masters(*saved.at_save), "cli ")
  rc = export_cli.main(["--checkpoint_dir", str(saved.dir), "--output_dir",
                        str(tmp_path / "x"), "--step", "99"])
  err = capsys.readouterr().err
  assert rc == 2 and "step 99" in err and "not found" in err   # bad input: 2,
  # as zero1-train's
  assert err.count("\n") == 1
  # DeepSpeed's zero_to_fp32.py order: CHECKPOINT_DIR OUTPUT_DIR.
  assert export_cli.main([str(saved.dir), str(tmp_path / "pos")]) == 0
  assert_equal(float_part(zc.load_params(tmp_path / "pos")),
               masters(*saved.at_save), "positional ")
  # again into the same directory: the flag to pass, not the Python keyword
  assert export_cli.main([str(saved.dir), str(tmp_path / "pos")]) == 2
  err = capsys.readouterr().err
  assert err.strip().endswith("already exists and is not empty (--overwrite "
                              "replaces it)") and err.count("\n") == 1, err
  assert export_cli.main([str(saved.dir), str(tmp_path / "pos"),
                          "--overwrite"]) == 0
  # zero_to_fp32.py's --tag (global_stepN or N) picks the step as --step
  for tag in (f"global_step{K}", str(K)):
    assert export_cli.main([str(saved.dir), str(tmp_path / tag),
                            "--tag", tag]) == 0
    assert f"step {K}" in capsys.readouterr().out
  assert export_cli.main([str(saved.dir), str(tmp_path / "t99"),
                          "--tag", "global_step99"]) == 2
  assert "step 99" in capsys.readouterr().err
  for argv, needle in ((["--output_dir", str(tmp_path / "z")], "checkpoint dir is required"),
                       ([str(saved.dir), "--checkpoint_dir", "other",
                         "--output_dir", "o"], "disagree"),
                       ([str(saved.dir), "o", "--tag", "best"],
                        "--tag best: give a step, as global_stepN or N"),
                       ([str(saved.dir), "o", "--tag", "3", "--step", "4"],
                        "disagree")):
    with pytest.raises(SystemExit) as e:
      export_cli.main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err
  # A run directory (steps in checkpoints/) or one step's directory: the
  # error says where the steps are.
  run_dir = tmp_path / "run"
  shutil.copytree(saved.dir, run_dir / "checkpoints")
  for given, needle in ((run_dir, f"its checkpoints (steps [{K}]) are in "
                         f"{run_dir / 'checkpoints'}"),
                        (run_dir / "checkpoints" / str(K),
                         f"it is step {K}'s own directory: pass the directory "
                         f"that holds the steps, {run_dir / 'checkpoints'}")):
    assert export_cli.main([str(given), str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
  # The console script (or the module): one line, no traceback.
  script = os.path.join(os.path.dirname(sys.executable), "zero1-export")
  cmd = [script] if os.path.exists(script) else [
      sys.executable, "-m", "zero1_jax.cli.export"]
  r = subprocess.run(
      cmd + ["--checkpoint_dir", str(tmp_path / "missing"),
             "--output_dir", str(tmp_path / "y")],
      capture_output=True, text=True, timeout=120,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 2, r.stderr
  assert r.stderr.strip().splitlines() == [
      f"zero1-export: error: zero1 checkpoint: directory "
      f"{tmp_path / 'missing'} does not exist"], r.stderr


def test_tree_or_shape_mismatch_names_the_path(saved):
  ck = zc.Checkpointer(saved.dir)
  wider = jax.tree.map(lambda x: x, saved.params)
  wider["dense"]["kernel"] = jnp.zeros((5, 9))
  with pytest.raises(zc.CheckpointMismatchError,
                     match=r"parameter \['dense'\]\['kernel'\] is "
                           r"float32\[5, 7\] in the checkpoint but "
                           r"float32\[5, 9\] in the model"):
    ck.restore(K, TX, wider, mesh(4))
  more = {**saved.params, "head": jnp.zeros(4)}
  with pytest.raises(zc.CheckpointMismatchError,
                     match=r"step 3 .* parameter \['head'\] is in the model, "
                           r"not in the checkpoint"):
    ck.restore(K, TX, more, mesh(4))
  fewer = {k: v for k, v in saved.params.items() if k != "gain"}
  with pytest.raises(zc.CheckpointMismatchError,
                     match=r"parameter \['gain'\] is in the checkpoint, not in "
                           r"the model"):
    ck.restore(K, TX, fewer, mesh(4))
  sgd = z1.zero1(optax.sgd(1e-2, momentum=0.9), axis_name="data")
  with pytest.raises(zc.CheckpointMismatchError,
                     match=r"optimizer state \.inner\[0\]\.trace\['dense'\]\['bias'\] "
                           r"is in the model, not in the checkpoint"):
    ck.restore(K, sgd, saved.params, mesh(4))


def test_a_plain_orbax_checkpoint_is_named_as_such(tmp_path):
  """A TrainState saved with orbax itself, then given to zero1's restore:
  it said "incomplete: file 5/params/_METADATA is missing" of a complete
  checkpoint."""
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(tmp_path / "plain") as m:
    m.save(5, args=ocp.args.StandardSave({"w": np.ones(3, np.float32)}))
  with pytest.raises(zc.UnreadableCheckpointError,
                     match=r"step 5 .* is not a zero1_jax checkpoint \(it holds "
                           r"\['default'\]: written by orbax itself\?\)"):
    zc.Checkpointer(tmp_path / "plain").restore(None, TX, odd_params(), mesh(2))


def test_save_options_and_errors(saved, tmp_path):
  ck = zc.Checkpointer(tmp_path, async_save=False, max_to_keep=2)
  p, s = z1.init(TX, saved.params, mesh(2))
  with pytest.raises(zc.CheckpointError, match="extra must be JSON"):
    ck.save(1, p, s, extra={"rng": object()})
  ck.save(1, p, s)
  with pytest.raises(zc.CheckpointError, match="step 1 already exists"):
    ck.save(1, p, s)
  ck.save(1, p, s, extra={"again": True}, force=True)
  assert ck.restore(1, TX, saved.params, mesh(2))[2] == {"again": True}
  assert (tmp_path / "1/zero1_files.json").exists()   # sync save: recorded
  with pytest.raises(zc.CheckpointError, match="opt_state must be a Zero1State"):
    ck.save(2, p, s.inner)
  for step in (2, 3):
    ck.save(step, p, s)
  assert ck.all_steps() == [2, 3]                    # max_to_keep=2


def test_damaged_steps_are_named_and_fallback_is_explicit(saved, tmp_path,
                                                          caplog):
  d = tmp_path / "ckpt"
  shutil.copytree(saved.dir, d)
  src = d / str(K)
  assert (src / "zero1_files.json").exists()
  # 10: a file missing; 11: data truncated; 12: never committed; 13: orbax's
  # temporary directory of an unfinished save; 14: truncated, and without the
  # file list (as if saved by another tool): orbax's own read error is named.
  for s in (10, 11, 12, 14):
    shutil.copytree(src, d / str(s))
  (d / "10/state/_METADATA").unlink()
  for s in (11, 14):
    for f in (d / f"{s}/state/d").iterdir():
      os.truncate(f, 10)
  (d / "14/zero1_files.json").unlink()
  (d / "12/commit_success.txt").unlink()
  meta = json.loads((d / "12/_CHECKPOINT_METADATA").read_text())
  meta["commit_timestamp_nsecs"] = None
  (d / "12/_CHECKPOINT_METADATA").write_text(json.dumps(meta))
  shutil.copytree(src, d / "13.orbax-checkpoint-tmp-1234")
  # steps made by copying, not saved: no 'latest' file names the last save
  # (as in a directory of an earlier version), so the highest one is latest
  (d / "latest").unlink()

  ck = zc.Checkpointer(d)
  assert ck.all_steps() == [K, 10, 11, 14] and ck.latest_step() == 14
  args = (TX, saved.params, mesh(4))
  with pytest.raises(zc.UnreadableCheckpointError,
                     match=r"step 10 .* file 10/state/_METADATA is missing"):
    ck.restore(10, *args)
  with pytest.raises(zc.UnreadableCheckpointError,
                     match=r"step 11 .* damaged: file 11/state/d/[0-9a-f]+ has "
                           r"10 bytes, \d+ when saved"):
    ck.restore(11, *args)
  with pytest.raises(zc.UnreadableCheckpointError,
                     match=r"step 14 .* unreadable: file 14/state/d/[0-9a-f]+ is "
                           r"damaged \(.*value of size 10\)"):
    ck.restore(14, *args)
  with pytest.raises(zc.UnreadableCheckpointError,
                     match=r"step 12 .* never committed"):
    ck.restore(12, *args)
  with pytest.raises(zc.UnreadableCheckpointError,
                     match=r"step 13 .* unfinished save \(13\.orbax-checkpoint-tmp"):
    ck.restore(13, *args)
  with pytest.raises(zc.UnreadableCheckpointError,
                     match=r"step 99 .* not found \(committed steps: "
                           r"\[3, 10, 11, 14\]\)"):
    ck.restore(99, *args)
  # Never silently by default: the latest committed step is 14, and it fails.
  with pytest.raises(zc.UnreadableCheckpointError, match="step 14"):
    ck.restore(None, *args)
  # latest-valid: skips 14, 12, 11, 10 (each logged with its reason), loads 3.
  with caplog.at_level(logging.WARNING, logger="zero1_jax.checkpoint"):
    p, s, extra = ck.restore(None, *args, fallback_to_valid=True)
  assert extra["step"] == K
  log = caplog.text
  assert "skipping step 14" in log and "14/state/d/" in log
  assert "skipping step 12" in log and "never committed" in log
  assert "skipping step 11" in log and "11/state/d/" in log
  assert "skipping step 10" in log and "10/state/_METADATA" in log
  assert ": zero1 checkpoint:" not in log   # one prefix a line, not two
  assert "restored step 3 instead (skipped [14, 12, 11, 10])" in log
  assert_equal(masters(p, s), masters(*saved.at_save), "fallback ")
  # From an explicit step, too; and a damaged manifest is named.
  shutil.copytree(src, d / "15")
  (d / "15/zero1_files.json").unlink()
  (d / "15/meta/metadata").write_text('{"format": ')
  with pytest.raises(zc.UnreadableCheckpointError,
                     match=r"step 15 .* file 15/meta/metadata is damaged"):
    ck.restore(15, *args)
  with caplog.at_level(logging.WARNING, logger="zero1_jax.checkpoint"):
    assert ck.restore(11, *args, fallback_to_valid=True)[2]["step"] == K
  assert "skipped [11, 10]" in caplog.text
