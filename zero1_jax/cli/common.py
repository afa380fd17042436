"""Pieces the command-line tools share: starting JAX with the right device
count, the data mesh, the seed's memory log, progress, outputs, errors."""

from __future__ import annotations

import importlib
import json
import math
import os
import logging
import sys
import warnings
from typing import Callable

_GiB = 1024 ** 3


def gib(nbytes: float) -> str:
  """``1.5 GiB`` (binary units, as the memory lines print them)."""
  return f"{nbytes / _GiB:.3g} GiB"


class Interrupted(Exception):
  """Ctrl-C during training; the message says where the run stands."""


class UsageError(ValueError):
  """Bad command-line input; reported in one line, exit code 2."""


def overlap_flags(config_path: str) -> None:
  """DeepSpeed's ``overlap_comm: true`` -> XLA's latency-hiding scheduler
  (GPU), set before the backend starts. A bad file is reported later by
  load_config, with its own message."""
  try:
    from zero1_jax.deepspeed.config import parse_text
    with open(config_path, encoding="utf-8") as f:
      zero = parse_text(f.read(), config_path).get("zero_optimization", {})
  except (OSError, ValueError, AttributeError):
    return
  if isinstance(zero, dict) and zero.get("overlap_comm") is True:
    flag = "--xla_gpu_enable_latency_hiding_scheduler=true"
    flags = os.environ.get("XLA_FLAGS", "")
    if "latency_hiding_scheduler" not in flags:
      os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def start_jax(num_devices: int | None):
  """Returns jax with ``num_devices`` simulated CPU devices when the CPU is
  the platform (set before the backend starts); GPU hosts use real ones."""
  if num_devices is not None and num_devices < 1:
    raise UsageError(f"--num_devices must be >= 1, got {num_devices}")
  # Everything heavy, now: run under interrupt.held() (a Ctrl-C inside an
  # extension's initialisation, jaxlib's or tensorstore's, can crash the
  # interpreter: seen SIGSEGV and SIGABRT), nothing loads later.
  import jax
  for name in ("flax.linen", "optax", "orbax.checkpoint"):
    importlib.import_module(name)
  if num_devices:
    try:
      jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:
      pass  # backend already started (e.g. in-process tests): data_mesh checks
  return jax


def data_mesh(jax, num_devices: int | None, axis: str = "data"):
  devices = jax.devices()
  n = num_devices or len(devices)
  if n > len(devices):
    raise UsageError(
        f"--num_devices {n} but only {len(devices)} {jax.default_backend()} "
        f"device(s) are available. Use --num_devices {len(devices)} or fewer.")
  return jax.make_mesh((n,), (axis,), devices=devices[:n])


def log_memory(engine, estimate=None) -> dict:
  """DeepSpeed's per-rank optimizer-memory lines (deepspeed/memory_log.py),
  printed by each process for the ranks it holds. ``estimate``: the
  ``(MemoryEstimate, capacity, source)`` of cli/memory.py, printed beside."""
  import jax

  from zero1_jax.deepspeed import memory_log

  def estimate_line(r: int, unit: str) -> list[str]:
    if estimate is None:
      return []
    est, cap, _ = estimate
    return [f"[Rank {r}] Estimate: step needs ~{gib(est.per_device)} per {unit} "
            f"(params {gib(est.params)}, grads {gib(est.grads)}, optimizer "
            f"state {gib(est.state)}, activations {gib(est.activations)}) of "
            f"{gib(cap)}"]

  mem = memory_log.memory_lines(engine, extra=estimate_line)
  for line in mem.lines:
    print(line, flush=True)
  return {"replicated_bytes": mem.replicated, "ranks": list(mem.per_rank),
          "zero1_bytes_per_rank": list(mem.per_rank.values()),
          "num_devices": engine.mesh.shape[engine.axis_name],
          "stage": mem.stage,
          # fp32 params are their own master: the state holds no copy
          "fp32_params": all(x.dtype == jax.numpy.float32
                             for x in jax.tree.leaves(engine.params)
                             if jax.numpy.issubdtype(x.dtype, jax.numpy.floating))}


class _NoBar:
  """Stands in for tqdm when it is disabled or not installed."""

  def update(self, n: int = 1) -> None:
    del n

  def set_postfix(self, **kw) -> None:
    del kw

  def close(self) -> None:
    pass


def has_progress_bar() -> bool:
  """tqdm is an optional dependency (``pip install zero1_jax[cli]``)."""
  try:
    import tqdm  # noqa: F401
  except ImportError:
    return False
  return True


