"""Ctrl-C around checkpoint saves (zero1_jax/cli/interrupt.py): held until
the save returns, then raised; a second one exits at once with 130."""
import os
import signal
import subprocess
import sys
import textwrap
import time

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
      with interrupt.deferred_sigint(resume_hint=lambda: "resume from 7"):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
      print("not reached")
  """)
  run = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=60)
  assert run.returncode == 130, run.stderr
  assert "not reached" not in run.stdout
  assert "Traceback" not in run.stderr
  # the last line says what a resume continues from, as a single Ctrl-C's does
  assert run.stderr.strip().splitlines()[-1].endswith(
      "abandoned (its step is not committed); resume from 7"), run.stderr


def test_a_ctrl_c_swallowed_by_a_gc_callback_is_raised_at_the_next_check():
  """Seen: a Ctrl-C that landed in jax's _xla_gc_callback was printed as
  "Exception ignored in ..." and the run trained to its end with exit 0.
  Under remembered() it is raised again at the next check()."""
  def gc_callback():   # what the interpreter does with a callback's error
    try:
      os.kill(os.getpid(), signal.SIGINT)
      for _ in range(10**6):   # the handler runs between bytecodes
        pass
    except KeyboardInterrupt:
      return "ignored"
  with interrupt.remembered():
    interrupt.check()              # nothing pending
    assert gc_callback() == "ignored"
    with pytest.raises(KeyboardInterrupt):
      interrupt.check()
    interrupt.handled()
    interrupt.check()              # handled: forgotten
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_in_a_real_gc_callback_prints_no_traceback():
  """The interpreter prints an error raised in a gc callback as "Exception
  ignored in ..." with a traceback (seen on a Ctrl-C while zero1-train was
  starting, jax 0.11): under remembered() the Ctrl-C is only recorded
  there, and check() raises it."""
  import gc
  hits = []

  def callback(phase, info):
    del info
    if phase == "start" and not hits:
      hits.append("ran")
      try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**6):   # the handler runs between bytecodes
          pass
      except KeyboardInterrupt:   # what the interpreter would print
        hits.append("raised in the callback")

  gc.callbacks.append(callback)
  try:
    with interrupt.remembered():
      gc.collect()
      assert hits == ["ran"], hits
      with pytest.raises(KeyboardInterrupt):
        interrupt.check()
      interrupt.handled()
  finally:
    gc.callbacks.remove(callback)


def test_zero1_train_ctrl_c_while_starting_exits_130(tmp_path):
  """Interrupted while starting (XLA may be compiling on its own threads),
  zero1-train exits 130 with one line: tearing the runtime down under a
  compile crashed with 139 in 13 of 20 tries."""
  cfg = tmp_path / "ds.json"
  cfg.write_text('{"train_batch_size": 4, "zero_optimization": {"stage": 1}, '
                 '"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}')
  cmd = [sys.executable, "-m", "zero1_jax.cli.train", "--deepspeed", str(cfg),
         "--num_devices", "4",
         "--model_name_or_path", "bert-tiny",
         "--per_device_train_batch_size", "1", "--max_steps", "50",
         "--no_progress", "--output_dir", str(tmp_path / "o")]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env={**os.environ, "XLA_FLAGS": ""})
  for line in proc.stdout:
    if "weights start random" in line:
      break
  time.sleep(0.8)   # the engine is being built (crashed from 0.4 s to 1.5 s)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, (proc.returncode, err[-2000:])
  assert "interrupted" in err and "Traceback" not in err, err[-2000:]


def test_zero1_train_ctrl_c_while_importing_jax_exits_130(tmp_path):
  """A Ctrl-C in the first seconds, while jax loads: `import zero1_jax`
  imported jax before zero1-train's own handling began (Python's
  KeyboardInterrupt traceback), and one inside jaxlib's initialisation
  crashed the interpreter (SIGSEGV, SIGABRT). Now the package's names
  resolve on first use, and the command loads jax with Ctrl-C held: one
  line, exit 130. The signal is sent once jaxlib's library is mapped into
  the process; removing either half fails this."""
  cfg = tmp_path / "ds.json"
  cfg.write_text('{"train_batch_size": 4, "optimizer": {"type": "AdamW", '
                 '"params": {"lr": 1e-3}}}')
  cmd = [sys.executable, "-m", "zero1_jax.cli.train", "--deepspeed", str(cfg),
         "--num_devices", "4", "--model_name_or_path", "bert-tiny",
         "--max_steps", "5", "--no_progress", "--output_dir", str(tmp_path / "o")]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env={**os.environ, "XLA_FLAGS": ""})
  maps = f"/proc/{proc.pid}/maps"
  deadline = time.time() + 60
  while time.time() < deadline and proc.poll() is None:
    try:
      if "jaxlib" in open(maps).read():
        break
    except OSError:
      pass
    time.sleep(0.005)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, (proc.returncode, err[-2000:])
  assert "Traceback" not in err and "interrupted" in err, err[-2000:]
