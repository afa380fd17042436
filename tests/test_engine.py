"""initialize() / Engine: a DeepSpeed config drives the zero1 step."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero1_jax as z1
from zero1_jax import checkpoint, distributed
from zero1_jax.deepspeed import engine as zengine
from zero1_jax.deepspeed import memory_log
from zero1_jax.deepspeed.config import ConfigError
from helpers import (SEED_CONFIG, assert_close, batch, deepspeed_clip,
                     float_part, loss_fn, mesh, odd_params)
from tolerances import FP32_REORDER


def fp32_config(**over):
  cfg = {"train_batch_size": 16, "zero_optimization": {"stage": 1},
         "gradient_clipping": 1.0,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
  cfg.update(over)
  return cfg


def test_seed_config_builds_the_described_transform():
  cfg = z1.load_config(SEED_CONFIG, world_size=4)
  tx = zengine.build_tx(cfg)
  assert tx.config.reduce == "all_reduce"                  # reduce_scatter: false
  assert tx.config.gather_bucket_bytes == int(5e8) * 2     # elements x fp16
  assert tx.config.loss_scale == z1.DynamicLossScale()      # DeepSpeed defaults
  assert tx.config.max_grad_norm == 1.0   # no gradient_clipping key: 0.19 clips at 1.0


@pytest.mark.parametrize("reduce_scatter", [True, False])
def test_engine_equals_optax_with_clipping_and_accumulation(reduce_scatter):
  """reduce_scatter: false (the seed config's setting) takes the all-reduce
  path; both must follow the unsharded reference."""
  params = float_part(odd_params())
  bs = [batch(16, seed=s) for s in range(6)]
  cfg = fp32_config(gradient_accumulation_steps=2,
                    zero_optimization={"stage": 1,
                                       "reduce_scatter": reduce_scatter})
  engine = z1.initialize(cfg, loss_fn=loss_fn, params=params, mesh=mesh(4))
  assert engine.tx.config.reduce == ("reduce_scatter" if reduce_scatter
                                     else "all_reduce")
  assert engine.config.train_micro_batch_size_per_gpu == 2
  for b in bs:
    m = engine.train_batch(b)
  assert engine.global_steps == 6 and engine.skipped_steps == 0
  ref_tx = optax.chain(deepspeed_clip(1.0),   # DeepSpeed's rule, not optax's
                       optax.adamw(1e-2, weight_decay=0.1))
  p, s = params, ref_tx.init(params)
  for b in bs:
    u, s = ref_tx.update(jax.grad(loss_fn)(p, b), s, p)
    p = optax.apply_updates(p, u)
  # fp32 rounding over 6 AdamW steps (test_equivalence): measured 1.6e-7,
  # both paths.
  assert_close(engine.params, p, FP32_REORDER, f"engine reduce_scatter={reduce_scatter} ")
  assert np.isfinite(float(m["loss"]))


def test_engine_fp16_keeps_an_fp32_master_and_counts_skips(caplog):
  cfg = {**SEED_CONFIG, "fp16": {"enabled": True, "initial_scale_power": 30,
                                 "hysteresis": 1}}
  engine = z1.initialize(cfg, loss_fn=loss_fn, params=float_part(odd_params()),
                         mesh=mesh(4))
  assert all(x.dtype == jnp.float16 for x in jax.tree.leaves(engine.params))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(engine.opt_state.master))
  scales = []
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    for i in range(4):
      engine.train_batch(batch(32, seed=i))
      scales.append(engine.loss_scale)
  assert engine.global_steps == 4
  assert engine.skipped_steps >= 1          # 2^30 overflows fp16 at first
  assert scales[0] == 2.0 ** 29
  # each skip says so, as DeepSpeed's loss scaler does (loss_scaler.py 273-277)
  assert caplog.text.count("OVERFLOW! Rank 0 Skipping step.") == engine.skipped_steps
  assert ("Attempted loss scale: 1073741824, reducing to 536870912"
          in caplog.text), caplog.text


def test_engine_raises_like_deepspeed_at_minimum_scale():
  cfg = {**SEED_CONFIG, "fp16": {"enabled": True, "initial_scale_power": 1,
                                 "hysteresis": 1, "min_loss_scale": 1}}
  boom = lambda p, b: loss_fn(p, b) * jnp.inf
  engine = z1.initialize(cfg, loss_fn=boom, params=float_part(odd_params()),
                         mesh=mesh(4))
  engine.train_batch(batch(32))                       # 2 -> 1
  with pytest.raises(RuntimeError, match="loss scale already at minimum"):
    engine.train_batch(batch(32))


def test_engine_at_minimum_scale_with_hysteresis_left_raises_only_when_due(caplog):
  """DeepSpeed's DynamicLossScaler (runtime/fp16/loss_scaler.py): at the
  minimum scale with hysteresis 2, the first overflow only uses up one
  hysteresis (skipped, no error); the second, due to halve, raises."""
  cfg = {**SEED_CONFIG, "fp16": {"enabled": True, "initial_scale_power": 0,
                                 "hysteresis": 2, "min_loss_scale": 1}}
  boom = lambda p, b: loss_fn(p, b) * jnp.inf
  engine = z1.initialize(cfg, loss_fn=boom, params=float_part(odd_params()),
                         mesh=mesh(4))
  assert engine.loss_scale == 1.0
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    engine.train_batch(batch(32))                     # hysteresis 2 -> 1
  assert engine.skipped_steps == 1
  # DeepSpeed's line (runtime/fp16/loss_scaler.py 281-284, 0.19.6)
  assert ("OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1, but "
          "hysteresis is 2. Reducing hysteresis to 1") in caplog.text
  with pytest.raises(RuntimeError, match="loss scale already at minimum"):
    engine.train_batch(batch(32))


def test_engine_bad_input():
  engine = z1.initialize(fp32_config(), loss_fn=loss_fn,
                         params=float_part(odd_params()), mesh=mesh(4))
  with pytest.raises(ValueError, match=r"leading dimension 8 != train_batch_size 16"):
    engine.train_batch(batch(8))
  with pytest.raises(ConfigError, match="stage"):
    z1.initialize(fp32_config(zero_optimization={"stage": 3}), loss_fn=loss_fn,
                  params=float_part(odd_params()), mesh=mesh(4))
  with pytest.raises(ValueError, match="data axis 'data'"):
    z1.initialize(fp32_config(), loss_fn=loss_fn, params=float_part(odd_params()),
                  mesh=jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]))


def test_memory_report_is_measured():
  engine = z1.initialize(fp32_config(), loss_fn=loss_fn,
                         params=float_part(odd_params()), mesh=mesh(4))
  r = engine.memory_report()
  assert r["num_devices"] == 4
  layout = z1.plan(float_part(odd_params()), 4)
  shard_elems = sum(l.shard_size for l in layout.leaves)
  state = (engine.opt_state.master, engine.opt_state.inner)
  scalars = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim == 0)
  replicated_params = len(layout.indices(z1.core.layout.REPLICATE))  # 'gain'
  # fp32 params are their own master: Adam's mu and nu, 8 bytes an element.
  hyper = scalars - 8 * replicated_params                   # counts, lr, ...
  assert r["sharded_bytes"] == 8 * shard_elems + hyper
  sharded_elems = sum(l.shard_size for l in layout.leaves if l.kind == "shard")
  assert r["replicated_bytes"] == 8 * (4 * sharded_elems + replicated_params) + hyper


def test_engine_checkpoint_restores_at_another_n(tmp_path):
  params = float_part(odd_params())
  bs = [batch(16, seed=s) for s in range(6)]
  a = z1.initialize(fp32_config(), loss_fn=loss_fn, params=params, mesh=mesh(4))
  for b in bs[:3]:
    a.train_batch(b)
  a.save_checkpoint(tmp_path / "ckpt", client_state={"data_step": 3})
  a.wait_checkpoints()
  for b in bs[3:]:
    a.train_batch(b)
  c = z1.initialize(fp32_config(), loss_fn=loss_fn, params=params, mesh=mesh(2))
  # DeepSpeed's return: (the step's directory, the client_state saved)
  path, client_state = c.load_checkpoint(tmp_path / "ckpt")
  assert path == str(tmp_path / "ckpt" / "3")
  assert client_state["data_step"] == 3 and c.global_steps == 3
  for b in bs[3:]:
    c.train_batch(b)
  assert c.global_steps == a.global_steps == 6
  assert_close(c.params, a.params, FP32_REORDER, "N=4 -> N=2 ")
  # a mistyped directory is an error that creates nothing; a DeepSpeed tag
  # says what to write instead
  with pytest.raises(checkpoint.UnreadableCheckpointError, match="does not exist"):
    c.load_checkpoint(tmp_path / "ckpt_typo")
  assert not (tmp_path / "ckpt_typo").exists()
  with pytest.raises(ValueError, match="is tag=12"):
    c.save_checkpoint(tmp_path / "ckpt", tag="global_step12")


def test_max_to_keep_holds_after_a_load(tmp_path):
  """A resumed run (load, then save with a limit) keeps only the newest
  max_to_keep steps: the load's Checkpointer (no limit) must not be reused
  for the saves. Found with zero1-train --resume --save_total_limit 2, which
  kept every step."""
  params = float_part(odd_params())
  ckpt = tmp_path / "ckpt"
  a = z1.initialize(fp32_config(), loss_fn=loss_fn, params=params, mesh=mesh(2))
  for tag in (1, 2, 3):
    a.save_checkpoint(ckpt, tag, max_to_keep=2)
  a.wait_checkpoints()
  assert z1.checkpoint.committed_steps(ckpt) == [2, 3]
  b = z1.initialize(fp32_config(), loss_fn=loss_fn, params=params, mesh=mesh(2))
  b.load_checkpoint(ckpt)
  for tag in (4, 5, 6):
    b.save_checkpoint(ckpt, tag, max_to_keep=2)
  b.wait_checkpoints()
  assert z1.checkpoint.committed_steps(ckpt) == [5, 6]
  with pytest.raises(ValueError, match="max_to_keep=0 would delete every "
                     "checkpoint; pass at least 1, or None"):
    z1.checkpoint.Checkpointer(tmp_path / "other", max_to_keep=0)


def test_load_without_tag_loads_the_last_save_as_deepspeed(tmp_path, caplog):
  """DeepSpeed's load_checkpoint(dir) loads the tag its ``latest`` file
  names, the last save, not the highest step: a run resumed from step 2 of
  a directory that also holds step 4 from an earlier run, then saved at 3,
  continues from 3 the next time."""
  params = float_part(odd_params())
  ckpt = tmp_path / "ckpt"
  a = z1.initialize(fp32_config(), loss_fn=loss_fn, params=params, mesh=mesh(2))
  for s in range(4):
    a.train_batch(batch(16, seed=s))
    if a.global_steps % 2 == 0:
      a.save_checkpoint(ckpt)
  a.wait_checkpoints()
  assert (ckpt / "latest").read_text() == "4\n"
  b = z1.initialize(fp32_config(), loss_fn=loss_fn, params=params, mesh=mesh(2))
  assert b.load_checkpoint(ckpt, 2)[0] == str(ckpt / "2")
  b.train_batch(batch(16, seed=99))
  b.save_checkpoint(ckpt)
  b.wait_checkpoints()
  c = z1.initialize(fp32_config(), loss_fn=loss_fn, params=params, mesh=mesh(2))
  assert c.load_checkpoint(ckpt)[0] == str(ckpt / "3")
  assert c.global_steps == 3
  assert_close(c.params, b.params, 0.0, "the last save ")
  # a latest whose save never committed: the highest committed step, said
  (ckpt / "latest").write_text("7\n")
  with caplog.at_level("WARNING", logger="zero1_jax"):
    assert c.load_checkpoint(ckpt)[0] == str(ckpt / "4")
  assert "names step 7, whose save never committed" in caplog.text
  assert z1.checkpoint.committed_steps(ckpt) == [2, 3, 4]


def test_resume_with_a_scheduler_added_names_the_config_change(tmp_path):
  """A scheduler adds optimizer state (the schedule's count): resuming a
  checkpoint saved without one cannot fit, and the error says it is the
  config's scheduler, not only which state leaf is missing."""
  params = float_part(odd_params())
  a = z1.initialize(fp32_config(), loss_fn=loss_fn, params=params, mesh=mesh(2))
  a.save_checkpoint(tmp_path / "ckpt")
  a.wait_checkpoints()
  b = z1.initialize(fp32_config(scheduler={"type": "WarmupLR", "params": {
      "warmup_num_steps": 10}}), loss_fn=loss_fn, params=params, mesh=mesh(2))
  with pytest.raises(z1.checkpoint.CheckpointMismatchError,
                     match=r'"scheduler": null when saved, \{"type": "WarmupLR"'
                           r'.* resume with the config it was saved with'):
    b.load_checkpoint(tmp_path / "ckpt")


def test_bad_batch_and_missing_optimizer_name_the_fix():
  """A scalar batch leaf is named (it was "leading dimension(s) ['16',
  'None']"); a config without an optimizer says what to add."""
  params = float_part(odd_params())
  e = z1.initialize(fp32_config(), loss_fn=loss_fn, params=params, mesh=mesh(2))
  with pytest.raises(ValueError, match=r"batch leaf \['t'\] is a scalar"):
    e.train_batch({**batch(16), "t": 1.0})
  cfg = {k: v for k, v in fp32_config().items() if k != "optimizer"}
  with pytest.raises(z1.ConfigError, match=r"no 'optimizer' section: add one, "
                     r"e\.g\. \"optimizer\": \{\"type\": \"AdamW\""):
    z1.initialize(cfg, loss_fn=loss_fn, params=params, mesh=mesh(2))


def test_steps_per_print_logs_deepspeeds_step_line(caplog):
  """DeepSpeed logs "step=, skipped=, lr=" at INFO every steps_per_print
  steps; the engine did not log at all. Unset, nothing (DeepSpeed 0.19.8's
  default is None, runtime/constants.py:46); None turns it off
  (zero1-train prints its own lines)."""
  params = float_part(odd_params())
  e = z1.initialize(fp32_config(steps_per_print=2), loss_fn=loss_fn,
                    params=params, mesh=mesh(2))
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    for s in range(5):
      e.train_batch(batch(16, seed=s))
  lines = [r.getMessage() for r in caplog.records if "step=" in r.getMessage()]
  assert [l.split(",")[0] for l in lines] == ["[Rank 0] step=2",
                                             "[Rank 0] step=4"], lines
  assert re.fullmatch(r"\[Rank 0\] step=4, skipped=0, lr=\[0\.01\], "
                      r"loss=\d+\.\d{4}", lines[1]), lines
  assert z1.initialize(fp32_config(), loss_fn=loss_fn, params=params,
                       mesh=mesh(2)).steps_per_print is None   # DeepSpeed's
  caplog.clear()
  e.steps_per_print = None
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    e.train_batch(batch(16, seed=9))
  assert "step=" not in caplog.text


def test_initialize_logs_deepspeeds_memory_lines_once_on_process_0(
    caplog, monkeypatch):
  """DeepSpeed's ZeRO optimizer reports the optimizer state's memory once, on
  rank 0, as it builds the state; a script's z1.initialize said nothing
  (only zero1-train printed the lines). The numbers are the engine's own
  measurement (memory_report): the global arrays' bytes and rank 0's."""
  params = float_part(odd_params())
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    e = z1.initialize(fp32_config(), loss_fn=loss_fn, params=params,
                      mesh=mesh(4))
  lines = [r.getMessage() for r in caplog.records
           if r.name == memory_log.__name__]
  r, gib = e.memory_report(), 1024 ** 3
  assert lines == [
      "[Rank 0] Zero Stage 1: optimizer state partitioned",
      f"[Rank 0] Before: optimizer state {r['replicated_bytes'] / gib:.4g} "
      f"GiB per device",
      f"[Rank 0] After : optimizer state {r['sharded_bytes'] / gib:.4g} GiB "
      f"per device (1/4)",
      "[Rank 0] AllGather bucket size: 500000000",
      "[Rank 1-3] the same as Rank 0"], lines
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    with memory_log.quiet():     # zero1-train prints its own
      z1.initialize(fp32_config(), loss_fn=loss_fn, params=params, mesh=mesh(4))
    # process 1 of a job (its lines would name its own ranks): silent
    monkeypatch.setattr(distributed, "is_main_process", lambda: False)
    memory_log.log(e)
  assert not [r for r in caplog.records if r.name == memory_log.__name__]


def test_a_key_not_honoured_warns_at_the_callers_line():
  """The warning points at the user's z1.initialize call (it pointed inside
  zero1_jax/deepspeed/engine.py) and has its own category to filter."""
  with pytest.warns(z1.deepspeed.schema.NotHonouredWarning,
                    match="wall_clock_breakdown=True is recognised but not "
                          "honoured") as got:
    z1.initialize(fp32_config(wall_clock_breakdown=True), loss_fn=loss_fn,
                  params=float_part(odd_params()), mesh=mesh(2))
  assert [w.filename for w in got] == [__file__]


def test_get_lr_is_the_rate_of_the_next_update_as_deepspeeds():
  """DeepSpeed's engine.get_lr() reads the optimizer's rate, which its
  scheduler sets after each applied update: the rate of the *next* update,
  one value per parameter group (one here). WarmupLR 'linear' from 0 to 0.1
  over 4 steps (DeepSpeed 0.19.8 runtime/lr_schedules.py): the first update
  runs at warmup_min_lr (set at construction, last_batch_iteration -1),
  update k >= 2 at 0.1 * (k - 2) / 4 (iteration k - 2). So get_lr() before
  any step and after each of 5 is 0, 0, 0.025, 0.05, 0.075, 0.1 (the rates
  the updates themselves use are test_config_optim's)."""
  cfg = fp32_config(scheduler={"type": "WarmupLR", "params": {
      "warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4,
      "warmup_type": "linear"}})
  e = z1.initialize(cfg, loss_fn=loss_fn, params=float_part(odd_params()),
                    mesh=mesh(2))
  got = [e.get_lr()]
  for s in range(5):
    e.train_batch(batch(16, seed=s))
    got.append(e.get_lr())
  np.testing.assert_allclose(np.ravel(got), [0.0, 0.0, 0.025, 0.05, 0.075, 0.1],
                             rtol=1e-6, atol=1e-9)
  assert all(len(g) == 1 for g in got)


def test_stage_0_runs_as_stage_1_with_stage_0s_overflow_rule(caplog):
  """DeepSpeed's stage 0 (a config without zero_optimization) is plain data
  parallelism: the same update as stage 1, which the engine runs instead,
  saying so. What differs in DeepSpeed 0.19.8 is kept: fp32 stage 0 applies
  a step with a non-finite gradient norm (its torch optimizer has no
  overflow check), ZeRO-1 skips it."""
  params = float_part(odd_params())
  bs = [batch(16, seed=s) for s in range(3)]
  zero0 = {k: v for k, v in fp32_config().items() if k != "zero_optimization"}
  with caplog.at_level(logging.INFO, logger="zero1_jax"):
    e0 = z1.initialize(zero0, loss_fn=loss_fn, params=params, mesh=mesh(2))
  assert "stage=0" in caplog.text and "runs as ZeRO stage 1" in caplog.text
  e1 = z1.initialize(fp32_config(), loss_fn=loss_fn, params=params, mesh=mesh(2))
  assert zengine.run_stage(e0.config) == 1 and e0.config.zero.stage == 0
  for b in bs:
    e0.train_batch(b)
    e1.train_batch(b)
  # Not bitwise: without the skip's select XLA fuses the update otherwise
  # (measured 8.7e-8 relative after 3 steps, 1 ulp): fp32's 1e-6 floor.
  assert_close(e0.params, e1.params, FP32_REORDER, "stage 0 vs 1 ")
  x = bs[0]["x"].copy()
  x[0, 0] = np.nan
  nan = dict(bs[0], x=x)
  assert not bool(e0.train_batch(nan)["skipped"])    # applied: weights NaN
  assert bool(e1.train_batch(nan)["skipped"])
  assert not np.isfinite(np.asarray(e0.params["dense"]["kernel"])).all()
  assert np.isfinite(np.asarray(e1.params["dense"]["kernel"])).all()


def test_deepspeed_engine_calls_name_what_to_use():
  """A ported DeepSpeed loop's calls: train_batch_size() works as a method
  too; forward/backward/step and the rest raise naming the replacement;
  initialize(model=..., model_parameters=...) says what it takes."""
  e = z1.initialize(fp32_config(), loss_fn=loss_fn,
                    params=float_part(odd_params()), mesh=mesh(2))
  assert e.train_batch_size == e.train_batch_size() == 16
  for name, fix in (("backward", "engine.train_batch(batch)"),
                    ("step", "engine.train_batch(batch)"),
                    ("get_global_grad_norm", "['grad_norm']"),
                    ("was_step_applied", "['skipped']"),
                    ("module", "engine.params"),
                    ("gradient_accumulation_steps",
                     "engine.config.gradient_accumulation_steps")):
    with pytest.raises(AttributeError, match=re.escape(fix)):
      getattr(e, name)
  with pytest.raises(AttributeError, match="has no attribute 'nonsense'"):
    e.nonsense
  with pytest.raises(TypeError, match=re.escape("engine.train_batch(batch)")):
    e(batch(16))
  with pytest.raises(TypeError, match="model, model_parameters.*loss_fn="):
    z1.initialize(model=object(), model_parameters=[], config=fp32_config())
  with pytest.raises(TypeError, match="unexpected keyword argument 'modle'"):
    z1.initialize(fp32_config(), loss_fn, {}, modle=1)
  with pytest.raises(TypeError, match="needs loss_fn, params"):
    z1.initialize(fp32_config())
