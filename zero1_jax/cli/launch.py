"""Local multi-process launcher: ``zero1-train --num_processes 2 --num_devices 2``
spawns 2 processes with 2 CPU devices each on 127.0.0.1, like
``deepspeed --num_gpus``. If any process fails, the others are stopped and
the launcher exits non-zero with one line saying which one. Ctrl-C stops
every process after the same step (:mod:`zero1_jax.cli.agreed_stop`; exit
130). The processes' stdout
passes through the launcher, whole lines at a time, less gloo's connection
lines."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

# Set in each process's environment: a process that stopped after a Ctrl-C
# while another is blocked in a step it will never join sends SIGUSR1 here,
# and the launcher ends every process at once (the blocked one cannot stop
# itself; left to fail when its peer goes, it prints pages of C++ errors).
LAUNCHER_PID = "ZERO1_LAUNCHER_PID"


class _Blocked(Exception):
  """SIGUSR1 from a process: another one is blocked in a step."""


def _blocked(signum, frame):
  del signum, frame
  raise _Blocked


# gloo (jax's CPU collectives) prints to stdout, per device and communicator,
# "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected
# peer ranks is : 3": 2 x 2 devices printed 7 such lines in the first step.
# Two devices of a process print at once, one piece at a time, so the pieces
# of two messages interleave and a message's numbers or newline can land on
# the next line: the fixed pieces are removed wherever they are, and a line
# left with nothing but the messages' numbers is dropped.
_GLOO = re.compile(rb"\[Gloo\] Rank | is connected to | peer ranks\. |"
                   rb"Expected number of connected peer ranks is : ")
_START = b"[Gloo] Rank "


def relay(pipe, out) -> None:
  """Copies ``pipe`` to ``out`` (a binary stream) line by line until EOF,
  less gloo's connection messages (:data:`_GLOO`)."""
  owed = 0     # gloo messages whose newline has not been seen yet
  for line in iter(pipe.readline, b""):
    owed += line.count(_START)
    kept, n = _GLOO.subn(b"", line)
    rest = kept.strip()
    if (n or owed > 0) and (not rest or rest.isdigit()):
      owed = max(0, owed - 1)     # this line held a message's newline
      continue
    out.write(kept)
    out.flush()
  pipe.close()


def _relays(procs: list[subprocess.Popen]) -> list[threading.Thread]:
  out = getattr(sys.stdout, "buffer", None)
  if out is None:   # a text-only stdout (a test's capture)
    out = _TextOut(sys.stdout)
  threads = [threading.Thread(target=relay, args=(p.stdout, out), daemon=True)
             for p in procs]
  for t in threads:
    t.start()
  return threads


class _TextOut:
  def __init__(self, stream):
    self.stream = stream

  def write(self, b: bytes) -> None:
    self.stream.write(b.decode(errors="replace"))

  def flush(self) -> None:
    self.stream.flush()


# JAX's runtime ends a process whose coordination service failed (process 0
# died, or a peer's heartbeats stopped) from C++: an absl FATAL line, the
# error, "*** Check failure stack trace: ***" and frames, then abort(); no
# Python code runs after it. The guard (guard_output) reads this process's
# stderr in a forked helper, drops that block and the runtime's warnings
# before it, and prints one line in its place.
_ABSL = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d")
_DEAD_LINE = b"zero1-train: error: "
_OURS = (b"[zero1", b"zero1-train", b"zero1_jax", b"[Rank ", b"step ")


def dead_ranks(fatal: bytes) -> list[int]:
  r"""The processes a coordination-service FATAL names: process 0 when the
  service (which runs in it) is unreachable, else the tasks listed as
  unhealthy; [] when it names none.

  >>> dead_ranks(b"The following tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks")
  [1]
  >>> dead_ranks(b"Either the leader task was preempted/died/restarted unexpectedly")
  [0]
  """
  text = fatal.decode(errors="replace")
  m = re.search(r"unhealthy[^:]*:\s*\n((?:.*\d.*\n)+?)\s*The tasks", text + "\n")
  if m:
    return sorted({int(x) for x in re.findall(r"(?:task:)?(\d+)(?=\s*(?:,|$))",
                                              m.group(1), re.M)})
  if re.search(r"leader task|Failed to send RPC to coordination service|"
               r"Socket closed|Connection refused", text):
    return [0]
  return []


def filter_stderr(pipe, out, on_fatal) -> None:
  """Copies ``pipe`` to ``out`` less the runtime's fatal block (and the
  warnings just before it, held back until a line of ours or EOF shows
  none follows); at EOF after a fatal block, writes ``on_fatal(ranks)``,
  unless the process said its own line of a dead peer before the block
  (its collective failed, it printed the line, and the runtime's own
  error thread aborted before its ``os._exit``: two lines were seen once in
  the slow suite)."""
  held: list[bytes] = []
  fatal: list[bytes] | None = None
  said = False
  for line in iter(pipe.readline, b""):
    if fatal is not None:
      fatal.append(line)
      continue
    if line.startswith(_DEAD_LINE) and b" died" in line:
      said = True
    if _ABSL.match(line) and line[:1] == b"F":
      fatal = [line]
      held = []
      continue
    if (_ABSL.match(line) and line[:1] in (b"W", b"E")) or (
        held and not line.startswith(_OURS) and len(held) < 200):
      held.append(line)       # warnings and their continuation lines
      continue
    out.write(b"".join(held) + line)
    held = []
    out.flush()
  out.write(b"".join(held))
  if fatal is not None and not said:
    try:
      text = on_fatal(dead_ranks(b"".join(fatal)))
    except Exception as e:  # noqa: BLE001 - the line is said regardless
      text = f"zero1-train: error: the JAX distributed service failed ({e})"
    out.write(text.encode() + b"\n")
  out.flush()


