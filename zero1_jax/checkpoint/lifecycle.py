"""Where a checkpoint path enters the API, and what happens at interpreter exit.

orbax needs absolute paths, and writes asynchronous saves from background
threads that need ``concurrent.futures`` executors; at interpreter exit those
executors stop taking work before ``atexit`` handlers run, so a save still in
flight then is lost. :func:`finish_at_exit` runs its callbacks before that.
On CPython 3.12.0 to 3.12.2 no thread can start once shutdown has begun, so
there :func:`async_save_allowed` turns asynchronous saves off. A failed
concurrent read leaves asyncio noise behind: :func:`quiet_failed_reads`
drops it.

Example:
  >>> import os
  >>> str(absolute("ckpt")) == os.path.join(os.getcwd(), "ckpt")
  True
  >>> str(absolute("gs://bucket/run"))
  'gs://bucket/run'
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import warnings
import weakref
from typing import Callable

from etils import epath

from zero1_jax.core import placement

_CALLBACKS: list[Callable[[], None]] = []
_REGISTERED = False
# CPython 3.12.0 to 3.12.2 refuse to start a thread as soon as interpreter
# shutdown begins, before any exit hook runs (python/cpython#113964, fixed in
# 3.12.3). orbax's background save starts threads as it goes, so there a save
# still in flight at exit fails ("can't create new thread at interpreter
# shutdown") and the step is lost.
def works_at_exit() -> bool:
  """Whether this Python can finish an asynchronous save at exit."""
  return not (3, 12, 0) <= tuple(sys.version_info[:3]) < (3, 12, 3)


SAVE_AT_EXIT_WORKS = works_at_exit()
_WARNED = False


def absolute(directory: str | os.PathLike) -> epath.Path:
  """``directory`` resolved once against the current directory (``~``
  expanded); URLs (``gs://...``) are left as they are."""
  text = os.fspath(directory)
  if "://" in text:
    return epath.Path(text)
  return epath.Path(os.path.abspath(os.path.expanduser(text)))


def _run_all() -> None:
  failed = False
  for cb in list(_CALLBACKS):
    try:
      cb()
    except Exception as e:  # pylint: disable=broad-except
      msg = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
      print(f"zero1 checkpoint: error at exit: {msg}", file=sys.stderr,
            flush=True)
      failed = True
  _CALLBACKS.clear()
  if failed:   # a lost checkpoint is not a successful run
    sys.stdout.flush()
    os._exit(1)  # pylint: disable=protected-access


def finish_at_exit(obj, method: str) -> None:
  """Calls ``obj.<method>()`` at a normal interpreter exit (while ``obj`` is
  alive), before ``concurrent.futures`` stops its thread pools. If it raises,
  one line goes to stderr and the process exits with status 1."""
  global _REGISTERED
  ref = weakref.ref(obj)

  def cb():
    o = ref()
    if o is not None:
      getattr(o, method)()

  _CALLBACKS.append(cb)
  if not _REGISTERED:
    _REGISTERED = True
    # threading's exit hooks run (last registered first) before atexit's and
    # before the thread pools concurrent.futures registered earlier shut down.
    reg = getattr(threading, "_register_atexit", None)
    try:
      reg(_run_all) if reg else atexit.register(_run_all)
    except RuntimeError:   # already shutting down
      atexit.register(_run_all)


def async_save_allowed(requested: bool) -> bool:
  """``requested``, unless this Python cannot finish a save at exit
  (:data:`SAVE_AT_EXIT_WORKS`): then False, so each save is written before
  it returns, and a warning says so once per process."""
  global _WARNED
  if not requested or SAVE_AT_EXIT_WORKS:
    return requested
  if not _WARNED:
    _WARNED = True
    v = ".".join(map(str, sys.version_info[:3]))
    warnings.warn(
        f"zero1 checkpoint: Python {v} cannot start threads at interpreter "
        f"exit (CPython issue 113964, fixed in 3.12.3), so a save still "
        f"writing then would be lost; checkpoints are saved synchronously "
        f"on this Python. Use Python 3.12.3 or later for asynchronous saves.",
        RuntimeWarning, stacklevel=placement.user_stacklevel())
  return False


def _noise(r: logging.LogRecord) -> bool:
  m = r.getMessage()
  return (m.startswith(("Task exception was never retrieved",
                        "Future exception was never retrieved"))
          and ("orbax" in m or "tensorstore_spec" in m))


def quiet_failed_reads() -> None:
  """When one of orbax's concurrent reads fails, the others finish after its
  event loop closed and print 'Event loop is closed' / 'Task exception was
  never retrieved' tracebacks. The error itself is already raised with a clear
  message; drop that noise (only it) from then on."""
  if not getattr(sys.unraisablehook, "_zero1", False):
    prev = sys.unraisablehook

    def hook(u):
      if not (isinstance(u.exc_value, RuntimeError)
              and str(u.exc_value) == "Event loop is closed"):
        prev(u)

    hook._zero1 = True
    sys.unraisablehook = hook
  aio = logging.getLogger("asyncio")
  if _noise not in [getattr(f, "__wrapped__", None) for f in aio.filters]:
    f = lambda r: not _noise(r)
    f.__wrapped__ = _noise
    aio.addFilter(f)
