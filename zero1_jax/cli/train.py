"""``zero1-train``: DeepSpeed's launch command, on a JAX mesh.

  zero1-train --num_devices 4 --deepspeed experiments/configs/ds_zero_stage1.json \\
    --model_name_or_path bert-large-uncased --per_device_train_batch_size 8 \\
    --output_dir ./output

On a machine without accelerators, ``--num_devices`` simulated CPU devices
are created; with GPUs, the first ``--num_devices`` GPUs are used.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings

from zero1_jax.cli import (agreed_stop, common, config_flags, hf_auto,
                           interrupt, reports, resume_flag, rundir, train_args)

log = logging.getLogger("zero1_jax")


def _one_cpu_device_note(n: int, num_devices, multi: bool,
                         backend: str) -> str | None:
  """On a CPU, "all devices" (no --num_devices) is one: say that nothing is
  sharded and how to simulate more."""
  if n == 1 and not num_devices and not multi and backend == "cpu":
    return ("[zero1-train] 1 CPU device: nothing is sharded; --num_devices 4 "
            "simulates 4 devices on this CPU")
  return None


def _setup(args):
  """Joins the job, builds config, model, data and engine; refuses a run
  that cannot fit before the parameters exist."""
  with interrupt.held():   # a Ctrl-C while jax loads: exit 130, no crash
    common.overlap_flags(args.deepspeed)
    jax = common.start_jax(args.num_devices)
  from zero1_jax import data
  from zero1_jax.models import bert
  from zero1_jax.deepspeed import engine as zengine
  from zero1_jax.deepspeed import tx as ds_tx
  from zero1_jax.core import one_device

  mesh, multi, main = _join(jax, args)
  cfg = _load_config(args, mesh)
  dtype = ds_tx.compute_dtype(cfg) or jax.numpy.float32
  mcfg = bert.make_config(args.model_name_or_path, vocab_size=data.VOCAB_SIZE,
                          max_len=args.seq_len, dtype=dtype)
  resume = resume_flag.wanted(args, os.path.join(args.output_dir,
                                                 "checkpoints"))
  init = lambda key: bert.init_params(mcfg, key)
  from zero1_jax.cli import memory   # imports jax: after start_jax
  est = memory.check(mcfg, init, cfg, mesh, args.seq_len,
                     model=args.model_name_or_path,
                     ignore=args.ignore_memory_estimate,
                     pinned=config_flags.pinned_batch_keys(args.deepspeed))
  common.release_notes()
  if main:
    _announce(args, mesh, multi, jax.default_backend())
  params = init(jax.random.key(args.seed))
  batches = data.MLMBatches(data.load_corpus(args.train_file), args.seq_len,
                            cfg.train_batch_size, seed=args.seed)
  from zero1_jax.deepspeed import memory_log
  # a lone CPU: _one_cpu_device_note says it; the memory lines: run() prints
  # them on every process, with the estimate
  with warnings.catch_warnings(), memory_log.quiet():
    warnings.simplefilter("ignore", one_device.OneDeviceWarning)
    engine = zengine.initialize(cfg, bert.make_loss_fn(mcfg), params, mesh)
  engine.steps_per_print = None     # _train prints its own step lines
  return engine, batches, main, resume, est


def _join(jax, args):
  """Joins the job (jax.distributed; a lone process: nothing) and builds the
  data mesh. Returns ``(mesh, multi, main)``: several processes? process 0?"""
  from zero1_jax import distributed
  try:   # it swallows SIGTERM (a TPU preemption notice): mpirun's, scancel's
    jax.config.update("jax_enable_preemption_service", False)
  except (AttributeError, KeyError):   # another jax: none to turn off
    pass
  multi = distributed.initialize(
      args.coordinator_address, args.num_processes, args.process_id,
      auto=args.distributed_auto,
      heartbeat_timeout_seconds=args.heartbeat_timeout)
  from zero1_jax.cli import launch, peers
  if multi and not os.environ.get(launch.LAUNCHER_PID):
    # a dead peer: one line and exit, not the 100 s wait (the local
    # launcher does it itself: it stops the others and names the process)
    peers.start(args.output_dir)
  mesh = common.data_mesh(jax, None if multi else args.num_devices)
  main = distributed.is_main_process()
  if not main:    # the config notes: once per job
    logging.getLogger("zero1_jax").setLevel(logging.WARNING)
  return mesh, multi, main


def _load_config(args, mesh):
  """The DeepSpeed JSON with the flags applied (config_flags.load); its
  no-effect notes said in one line, once every check has passed."""
  from zero1_jax import data
  from zero1_jax.models import bert
  from zero1_jax.deepspeed import config as zconfig
  notes = reports.NoEffectNotes()   # the per-key notes, said in one line
  log.addFilter(notes)
  try:
    cfg = config_flags.load(zconfig, args.deepspeed, mesh.shape["data"], dict(
        train_micro_batch_size_per_gpu=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        train_batch_size=args.train_batch_size, lr=args.learning_rate,
        fp16=args.fp16, bf16=args.bf16, warmup_steps=args.warmup_steps,
        gradient_clipping=args.max_grad_norm, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        **{hf_auto.WEIGHT_DECAY: args.weight_decay,
           hf_auto.EPS: args.adam_epsilon},
        report_to=args.report_to, logging_dir=args.logging_dir,
        output_dir=args.output_dir),
        max_steps=args.max_steps,
        hidden_size=lambda: bert.make_config(
            args.model_name_or_path, vocab_size=data.VOCAB_SIZE,
            max_len=args.seq_len).hidden_size)
  finally:
    log.removeFilter(notes)
  if notes.summary():   # held like the others until every check passed
    log.info("%s", notes.summary())
  return cfg


def _announce(args, mesh, multi: bool, backend: str) -> None:
  """Process 0's lines before the parameters exist: the earlier run removed
  (--overwrite_output_dir), what trains and where, a lone CPU device."""
  if args.overwrite_output_dir:
    gone = rundir.clear(args.output_dir)
    if gone:
      print(f"[zero1-train] --overwrite_output_dir: removed the earlier "
            f"run's {', '.join(gone)} from {args.output_dir}", flush=True)
  print(f"[zero1-train] {args.model_name_or_path}: architecture only, "
        f"weights start random (nothing is downloaded); outputs go to "
        f"{args.output_dir}", flush=True)
  note = _one_cpu_device_note(mesh.size, args.num_devices, multi, backend)
  if note:
    print(note, flush=True)
  print("[zero1-train] initialising the parameters, checking the optimizer "
        "on their shards and sharding its state...", flush=True)


def run(args: argparse.Namespace) -> dict | None:
  """Trains; returns the summary written to ``output_dir/summary.json``."""
  args.output_dir = rundir.check(args.output_dir,
                                 overwrite=args.overwrite_output_dir,
                                 resume=args.resume)
  engine, batches, main_process, resume, est = _setup(args)
  cfg = engine.config
  mem = common.log_memory(engine, est)   # every process: its own ranks
  ckpt_dir = os.path.join(args.output_dir, "checkpoints")
  if resume:
    resume_flag.load(engine, args, ckpt_dir, main_process)
    if engine.global_steps >= args.max_steps:
      return reports.nothing_to_train(engine, args, ckpt_dir, main_process)
    if main_process:
      reports.report_setting_change(engine, args)
  os.makedirs(args.output_dir, exist_ok=True)
  if main_process:
    with open(os.path.join(args.output_dir, "ds_config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=2)
    common.start_segment(args.output_dir, engine.global_steps if resume else 0,
                         common.run_record(args, engine))
  history = common.read_history(args.output_dir, engine.global_steps)
  log_lines = common.step_lines(args.no_progress)
  t0, start = time.perf_counter(), engine.global_steps
  bar = None
  try:
    interrupt.check()
    # From here a Ctrl-C stops every process after the same step (a lone
    # one: at once): one compiling still would block the others' first step.
    with agreed_stop.AgreedStop.start(say=main_process) as stop:
      if engine.global_steps < args.max_steps:
        if main_process:
          print("[zero1-train] compiling the training step (minutes for a "
                "large model on CPU)...", flush=True)
        _compiled_check(engine, batches, est, args, main_process)
        t0 = time.perf_counter()
      # after compiling: its line would land on the bar's, its time in the rate
      bar = common.progress(args.max_steps, initial=engine.global_steps,
                            disable=args.no_progress or not main_process)
      _train(engine, batches, args, cfg, history, bar, log_lines, main_process,
             ckpt_dir, stop)
    bar.close()
    with interrupt.deferred_sigint(resume_hint=lambda: reports.where(ckpt_dir)):
      engine.wait_checkpoints()
  except KeyboardInterrupt:
    interrupt.handled()
    if bar is not None:
      bar.close()
    msg = _interrupted(engine, history, args, ckpt_dir, main_process)
    raise common.Interrupted(msg if main_process else "") from None
  if not main_process:
    return None
  wall = time.perf_counter() - t0
  summary = common.write_outputs(
      args.output_dir, history, mem, engine, wall,
      run=common.run_record(args, engine), resumed_from=start if resume else None)
  from zero1_jax import checkpoint
  saved = checkpoint.committed_steps(ckpt_dir) if os.path.isdir(ckpt_dir) else []
  shown = (", ".join(map(str, saved)) if len(saved) <= 6 else
           f"{saved[0]}, {saved[1]}, ..., {saved[-1]}: {len(saved)}")
  from zero1_jax.checkpoint import steps as ckpt_steps
  last = ckpt_steps.latest_step(ckpt_dir) if saved else None
  stale = (f"; the last saved is {last}, the higher ones are from before "
           f"the resume" if saved and last != saved[-1] else "")
  where = (f"; checkpoints (steps {shown}{stale}) in {ckpt_dir}"
           if saved else "; no checkpoints (--save_steps)")
  if saved and last < engine.global_steps:
    where += (f"; {reports.span(last + 1, engine.global_steps)} not saved "
              f"(--save_steps): --resume latest continues from {last}")
  done = (f"{engine.global_steps} step{'s' * (engine.global_steps != 1)} "
          f"({engine.skipped_steps} skipped)"
          if not start else
          f"{reports.span(start + 1, engine.global_steps)} after resuming at {start} "
          f"({engine.global_steps} in all, {engine.skipped_steps} skipped)")
  print(f"[zero1-train] {done} in {wall:.1f}s of training (compiling before "
        f"it not counted); {common.loss_text(summary)}; outputs in "
        f"{args.output_dir}{where}", flush=True)
  return summary


def _interrupted(engine, history, args, ckpt_dir: str, main_process) -> str:
  """Ctrl-C: lets a save in flight commit (a second Ctrl-C abandons it) and
  says where the run stands and how to continue it."""
  if main_process:
    print("[zero1-train] interrupted: finishing any checkpoint save in flight "
          "(Ctrl-C again to abandon it)", file=sys.stderr, flush=True)
  try:
    with interrupt.abandon_on_sigint(resume_hint=lambda: reports.where(ckpt_dir)):
      engine.wait_checkpoints()
  except Exception:  # noqa: BLE001 - a failed save: not committed, see below
    pass
  where = reports.where(ckpt_dir)
  if not history:
    return f"interrupted before the first step; {where}"
  return (f"interrupted after step {history[-1]['step']} (its metrics are in "
          f"{os.path.join(args.output_dir, 'metrics.jsonl')}); {where}")


def _train(engine, batches, args, cfg, history, bar, log_lines, main_process,
           ckpt_dir, stop: agreed_stop.AgreedStop | None = None) -> None:
  """The step loop: train, log, save every ``--save_steps``; ``stop``: where
  a Ctrl-C stops it (default: at once, a lone process)."""
  stop = stop or agreed_stop.AgreedStop()
  every = train_args.logging_interval(args, cfg.steps_per_print)
  # a period asked for (--logging_steps, steps_per_print): lines with the bar
  log_lines = log_lines or train_args.period_given(args, cfg.steps_per_print)
  first = engine.global_steps + 1     # this invocation's first step: logged
  warmup_said = False    # the first skipped fp16 step is explained, once
  while engine.global_steps < args.max_steps:
    stop.check(engine.global_steps)
    lr = next(iter(engine.get_lr()), None)   # the rate this update uses
    t = time.perf_counter()
    m = engine.train_batch(batches.batch_at(engine.global_steps))
    row = {"step": engine.global_steps, "loss": common.finite(m["loss"]),
           "grad_norm": common.finite(m["grad_norm"]),
           "skipped": bool(m["skipped"]),
           "loss_scale": float(m["loss_scale"]),
           "lr": lr,
           "samples_per_s": cfg.train_batch_size / (time.perf_counter() - t)}
    history.append(row)
    if main_process:
      common.append_metrics(args.output_dir, row)
    bar.update(1)
    loss = float("nan") if row["loss"] is None else row["loss"]
    bar.set_postfix(loss=f"{loss:.3f}", samples_s=f"{row['samples_per_s']:.1f}",
                    **({"skipped": engine.skipped_steps}
                       if engine.skipped_steps else {}))
    if main_process and log_lines and (
        row["step"] == first or row["step"] % every == 0
        or row["step"] == args.max_steps or row["skipped"]):
      _say(bar, reports.step_line(row, cfg.fp16.enabled, engine))
    if main_process and row["skipped"] and not warmup_said:
      note = reports.fp16_skip_note(cfg.fp16, row["step"],
                                    row.get("loss_scale"))
      warmup_said = note is not None
      if note:
        _say(bar, note)
    if args.save_steps and (engine.global_steps % args.save_steps == 0
                            or engine.global_steps == args.max_steps):
      with interrupt.deferred_sigint(    # never inside orbax
          resume_hint=lambda: reports.where(ckpt_dir)):
        engine.save_checkpoint(
            ckpt_dir, extra={"data_step": engine.global_steps, "seed": args.seed},
            max_to_keep=args.save_total_limit)


def _say(bar, line: str) -> None:
  """A console line: above the progress bar when there is one."""
  write = getattr(bar, "write", None)    # tqdm's; common._NoBar has none
  if write is None:
    print(line, flush=True)
  else:
    write(line)
    sys.stdout.flush()


def _compiled_check(engine, batches, est, args, main_process) -> None:
  """Compiles the step ahead of its first call and reads its
  ``memory_analysis``: what it will allocate beyond its arguments must fit
  in what the devices still have."""
  from zero1_jax import inspect
  m = engine.step_memory(batches.batch_at(engine.global_steps))
  extra = m["peak"] - m["argument"]
  if main_process:
    print(f"[zero1-train] compiled step: {common.gib(m['peak'])} per device "
          f"at peak (estimate {common.gib(est[0].per_device)})", flush=True)
  cap, source = inspect.capacity(list(engine.mesh.devices.flat))
  if extra > cap and not args.ignore_memory_estimate:
    raise common.UsageError(
        f"{args.model_name_or_path} will not fit: the compiled step needs "
        f"{common.gib(extra)} per device beyond its inputs, but each has "
        f"{common.gib(cap)} left ({source}). Use a smaller "
        f"--per_device_train_batch_size, fewer --num_devices, bf16, or "
        f"--ignore_memory_estimate")


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = train_args.parse_args(argv)
  try:
    # The config first: a mistyped path is the error to fix, whatever the
    # output directory holds.
    if args.deepspeed and not os.path.isfile(args.deepspeed):
      raise common.UsageError(f"--deepspeed {args.deepspeed}: no such file")
    rundir.check(args.output_dir, overwrite=args.overwrite_output_dir,
                 resume=args.resume)
  except common.UsageError as e:
    print(f"zero1-train: error: {e}", file=sys.stderr)
    return 2
  if (args.num_processes or 1) > 1 and args.process_id is None \
      and args.coordinator_address is None and not args.distributed_auto:
    from zero1_jax.cli import launch
    return launch.launch_local("zero1_jax.cli.train", argv, args.num_processes)
  try:
    with interrupt.held():   # both load jax: a Ctrl-C inside jaxlib's init crashed it
      from zero1_jax import distributed
      from zero1_jax.cli import launch, peers
  except KeyboardInterrupt:
    print("zero1-train: interrupted", file=sys.stderr)
    return 130
  if (args.process_id is not None or args.distributed_auto
      or distributed.cluster_environment()) and not os.environ.get(
          launch.LAUNCHER_PID):
    # mpirun, srun: no gloo lines (as the local launcher) and one line for
    # the runtime's C++ abort after process 0 died; the helper reads the last
    # checkpoint with `steps`, imported before the fork (it takes seconds)
    with interrupt.held():
      from zero1_jax.checkpoint import steps  # noqa: F401
    launch.guard_output(lambda ranks: peers.message(
        ranks, None, args.output_dir, *peers.job_coordinates(args)))
  common.setup_logging()
  with interrupt.remembered():
    code = common.guarded(lambda a: peers.watched(run, a), args, "zero1-train")
  if code == 130 and agreed_stop.multi_process():
    agreed_stop.leave_after_interrupt()
  return code


def cli() -> None:
  """The ``zero1-train`` command: :func:`main`, and after a Ctrl-C an exit
  that skips the interpreter's teardown. Interrupted while starting, XLA may
  still be compiling on its own threads, and tearing the runtime down under
  them crashed (exit 139 instead of 130, 13 times in 20). The saves are
  settled by then (committed, or abandoned by a second Ctrl-C)."""
  code = main()
  if code == 130:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(130)
  sys.exit(code)


if __name__ == "__main__":
  cli()
