"""Where the DeepSpeed front door's INFO lines go when nobody set up logging.

DeepSpeed's logger prints INFO to the console from the start: its config
notes and ``step=10, skipped=0, lr=[...]`` every ``steps_per_print`` steps.
``logging.getLogger("zero1_jax")`` has no handler of its own, so without
:func:`show_info` its INFO lines (a key with no effect under XLA, the step
lines) would reach nobody. Once the program configures logging itself (a
handler on the root logger or on "zero1_jax") those handlers decide.

A root handler the program did not ask for is not the program's setup:
absl's logging calls a bare ``logging.basicConfig()`` the first time a
library logs through it with no handler set, and orbax does so while it is
imported. Left to propagate, the lines would print a second time through it
as ``INFO:zero1_jax.deepspeed.memory_log:[Rank 0] ...``; so zero1_jax's
logger hands its records to the root's handlers itself, unless those are
that implicit one alone (with the root left at WARNING).

Example::

  show_info()       # z1.initialize calls it; idempotent
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

_NAME = "zero1_jax"
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _implicit(root: logging.Logger) -> bool:
  """The root's handlers are what a bare ``logging.basicConfig()`` makes
  (one stderr StreamHandler in logging's default format) and the root is
  still at WARNING: nobody asked for INFO lines (absl's implicit setup)."""
  hs = root.handlers
  return (root.level > logging.INFO and len(hs) == 1
          and type(hs[0]) is logging.StreamHandler
          and getattr(hs[0].formatter, "_fmt", None) == logging.BASIC_FORMAT)


class _Fallback(logging.Handler):
  """Writes to the current ``sys.stderr`` while no other handler would;
  ``forward``: hands records to the root's handlers, as the propagation
  :func:`show_info` turned off would have, when the program set them."""

  def __init__(self, forward: bool):
    super().__init__(logging.NOTSET)
    self.forward = forward

  def emit(self, record: logging.LogRecord) -> None:
    root, log = logging.getLogger(), logging.getLogger(_NAME)
    configured = bool(root.handlers) and not _implicit(root)
    if configured and self.forward and not log.propagate:
      for h in root.handlers:   # not twice to one on both loggers (pytest's)
        if record.levelno >= h.level and h not in log.handlers:
          h.handle(record)
      return
    if (configured or (log.propagate and root.handlers)
        or record.levelno < logging.INFO
        or any(h is not self for h in log.handlers)):
      return
    try:
      print(self.format(record), file=sys.stderr, flush=True)
    except Exception:  # pylint: disable=broad-except
      self.handleError(record)


def show_info() -> None:
  """Makes zero1_jax's INFO lines visible, as DeepSpeed's are, unless the
  program configured logging; a no-op the second time."""
  log = logging.getLogger(_NAME)
  if any(isinstance(h, _Fallback) for h in log.handlers):
    return
  h = _Fallback(forward=log.propagate)
  h.setFormatter(logging.Formatter("[zero1_jax] %(message)s"))
  log.addHandler(h)
  log.propagate = False      # the handler forwards to the program's handlers
  if log.level == logging.NOTSET or log.level > logging.INFO:
    log.setLevel(logging.INFO)


def warn(message: str, category: type[Warning]) -> None:
  """``warnings.warn`` attributed to the first caller outside zero1_jax
  (the user's ``z1.initialize(...)`` line, not this package's internals)."""
  frame, level = sys._getframe(1), 2
  while frame is not None and os.path.abspath(
      frame.f_code.co_filename).startswith(_PKG):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level)
