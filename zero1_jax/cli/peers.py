"""A dead process ends a multi-process zero1-train job in seconds.

When a peer dies (kill -9, OOM killer, a lost node), a survivor's next
collective fails at once, and a normal exit would then wait in
``jax.distributed.shutdown`` for the dead peer until the heartbeat timeout
and abort with a C++ stack trace. Instead the survivor prints one line, the
process that died, the last committed checkpoint and the command that
resumes, and leaves with ``os._exit(1)``. A survivor blocked where no error
comes (an orbax save waiting for every process) is ended the same way by
the watch thread of :class:`zero1_jax.distributed.PeerWatch`.

Example::

  watch = peers.start()            # after joining
  try:
    train()
  except Exception as e:
    peers.after_error(e, output_dir)   # exits if a peer is gone
    raise
  finally:
    peers.stop()
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading

from zero1_jax import distributed

_WATCH: distributed.PeerWatch | None = None
_ONCE = threading.Lock()
EXIT_CODE = 1


def start(output_dir: str) -> distributed.PeerWatch | None:
  """Watches the job's other processes (none in a one-process run)."""
  global _WATCH
  stop()
  _WATCH = distributed.PeerWatch.start()
  if _WATCH is not None:
    _WATCH.on_dead = lambda ranks: _exit(ranks, None, output_dir)
    _on_sigterm(output_dir)
  return _WATCH


def _on_sigterm(output_dir: str) -> None:
  """mpirun ends the other ranks with SIGTERM as soon as one dies, often
  before a survivor's next collective fails, so the survivor's line was
  lost (seen in 1 of 3 runs of the slow suite). The C-level handler writes
  the signal to a wakeup pipe at once, whatever the main thread is doing (a
  Python handler waits for it); a thread reading the pipe says the line
  when a peer is gone (or goes within 0.5 s), else exits as SIGTERM does
  (status 143). Only where SIGTERM has its default action, from the main
  thread."""
  if (threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
    return
  r, w = os.pipe()
  os.set_blocking(w, False)
  try:
    signal.set_wakeup_fd(w)
  except ValueError:
    return
  signal.signal(signal.SIGTERM, lambda signum, frame: None)   # the thread acts

  def read():
    while True:
      got = os.read(r, 512)
      if signal.SIGTERM not in got:    # other signals (SIGINT) are the main thread's
        continue
      watch = _WATCH
      # a peer dying (its sockets closed, not yet gone) has until mpirun's
      # SIGKILL, 1 s later (Open MPI's odls_base_sigkill_timeout)
      dead = watch.dead(wait_s=0.5) if watch is not None else []
      if dead:
        _exit(dead, None, output_dir)
      if _ONCE.locked():
        # Another thread is saying the line (the main thread's collective
        # failed first) and leaves with status 1 in a moment: leaving now
        # with 143 would beat it (seen once in the slow suite).
        threading.Event().wait(10)
      try:
        sys.stdout.flush()
        sys.stderr.flush()
      except Exception:  # noqa: BLE001 - leaving regardless
        pass
      os._exit(128 + signal.SIGTERM)

  threading.Thread(target=read, daemon=True, name="zero1-sigterm").start()


def stop() -> None:
  global _WATCH
  if _WATCH is not None:
    _WATCH.stop()
  _WATCH = None


def after_error(err: BaseException, output_dir: str,
                wait_s: float = 8.0) -> None:
  """If a peer is gone (waiting up to ``wait_s`` for it to show), says so
  and exits; otherwise returns (the error is this process's own)."""
  watch = _WATCH
  if watch is None:
    return
  dead = watch.dead(wait_s=wait_s)
  if dead:
    _exit(dead, err, output_dir)


def watched(run, args):
  """``run(args)``; an error after a peer died becomes the one line and an
  exit at once; the watch ends with it."""
  from zero1_jax.cli import common
  try:
    return run(args)
  except (KeyboardInterrupt, common.UsageError, common.Interrupted):
    raise
  except Exception as e:
    after_error(e, args.output_dir)
    raise
  finally:
    stop()


def resume_command(argv: list[str] | None = None) -> str:
  """This run's command line with ``--resume latest``, after the launcher
  that started it (``srun -n N`` / ``mpirun -np N`` when theirs)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    if a in ("--resume", "--process_id"):
      skip = True
      continue
    if a.startswith(("--resume=", "--process_id=")) or a == "--overwrite_output_dir":
      continue
    out.append(a)
  prefix = ""
  n = os.environ.get("OMPI_COMM_WORLD_SIZE")
  if n:
    prefix = f"mpirun -np {n} "
  elif os.environ.get("SLURM_STEP_ID") is not None and os.environ.get("SLURM_NTASKS"):
    prefix = f"srun -n {os.environ['SLURM_NTASKS']} "
  return prefix + shlex.join(["zero1-train", *out, "--resume", "latest"])


def job_coordinates(args) -> tuple[int | None, int | None]:
  """(size, rank) of this process's job from the launcher's variables or
  the flags, before joining (None where unknown)."""
  env = os.environ
  for size, rank in (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                     ("SLURM_NTASKS", "SLURM_PROCID"), ("PMI_SIZE", "PMI_RANK")):
    if env.get(size, "").isdigit() and env.get(rank, "").isdigit():
      return int(env[size]), int(env[rank])
  return args.num_processes, args.process_id


def message(ranks: list[int], err: BaseException | None, output_dir: str,
            count: int, me: int) -> str:
  """The one line a survivor prints."""
  who = (f"process {ranks[0]}" if len(ranks) == 1 else
         f"processes {', '.join(map(str, ranks))}")
  how = "" if err is None else f" ({_first_line(err)})"
  ckpt = os.path.join(output_dir, "checkpoints")
  try:
    from zero1_jax.checkpoint import steps
    last = steps.latest_step(ckpt)
  except Exception:  # noqa: BLE001 - the line is said regardless
    last = None
  saved = (f"the last committed checkpoint is step {last} in {ckpt}"
           if last is not None else "no checkpoint was committed yet")
  if not ranks:
    who = "another process"
  return (f"zero1-train: error: {who} of {count} died; process {me} stops"
          f"{how}; {saved}; resume with: {resume_command()}")


def _first_line(err: BaseException) -> str:
  text = str(err).strip().splitlines()
  line = text[0] if text else type(err).__name__
  return line if len(line) <= 200 else line[:197] + "..."


def _exit(ranks: list[int], err: BaseException | None, output_dir: str) -> None:
  """Prints the line once and leaves without the runtime's shutdown wait."""
  if not _ONCE.acquire(blocking=False):
    return
  import jax
  try:
    line = message(ranks, err, output_dir, jax.process_count(),
                   jax.process_index())
  except Exception:  # noqa: BLE001
    line = f"zero1-train: error: process {ranks[0]} died"
  try:
    sys.stdout.flush()
  except Exception:  # noqa: BLE001
    pass
  print(line, file=sys.stderr, flush=True)
  logging.shutdown()
  os._exit(EXIT_CODE)
