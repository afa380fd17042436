"""Where the DeepSpeed front door's INFO lines go (zero1_jax/deepspeed/log.py).

Each case is a fresh Python process, as a user's script is: the logging
setup is process-wide, and pytest's own root handlers would hide the cases
where nothing else is set up.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SAY = """
from zero1_jax.deepspeed import log as ds_log
ds_log.show_info()                      # what z1.initialize does first
logging.getLogger("zero1_jax.deepspeed.memory_log").info("[Rank 0] hello")
logging.getLogger("zero1_jax").debug("not asked for")
"""

CASES = {
    # nothing set up by the program: DeepSpeed's console lines, in zero1's
    # format. Importing zero1_jax imports orbax, whose import logs through
    # absl, and absl then calls a bare logging.basicConfig(): the line must
    # not print through that handler as INFO:zero1_jax...:[Rank 0] hello
    "nothing": ("", ["[zero1_jax] [Rank 0] hello"]),
    "orbax imported first": ("import orbax.checkpoint",
                             ["[zero1_jax] [Rank 0] hello"]),
    # the program's own setup decides, once, in its format
    "program's basicConfig": (
        "logging.basicConfig(level=logging.INFO, format='%(name)s | %(message)s')",
        ["zero1_jax.deepspeed.memory_log | [Rank 0] hello"]),
    "program's root handler": (
        "h = logging.StreamHandler(); h.setFormatter(logging.Formatter("
        "'mine: %(message)s')); logging.getLogger().addHandler(h)",
        ["mine: [Rank 0] hello"]),
    # the program's basicConfig after orbax's import replaces absl's handler
    "orbax, then the program's": (
        "import orbax.checkpoint\n"
        "logging.basicConfig(level=logging.INFO, force=True)",
        ["INFO:zero1_jax.deepspeed.memory_log:[Rank 0] hello"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_info_lines_print_once_where_the_program_wants_them(tmp_path, case):
  setup, expected = CASES[case]
  code = "import logging\n" + textwrap.dedent(setup) + "\n" + SAY
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                        env={**os.environ, "PYTHONPATH": ROOT},
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  lines = [l for l in proc.stderr.splitlines()
           if "hello" in l or "not asked" in l]
  assert lines == expected, proc.stderr
