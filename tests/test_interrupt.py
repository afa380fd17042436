"""Ctrl-C around checkpoint saves (zero1_jax/cli/interrupt.py): held until
the save returns, then raised; a second one exits at once with 130."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from zero1_jax.cli import interrupt


@pytest.fixture(autouse=True)
def python_sigint():
  """Python's own Ctrl-C handler, as in a terminal (a CI shell may start the
  tests with SIGINT ignored); the subprocesses then get the default too."""
  old = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, old)


def test_first_ctrl_c_is_held_until_the_block_ends():
  reached = []
  with pytest.raises(KeyboardInterrupt):
    with interrupt.deferred_sigint():
      os.kill(os.getpid(), signal.SIGINT)
      reached.append("after the signal, inside the block")
  assert reached
  # The handler is restored: a Ctrl-C now raises at once.
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_second_ctrl_c_abandons_with_130():
  code = textwrap.dedent("""
      import os, signal, time
      from zero1_jax.cli import interrupt
      with interrupt.deferred_sigint():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
      print("not reached")
  """)
  run = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=60)
  assert run.returncode == 130, run.stderr
  assert "not reached" not in run.stdout
  assert "abandoned" in run.stderr and "Traceback" not in run.stderr
