"""Local multi-process launcher: ``zero1-train --num_processes 2 --num_devices 2``
spawns 2 processes with 2 CPU devices each on 127.0.0.1, like
``deepspeed --num_gpus``. If any process fails, the others are stopped and
the launcher exits non-zero with one line saying which one."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
  for p in procs:
    if p.poll() is None:
      p.terminate()
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
  procs = [subprocess.Popen([sys.executable, "-m", module, *argv,
                             "--process_id", str(i),
                             "--coordinator_address", address])
           for i in range(num_processes)]
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        i, c = failed[0]
        _stop(procs)
        print(f"{prog}: error: process {i} exited with code {c}; stopped the "
              f"other {num_processes - 1} process(es).", file=sys.stderr)
        return 1
      if all(c == 0 for c in codes):
        return 0
      time.sleep(0.2)
  finally:
    _stop(procs)
