"""Ctrl-C around checkpoint saves: never inside orbax.

A KeyboardInterrupt raised inside orbax's save or wait leaves its manager
believing the step is gone while its writer threads go on (and orbax logs a
traceback). So while ``zero1-train`` is inside a save, the first Ctrl-C is
held until the save call returns and then raised as usual; a second one
abandons the save and exits at once (the step's temporary directory is
removed by the next run). Outside the main thread, or where SIGINT is
ignored, nothing changes.

Example:
  >>> with deferred_sigint():
  ...   pass    # a Ctrl-C in here is raised when the block ends
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
from typing import Callable, Iterator

ABANDONED = 130   # the shell's exit status for SIGINT
_PENDING = threading.Event()   # a Ctrl-C not yet handled (see remembered)


@contextlib.contextmanager
def remembered() -> Iterator[None]:
  """Ctrl-C raises KeyboardInterrupt as by default, and is remembered until
  :func:`handled`: one that lands while the main thread runs a garbage-
  collector callback (jax's ``_xla_gc_callback``) is dropped there by the
  interpreter, which prints "Exception ignored in ..." and a traceback (a
  run went on to its end with exit 0): there it is only remembered, and
  :func:`check` raises it at the next step. Another handler already
  installed (or SIGINT ignored) is left alone."""
  if (threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
    yield
    return

  def record(signum, frame):
    _PENDING.set()
    if not _in_gc_callback(frame):   # there: check() raises it, no traceback
      signal.default_int_handler(signum, frame)

  signal.signal(signal.SIGINT, record)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _PENDING.clear()


def _in_gc_callback(frame) -> bool:
  """Whether ``frame`` runs inside a garbage-collector callback, where a
  raised KeyboardInterrupt is only printed ("Exception ignored in ...",
  with a traceback) and dropped."""
  codes = {getattr(cb, "__code__", None) for cb in gc.callbacks}
  while frame is not None:
    if frame.f_code in codes:
      return True
    frame = frame.f_back
  return False


def check() -> None:
  """Raises KeyboardInterrupt if a Ctrl-C was swallowed (:func:`remembered`)."""
  if _PENDING.is_set():
    raise KeyboardInterrupt


def handled() -> None:
  """The Ctrl-C reached its handler: :func:`check` forgets it."""
  _PENDING.clear()


def _main_thread_handler() -> object | None:
  """The current SIGINT handler, or None where it cannot be replaced."""
  if threading.current_thread() is not threading.main_thread():
    return None
  old = signal.getsignal(signal.SIGINT)
  return None if old in (signal.SIG_IGN, None) else old


def abandon(prog: str = "zero1-train",
            resume_hint: Callable[[], str] | None = None) -> None:
  """Exits at once with status 130 (a second Ctrl-C), saying what a resume
  continues from (``resume_hint()``) when given."""
  try:
    hint = f"; {resume_hint()}" if resume_hint else ""
  except Exception:  # pylint: disable=broad-except  # exiting regardless
    hint = ""
  print(f"{prog}: interrupted again: the checkpoint save in flight is "
        f"abandoned (its step is not committed){hint}", file=sys.stderr,
        flush=True)
  os._exit(ABANDONED)


@contextlib.contextmanager
def _holding(second: Callable[[], None], first_note: str | None
             ) -> Iterator[None]:
  """Holds a first Ctrl-C until the block ends (printing ``first_note``),
  then hands it to the handler it replaced (KeyboardInterrupt, unless that
  one only records it); a second one calls ``second()``. Outside
  the main thread, or where SIGINT is ignored, nothing changes."""
  old = _main_thread_handler()
  if old is None:
    yield
    return
  got = []

  def hold(signum, frame):
    del frame
    if got:
      second()
    got.append(signum)
    if first_note:
      print(first_note, file=sys.stderr, flush=True)

  signal.signal(signal.SIGINT, hold)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, old)
  if got:
    if not callable(old):
      raise KeyboardInterrupt
    # As if it came now: remembered()'s record and the default raise
    # KeyboardInterrupt; an agreed stop (agreed_stop) records it for the
    # step where every process stops.
    old(signal.SIGINT, None)


def held(prog: str = "zero1-train") -> contextlib.AbstractContextManager:
  """Holds a Ctrl-C until the block ends, then raises KeyboardInterrupt; a
  second one exits at once with 130 and one line."""
  def leave():
    print(f"{prog}: interrupted", file=sys.stderr, flush=True)
    os._exit(ABANDONED)
  return _holding(leave, None)


def deferred_sigint(prog: str = "zero1-train",
                    resume_hint: Callable[[], str] | None = None
                    ) -> contextlib.AbstractContextManager:
  """Holds a first Ctrl-C until the block ends, then raises it; a second
  one calls :func:`abandon`."""
  return _holding(lambda: abandon(prog, resume_hint),
                  f"[{prog}] Ctrl-C: stopping once the checkpoint save "
                  f"returns (Ctrl-C again to abandon it)")


@contextlib.contextmanager
def abandon_on_sigint(prog: str = "zero1-train",
                      resume_hint: Callable[[], str] | None = None
                      ) -> Iterator[None]:
  """While waiting for saves after a Ctrl-C: another one exits at once."""
  old = _main_thread_handler()
  if old is None:
    yield
    return
  signal.signal(signal.SIGINT,
                lambda signum, frame: abandon(prog, resume_hint))
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, old)