def guard_output(on_fatal) -> bool:
  """Under a launcher that is not zero1-train's (mpirun, srun): this
  process's stdout and stderr (file descriptors 1 and 2, C++ writes
  included) go through a forked helper process that drops gloo's
  connection lines (:func:`relay`) and the runtime's fatal C++ block
  (:func:`filter_stderr`, which prints ``on_fatal(ranks)`` instead) and ends
  when this process does. Call before anything starts threads. Returns
  False where it cannot (no fork)."""
  if not hasattr(os, "fork"):
    return False
  sys.stdout.flush()
  sys.stderr.flush()
  pipes = [os.pipe(), os.pipe()]
  pid = os.fork()
  if pid == 0:      # the helper: reads until every writer is gone
    try:
      signal.signal(signal.SIGINT, signal.SIG_IGN)    # the job's, not ours
      signal.signal(signal.SIGTERM, signal.SIG_IGN)   # EOF ends it
      for r, w in pipes:
        os.close(w)
      outs = [os.fdopen(os.dup(fd), "wb", buffering=0) for fd in (1, 2)]
      t = threading.Thread(target=relay, args=(os.fdopen(pipes[0][0], "rb"),
                                               outs[0]), daemon=True)
      t.start()
      filter_stderr(os.fdopen(pipes[1][0], "rb"), outs[1], on_fatal)
      t.join(5.0)
    finally:
      os._exit(0)
  for (r, w), fd in zip(pipes, (1, 2)):
    os.close(r)
    os.dup2(w, fd)
    os.close(w)
  return True


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
  """SIGTERM, then SIGKILL after ``grace`` seconds (at once if 0)."""
  for p in procs:
    if p.poll() is None:
      p.kill() if grace <= 0 else p.terminate()
  deadline = time.monotonic() + grace
  for p in procs:
    try:
      p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def launch_local(module: str, argv: list[str], num_processes: int,
                 prog: str = "zero1-train") -> int:
  """Runs ``python -m module argv --process_id i --coordinator_address ...``
  for i in range(num_processes); returns the job's exit code."""
  address = f"127.0.0.1:{free_port()}"
  env = {**os.environ, LAUNCHER_PID: str(os.getpid()),
         "ZERO1_LOCAL_PROCESSES": str(num_processes),   # share the host's RAM
         "PYTHONUNBUFFERED": "1"}   # stdout is the relay's pipe: no delay
  old = signal.signal(signal.SIGUSR1, _blocked)
  # Each in its own session: a Ctrl-C reaches the launcher alone, which hands
  # exactly one SIGINT to every process (a second one would abandon a save).
  procs = [subprocess.Popen([sys.executable, "-m", module, *argv,
                             "--process_id", str(i),
                             "--coordinator_address", address],
                            start_new_session=True, env=env,
                            stdout=subprocess.PIPE)
           for i in range(num_processes)]
  relays = _relays(procs)
  try:
    try:
      return _watch(procs, prog)
    except KeyboardInterrupt:
      return _interrupt(procs, prog)
  except _Blocked:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)   # the others may send it too
    _stop(procs, grace=0.0)
    print(f"{prog}: stopped the process(es) still blocked in a step after "
          f"the Ctrl-C", file=sys.stderr)
    return 130
  finally:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    _stop(procs)
    for t in relays:   # every line printed before the exit
      t.join(timeout=5.0)
    signal.signal(signal.SIGUSR1, old)


def _watch(procs: list[subprocess.Popen], prog: str,
           straggle_s: float = 30.0) -> int:
  """Polls until all succeed (0) or one fails (1, the others stopped)."""
  while True:
    codes = [p.poll() for p in procs]
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      i, c = failed[0]
      if c in (130, -signal.SIGINT):   # a Ctrl-C sent to that process alone
        # The others stop after the same step (agreed_stop) and process 0
        # says where the run stands: a kill now would lose its line.
        if _wait_all(procs, straggle_s):
          return 130
        _stop(procs)
        print(f"{prog}: process {i} was interrupted; stopped the other "
              f"{len(procs) - 1} process(es).", file=sys.stderr)
        return 130
      _stop(procs)
      print(f"{prog}: error: process {i} exited with code {c}; stopped the "
            f"other {len(procs) - 1} process(es).", file=sys.stderr)
      return 1
    if all(c == 0 for c in codes):
      return 0
    time.sleep(0.2)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> bool:
  """True when every process ended within ``timeout_s``."""
  deadline = time.monotonic() + timeout_s
  while any(p.poll() is None for p in procs):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.2)
  return True


def _interrupt(procs: list[subprocess.Popen], prog: str,
               straggle_s: float = 30.0) -> int:
  """Ctrl-C: every process stops after the same step (a save in flight
  commits; process 0 says where the run stands); a second Ctrl-C stops them
  at once."""
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGINT)
  try:
    first_done = None
    while any(p.poll() is None for p in procs):
      if first_done is None and any(p.poll() is not None for p in procs):
        first_done = time.monotonic()
      # One process stopped a step earlier than another, which now waits in
      # a collective that will never complete: the launcher stops it.
      if first_done is not None and time.monotonic() - first_done > straggle_s:
        print(f"{prog}: a process still ran {straggle_s:.0f} s after another "
              f"stopped: stopping it", file=sys.stderr)
        break
      time.sleep(0.2)
  except KeyboardInterrupt:
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGINT)   # the second: abandon the save
    print(f"{prog}: interrupted again: stopping every process", file=sys.stderr)
  return 130