def step_lines(no_progress: bool, tty: bool | None = None) -> bool:
  """Whether zero1-train prints a line every logging period (else the bar
  alone, unless a period is asked for): with --no_progress, without tqdm,
  and when stdout is not a terminal (``> train.log``), where no bar is
  read; tqdm's bar, on stderr, stays. ``tty``: stdout's, by default."""
  if tty is None:
    tty = sys.stdout.isatty()
  return no_progress or not has_progress_bar() or not tty


def progress(total: int, initial: int = 0, disable: bool = False):
  if disable or not has_progress_bar():
    return _NoBar()
  from tqdm.auto import tqdm
  return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def read_history(out_dir: str, upto_step: int) -> list[dict]:
  """Metric rows already written for steps <= upto_step (a resumed run);
  the file is rewritten without rows a crashed run wrote past that step."""
  path = os.path.join(out_dir, "metrics.jsonl")
  rows = []
  if upto_step and os.path.exists(path):
    with open(path) as f:
      for line in filter(str.strip, f):
        try:
          row = json.loads(line)
        except json.JSONDecodeError:   # a line cut short by a kill -9
          continue
        if row["step"] <= upto_step:
          rows.append(row)
  if os.path.isdir(out_dir):
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  return rows


def append_metrics(out_dir: str, row: dict) -> None:
  with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
    f.write(json.dumps(row) + "\n")


def run_record(args, engine) -> dict:
  """What ran, for summary.json: model, sizes, precision, devices, steps."""
  cfg = engine.config
  return {"model": args.model_name_or_path, "seq_len": args.seq_len,
          "dtype": ("fp16" if cfg.fp16.enabled else
                    "bf16" if cfg.bf16.enabled else "fp32"),
          "zero_stage": cfg.zero.stage,
          "num_devices": engine.mesh.shape[engine.axis_name],
          "num_processes": args.num_processes or 1,
          "train_batch_size": cfg.train_batch_size,
          "train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
          "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
          "max_steps": args.max_steps}


def write_outputs(out_dir: str, history: list[dict], mem: dict, engine,
                  wall: float, *, run: dict | None = None,
                  resumed_from: int | None = None) -> dict:
  """Plots and summary.json. ``steps``, ``skipped_steps`` and the losses are
  the whole run's (resumes included, as metrics.jsonl); ``wall_s`` is this
  invocation's training time, for its ``steps_this_run`` steps."""
  try:
    from zero1_jax.cli import plots
  except ImportError:
    print("[zero1-train] matplotlib is not installed: no plots written "
          "(pip install 'zero1_jax[cli]')", flush=True)
  else:
    plots.loss_curve(history, os.path.join(out_dir, "loss_curve.png"))
    plots.memory_bars(mem, os.path.join(out_dir, "memory.png"))
  losses = [h["loss"] for h in history
            if not h["skipped"] and h["loss"] is not None]
  k = max(1, len(losses) // 10)
  mean = lambda xs: sum(xs) / len(xs) if xs else None   # None: no step taken
  start = resumed_from or 0
  summary = {"steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
             "first_loss": mean(losses[:k]), "last_loss": mean(losses[-k:]),
             "resumed_from": resumed_from,
             "steps_this_run": engine.global_steps - start, "wall_s": wall,
             "run": run or {},
             "segments": _segments(out_dir, start, run or {}),
             "memory": mem}
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2, allow_nan=False)
  return summary


SEGMENTS = "segments.json"


def earlier_segments(out_dir: str, start: int) -> list[dict]:
  """The stretches of the run before step ``start`` (a resume), each
  ``{"from_step": s, **run}``: from segments.json, which each invocation
  writes as it starts (so a run stopped by Ctrl-C or ``kill -9`` keeps its
  stretch), else from an older run's summary.json. Stretches from
  ``start`` on were abandoned."""
  if not start:
    return []
  before = []
  for name in (SEGMENTS, "summary.json"):
    try:
      with open(os.path.join(out_dir, name)) as f:
        old = json.load(f)
      before = (old if isinstance(old, list) else old.get("segments")
                or [{"from_step": 0, **old.get("run", {})}])
      break
    except (OSError, ValueError, AttributeError):
      continue
  return [g for g in before if g.get("from_step", 0) < start]


def _segments(out_dir: str, start: int, run: dict) -> list[dict]:
  """Each stretch of the run with its settings: the earlier ones, then this
  invocation's from ``start``."""
  return earlier_segments(out_dir, start) + [{"from_step": start, **run}]


