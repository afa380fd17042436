"""A Ctrl-C that stops every process of a job after the same step.

Each process of a multi-process job reads its own SIGINT at its own moment.
Stopping where each one read it leaves a process that was a step ahead
blocked in a collective the others never join (seen under load: the job
then had to be killed, and process 0's line naming the checkpoint to resume
was never printed). So in a multi-process run the first Ctrl-C only asks to
stop; the processes agree, through the job's key-value store (process 0's
coordination service, as :class:`zero1_jax.distributed.PeerWatch`), on the
step after which they all stop. A second Ctrl-C stops this process at once.

Why every process reaches the same decision. Call "boundary b" the top of
the step loop after step b completed on this process. A process asked to
stop publishes ``b + 1`` at boundary b, before it starts step b + 1; at
every boundary each process stops iff some published value is ``<= b``.
Step v needs every process's part of its collectives, so a process that
completed step v (is at boundary ``>= v``) runs after the publication of
any value ``v`` (made before its publisher started step v). At boundary b
every value ``<= b`` is therefore visible to every process, and values
above b do not decide anything there: all processes stop at the smallest
published value. It costs one read of the store per step (one RPC to
process 0: 0.18 ms on localhost, measured; a step waits on its
collectives longer).

Example:
  >>> step = 0
  >>> with AgreedStop.start() as stop:   # one process here: it stops at once
  ...   while step < 3:
  ...     stop.check(step)     # KeyboardInterrupt: where every process stops
  ...     step += 1            # one training step
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from zero1_jax.cli import interrupt

PREFIX = "zero1_jax/stop"


class AgreedStop:
  """The step loop's Ctrl-C (one process: :func:`interrupt.check`)."""

  def __init__(self, client=None, rank: int = 0, count: int = 1,
               say: bool = True):
    self.client, self.rank, self.count, self.say = client, rank, count, say
    self.asked = False        # a first Ctrl-C reached this process
    self.published = False    # ... and its stop step is in the store
    self._old = None

  @classmethod
  def start(cls, say: bool = True) -> "AgreedStop":
    """For this job: agreeing when it has more than one process (``say``:
    this process prints the Ctrl-C's one line)."""
    jax = sys.modules.get("jax")
    if jax is None or jax.process_count() == 1:
      return cls()
    from jax._src import distributed as jax_distributed
    client = jax_distributed.global_state.client
    if client is None:
      return cls()
    return cls(client, jax.process_index(), jax.process_count(), say)

  def __enter__(self) -> "AgreedStop":
    if (self.client is not None
        and threading.current_thread() is threading.main_thread()):
      old = signal.getsignal(signal.SIGINT)
      if callable(old):          # the default, or interrupt.remembered's
        self._old = old
        signal.signal(signal.SIGINT, self._on_sigint)
    return self

  def __exit__(self, *exc) -> None:
    if self._old is not None:
      signal.signal(signal.SIGINT, self._old)
      self._old = None

  def _on_sigint(self, signum, frame) -> None:
    if self.asked:           # the second: at once, as a lone process stops
      self._old(signum, frame)
      raise KeyboardInterrupt
    self.asked = True
    if self.say:
      print(f"[zero1-train] Ctrl-C: stopping all {self.count} processes "
            f"after the same step (Ctrl-C again to stop at once)",
            file=sys.stderr, flush=True)

  def check(self, step: int) -> None:
    """At the top of the step loop, ``step`` steps done: raises
    KeyboardInterrupt where every process stops."""
    interrupt.check()
    if self.client is None:
      return
    if self.asked and not self.published:
      self.client.key_value_set(f"{PREFIX}/{self.rank}", str(step + 1))
      self.published = True
    values = [int(v) for _, v in self.client.key_value_dir_get(f"{PREFIX}/")]
    if values and min(values) <= step:
      raise KeyboardInterrupt


def multi_process() -> bool:
  """Whether this process is one of a multi-process job (jax loaded)."""
  jax = sys.modules.get("jax")
  return jax is not None and jax.process_count() > 1


def leave_after_interrupt() -> None:
  """After a Ctrl-C that stopped this process at once (the second, or one
  before the step loop), another process may be blocked in a step this one
  never joins, so leaving the runtime together (what exit does, for up to
  five minutes) may never happen. Leave without it; the launcher, or the
  runtime's heartbeat, stops the blocked one."""
  from zero1_jax import distributed
  from zero1_jax.cli import launch
  if not distributed.leave(timeout_s=15.0):
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    launcher = os.environ.get(launch.LAUNCHER_PID)
    if launcher:   # it stops every process at once, this one included
      try:
        os.kill(int(launcher), signal.SIGUSR1)
        time.sleep(10)
      except (OSError, ValueError):
        pass
    os._exit(130)
