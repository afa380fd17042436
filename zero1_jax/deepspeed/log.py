"""Where the DeepSpeed front door's INFO lines go when nobody set up logging.

DeepSpeed's logger prints INFO to the console from the start: its config
notes and ``step=10, skipped=0, lr=[...]`` every ``steps_per_print`` steps.
``logging.getLogger("zero1_jax")`` has no handler of its own, so without
:func:`show_info` its INFO lines (a key with no effect under XLA, the step
lines) would reach nobody. The handler stays quiet once the program
configures logging itself (a handler on the root logger or on "zero1_jax"):
then those handlers decide.

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


class _Fallback(logging.Handler):
  """Writes to the current ``sys.stderr`` while no other handler would."""

  def emit(self, record: logging.LogRecord) -> None:
    log = logging.getLogger(_NAME)
    if logging.getLogger().handlers or any(
        h is not self for h in log.handlers):
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
  h = _Fallback(logging.INFO)
  h.setFormatter(logging.Formatter("[zero1_jax] %(message)s"))
  log.addHandler(h)
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