def start_segment(out_dir: str, start: int, run: dict) -> None:
  """Records this invocation's stretch in segments.json as it starts
  training from step ``start``."""
  segments = _segments(out_dir, start, run)
  with open(os.path.join(out_dir, SEGMENTS), "w") as f:
    json.dump(segments, f, indent=2, allow_nan=False)


def finite(x) -> float | None:
  """``float(x)``, or None for NaN/inf (JSON has no NaN)."""
  x = float(x)
  return x if math.isfinite(x) else None


def loss_text(summary: dict) -> str:
  """``loss 5.61 -> 3.02 (...)``, or why there is none."""
  if summary["first_loss"] is None:
    return (f"no loss: all {summary['skipped_steps']} steps were skipped "
            f"(fp16 loss-scale warm-up; run more steps)")
  return (f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} "
          f"(means of the first and last 10% of the steps taken)")


class _StderrHandler(logging.StreamHandler):
  """Writes to whatever ``sys.stderr`` is when a line is emitted, not the
  stream of the first call (a caller that swaps or closes stderr, as pytest's
  capture does between tests, would otherwise get 'I/O operation on closed
  file' logging errors from a later run in the same process)."""

  @property
  def stream(self):
    return sys.stderr

  @stream.setter
  def stream(self, _):
    pass


def setup_logging() -> None:
  """INFO lines from zero1_jax (config notes), warnings from everything.
  INFO lines are held back until :func:`release_notes` (once every check
  passed), so an error is never preceded by notes about a run that will not
  start."""
  import logging.handlers
  log = logging.getLogger("zero1_jax")
  for h in list(log.handlers):
    if getattr(h, "_zero1", False):
      log.removeHandler(h)
  out = _StderrHandler()
  out.setFormatter(logging.Formatter("[zero1_jax] %(message)s"))
  held = logging.handlers.MemoryHandler(10_000, logging.WARNING, out,
                                        flushOnClose=False)
  held._zero1 = True
  log.addHandler(held)
  log.setLevel(logging.INFO)
  log.propagate = False
  _one_line_own_warnings()


_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_line_own_warnings() -> None:
  """zero1_jax's own warnings (a DeepSpeed key not honoured, a Python that
  saves synchronously) say everything in their message: print them as one
  ``[zero1_jax] warning: ...`` line, not Python's two lines with this
  package's file, line and source. Other packages' warnings keep Python's
  format (their location is the useful part)."""
  if getattr(warnings.showwarning, "_zero1", False):
    return
  default = warnings.showwarning

  def show(message, category, filename, lineno, file=None, line=None):
    # a category of zero1_jax's (NotHonouredWarning: attributed to the
    # caller's line), or raised in zero1_jax; no import here, which would
    # load jax before the command's own Ctrl-C handling
    if (category.__module__.startswith("zero1_jax.")
        or os.path.abspath(filename).startswith(_PKG_DIR + os.sep)):
      print(f"[zero1_jax] warning: {message}", file=file or sys.stderr, flush=True)
    else:
      default(message, category, filename, lineno, file, line)

  show._zero1 = True
  warnings.showwarning = show


def drop_notes() -> None:
  """Forgets the held INFO lines (the run stopped with an error)."""
  for h in logging.getLogger("zero1_jax").handlers:
    if getattr(h, "_zero1", False):
      h.buffer.clear()


def release_notes() -> None:
  """Prints the held INFO lines; later ones print at once."""
  for h in logging.getLogger("zero1_jax").handlers:
    if getattr(h, "_zero1", False) and h.target is not None:
      h.flush()
      h.capacity = 0


def guarded(fn: Callable, args, prog: str) -> int:
  """Runs ``fn(args)``; bad input becomes one line on stderr and exit 2,
  Ctrl-C one line and exit 130 (the shell's code for SIGINT)."""
  try:
    fn(args)
  except Interrupted as e:
    if str(e):            # the main process speaks for the job
      print(f"{prog}: {e}", file=sys.stderr)
    return 130
  except KeyboardInterrupt:
    drop_notes()
    print(f"{prog}: interrupted", file=sys.stderr)
    return 130
  except (UsageError, ValueError, OSError) as e:   # ConfigError is a ValueError
    drop_notes()
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 2
  except RuntimeError as e:
    drop_notes()
    print(f"{prog}: error: {e}", file=sys.stderr)
    return 1
  return 0
