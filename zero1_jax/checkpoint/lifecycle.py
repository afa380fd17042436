"""Where a checkpoint path enters the API, and what happens at interpreter exit.

orbax needs absolute paths, and writes asynchronous saves from background
threads that need ``concurrent.futures`` executors; at interpreter exit those
executors stop taking work before ``atexit`` handlers run, so a save still in
flight then is lost. :func:`finish_at_exit` runs its callbacks before that.

Example:
  >>> import os
  >>> str(absolute("ckpt")) == os.path.join(os.getcwd(), "ckpt")
  True
  >>> str(absolute("gs://bucket/run"))
  'gs://bucket/run'
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import Callable

from etils import epath

_CALLBACKS: list[Callable[[], None]] = []
_REGISTERED = False


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
