"""Process coordinates: flags, or what a cluster launcher put in the environment."""

import os
import subprocess
import sys
import time

import pytest

from zero1_jax import distributed


@pytest.mark.parametrize("env,multi", [
    ({}, False),
    ({"SLURM_NTASKS": "1"}, False),
    ({"SLURM_NTASKS": "4"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, True),
])
def test_cluster_environment_detection(monkeypatch, env, multi):
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
              "JAX_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(var, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  assert distributed.cluster_environment() is multi


def test_single_process_without_coordinates(monkeypatch):
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
              "JAX_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(var, raising=False)
  assert distributed.initialize() is False


def test_partial_coordinates_are_an_error():
  """In the Python API's words (it said '--process_id', a CLI flag), with
  the CLI's flags beside them."""
  with pytest.raises(ValueError, match="needs coordinator_address, num_processes "
                                       "and process_id together \\(zero1-train: "
                                       "--coordinator_address"):
    distributed.initialize("127.0.0.1:1234", num_processes=2)
  with pytest.raises(ValueError, match=r"^process_id 2 must be in \[0, 2\)"):
    distributed.initialize("127.0.0.1:1234", num_processes=2, process_id=2)


def test_jax_coordinator_address_gives_process_0_only(monkeypatch):
  """JAX reads only the coordinator's address from JAX_COORDINATOR_ADDRESS.
  With --num_processes and --process_id it completes them; alone, the
  error says what is missing (JAX's own: 'Number of processes must be
  defined'). jax.distributed.initialize is stood in for: it may not run in
  a process whose backend is up."""
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  calls = []

  def fake(**kw):
    calls.append(kw)
    if "num_processes" not in kw:
      raise ValueError("Number of processes must be defined.")

  monkeypatch.setattr(distributed.jax.distributed, "initialize", fake)
  monkeypatch.setattr(distributed.jax, "process_index", lambda: 1)
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
  assert distributed.initialize(num_processes=2, process_id=1) is True
  assert calls[-1]["coordinator_address"] == "10.0.0.1:1234"
  assert (calls[-1]["num_processes"], calls[-1]["process_id"]) == (2, 1)
  with pytest.raises(ValueError, match=r"JAX_COORDINATOR_ADDRESS=10\.0\.0\.1:"
                     r"1234 names process 0 only: .*--num_processes and "
                     r"--process_id"):
    distributed.initialize()


# ------------------------------------------------------------ launcher output
GLOO = ("[Gloo] Rank {r} is connected to {n} peer ranks. Expected number of "
        "connected peer ranks is : {n}\n")


@pytest.mark.parametrize("stream", [
    # whole messages between our lines
    "a\n" + GLOO.format(r=0, n=3) + GLOO.format(r=1, n=3) + "b\n\nc\n",
    # two devices of one process printing at once (seen with 2 x 2 devices):
    # the first message's count and newline land after the second message
    "a\n" + GLOO.format(r=3, n=3)[:-2] + GLOO.format(r=2, n=3) + "3\nb\n\nc\n",
    # a message cut by the other device's newline
    "a\n[Gloo] Rank \n" + GLOO.format(r=1, n=1)[len("[Gloo] Rank "):] + "b\n\nc\n",
])
def test_launcher_relays_stdout_without_gloo_connection_lines(stream):
  import io
  from zero1_jax.cli.launch import relay
  out = io.BytesIO()
  relay(io.BytesIO(stream.encode()), out)
  assert out.getvalue() == b"a\nb\n\nc\n"


# ------------------------------------------------------- joining only once
def test_a_second_join_does_nothing_but_check_coordinates(monkeypatch):
  """zero1-train joins, then engine.initialize calls initialize() again:
  under mpirun/srun (cluster variables set) it joined a second time after
  the backend had started and failed ('must be called before any JAX
  calls'). Joined already, it returns True and only checks any coordinates
  it is given against the running job."""
  monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
  monkeypatch.setattr(distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
  monkeypatch.setattr(distributed.jax, "process_index", lambda: 1)

  def joined_twice(**kw):
    raise AssertionError("jax.distributed.initialize called a second time")

  monkeypatch.setattr(distributed.jax.distributed, "initialize", joined_twice)
  assert distributed.initialize() is True
  assert distributed.initialize(auto=True) is True
  assert distributed.initialize("127.0.0.1:1", num_processes=2, process_id=1)
  with pytest.raises(ValueError, match="num_processes=4, but this process "
                     "already joined a job of 2"):
    distributed.initialize("127.0.0.1:1", num_processes=4, process_id=1)
  with pytest.raises(ValueError, match="process_id=0, but this process "
                     "already joined as process 1"):
    distributed.initialize("127.0.0.1:1", num_processes=2, process_id=0)


def test_is_initialized_reads_jax():
  """jax.distributed.is_initialized (jax 0.10.2 has it; an older jax, the
  client of its global state): False in this single-process test run."""
  import jax
  assert distributed.is_initialized() is False
  assert jax.distributed.is_initialized() is False


def test_a_join_after_the_backend_started_names_the_fix(monkeypatch):
  """JAX's own message blames calls the user may never have made; ours
  names what was detected and the order that works."""
  monkeypatch.setattr(distributed, "is_initialized", lambda: False)
  monkeypatch.setenv("SLURM_NTASKS", "2")

  def late(**kw):
    raise RuntimeError("jax.distributed.initialize() must be called before "
                       "any JAX calls that might initialise the XLA backend.")

  monkeypatch.setattr(distributed.jax.distributed, "initialize", late)
  with pytest.raises(RuntimeError, match=r"joining the multi-process job "
                     r"\(detected from SLURM_NTASKS=2\) must come before "
                     r"anything starts JAX's backend"):
    distributed.initialize()


# ------------------------------------------------ processes on this host
@pytest.mark.parametrize("env,n", [
    ({}, 1),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4),                 # mpirun
    ({"SLURM_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}, 2),  # srun -n 2
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_TASKS_PER_NODE": "8",
      "SLURM_NODEID": "3"}, 1),                    # the step's list first
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "2"}, 2),
    ({"SLURM_TASKS_PER_NODE": "3,2(x2)", "SLURM_NODEID": "1"}, 2),
    ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, 4),       # --ntasks-per-node alone
    ({"ZERO1_LOCAL_PROCESSES": "2", "SLURM_TASKS_PER_NODE": "8"}, 2),
    ({"SLURM_TASKS_PER_NODE": "bogus", "SLURM_NTASKS_PER_NODE": "3"}, 3),
])
def test_processes_on_this_host_from_each_launcher(env, n):
  from zero1_jax import inspect
  assert inspect.processes_on_this_host(env) == n


def test_slurm_tasks_per_node_form():
  from zero1_jax import inspect
  assert inspect.slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
  assert inspect.slurm_tasks_per_node("1,4(x2)") == [1, 4, 4]
  for bad in ("", "2(x3", "x", "0"):
    with pytest.raises(ValueError):
      inspect.slurm_tasks_per_node(bad)


# ------------------------------------------- a dead peer: which one, and the line
# The block JAX's runtime writes when it aborts from C++ because process 0
# (its coordination service) is gone: the F line, its error, the trace.
FATAL_BLOCK = (
    b"F1201 22:55:16.485082 15409 client.h:80] Terminating process because "
    b"the JAX distributed service detected fatal errors. absl::Status: "
    b"UNAVAILABLE: Either the leader task was preempted/died/restarted\n"
    b"*** Check failure stack trace: ***\n"
    b"    @     0x7faf4b840634  absl::LogMessage::SendToLog()\n")


def _filtered(stream: bytes) -> bytes:
  """What the output helper writes for ``stream``, its line being
  ``dead [ranks]``."""
  import io
  from zero1_jax.cli.launch import filter_stderr
  out = io.BytesIO()
  filter_stderr(io.BytesIO(stream), out, lambda ranks: f"dead {ranks}")
  return out.getvalue()


def test_runtime_fatal_block_becomes_one_line():
  """The output helper drops the runtime's fatal block and the warnings
  just before it, keeps every other line, and writes the line it is given
  for the ranks named."""
  stream = (
      b"[zero1_jax] process 1 of 2 joined\n"
      b"W1201 22:55:16.485020 15409 preemption_sync_manager.cc:147] Failed\n"
      b"Additional GRPC error information from remote target\n"
      b"E1201 22:55:16.485078 15409 coordination_service_agent.cc:289] Polled\n"
      + FATAL_BLOCK)
  assert _filtered(stream) == b"[zero1_jax] process 1 of 2 joined\ndead [0]\n"
  # a warning with no fatal after it is kept, whole
  warn = (b"W1201 22:55:16.485020 1 x.cc:1] slow\nits detail\n"
          b"[zero1-train] step line\n")
  assert _filtered(warn) == warn


def test_no_second_line_when_the_process_said_its_own_first():
  """The survivor's collective failed and it printed its line; the
  runtime's error thread aborted before the survivor's os._exit. The
  helper drops the fatal block and writes no second line (the CI's slow
  suite once showed both)."""
  said = (b"zero1-train: error: process 0 of 2 died; process 1 stops "
          b"(UNKNOWN: Gloo AllGather failed); resume with: x\n")
  assert _filtered(said + FATAL_BLOCK) == said
  # a line of another kind before the block does not stand for it
  other = b"zero1-train: error: the data ran out\n"
  assert _filtered(other + FATAL_BLOCK) == other + b"dead [0]\n"


def test_dead_ranks_from_the_runtime_error():
  from zero1_jax.cli.launch import dead_ranks
  assert dead_ranks(b"UNAVAILABLE: The following tasks are unhealthy (stopped "
                    b"sending heartbeats):\n1\nThe tasks have crashed.") == [1]
  assert dead_ranks(b"Failed to send RPC to coordination service.") == [0]
  assert dead_ranks(b"something else") == []


def test_resume_command_keeps_the_run_and_the_launcher(monkeypatch):
  from zero1_jax.cli import peers
  for v in ("OMPI_COMM_WORLD_SIZE", "SLURM_STEP_ID", "SLURM_NTASKS"):
    monkeypatch.delenv(v, raising=False)
  argv = ["--deepspeed", "ds.json", "--output_dir", "out", "--resume", "4",
          "--overwrite_output_dir", "--max_steps", "9"]
  assert peers.resume_command(argv) == ("zero1-train --deepspeed ds.json "
                                        "--output_dir out --max_steps 9 "
                                        "--resume latest")
  monkeypatch.setenv("SLURM_STEP_ID", "0")
  monkeypatch.setenv("SLURM_NTASKS", "2")
  assert peers.resume_command(argv).startswith("srun -n 2 zero1-train ")
  monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
  assert peers.resume_command(argv).startswith("mpirun -np 4 zero1-train ")


class _Store:
  """The coordination service's key-value store, in a dict."""

  def __init__(self):
    self.kv, self.down = {}, False

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE")
    self.kv[key] = value

  def key_value_dir_get(self, prefix):
    if self.down:
      raise RuntimeError("UNAVAILABLE")
    return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def test_peer_watch_names_the_dead_process():
  """A pid on this host that no longer runs is dead at once; a remote
  peer whose counter stopped, after stale_s; process 0 when the store
  itself (its service) stops answering."""
  import socket
  import subprocess
  import sys
  store = _Store()
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()
  store.kv[f"{distributed.PeerWatch.PREFIX}/who/1"] = f"{socket.gethostname()} {gone.pid}"
  store.kv[f"{distributed.PeerWatch.PREFIX}/who/2"] = "elsewhere 1"
  w = distributed.PeerWatch(store, 0, 3, tick_s=0.05, stale_s=0.3)
  try:
    assert w.dead(wait_s=2.0) == [1]
    store.kv[f"{distributed.PeerWatch.PREFIX}/who/1"] = f"{socket.gethostname()} {os.getpid()}"
    w.peers.clear()
    time.sleep(0.2)
    assert w.dead() == []        # rank 2 never ticked: not known to be dead
    store.kv[f"{distributed.PeerWatch.PREFIX}/tick/2"] = "1"
    assert w.dead(wait_s=2.0) == [2]        # ... then stopped: stale
  finally:
    w.stop()
  w1 = distributed.PeerWatch(store, 1, 3, tick_s=0.05, stale_s=0.3)
  try:
    store.down = True
    assert w1.dead(wait_s=2.0) == [0]
  finally:
    w1.stop()


def test_a_sigterm_before_the_first_tick_still_finds_the_dead_peer():
  """mpirun's SIGTERM can come before the watch's first tick has read who
  the peers are (two quick steps and a checkpoint after joining): dead()
  reads them itself then. Without that, rank 0 saw no peers, exited 143
  and lost its line (tests/test_distributed.py, 1 run of a clean-clone
  make test-slow)."""
  import socket
  import subprocess
  import sys
  store = _Store()
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()
  w = distributed.PeerWatch(store, 0, 2, tick_s=3600.0)   # never ticks here
  try:
    store.kv[f"{distributed.PeerWatch.PREFIX}/who/1"] = f"{socket.gethostname()} {gone.pid}"
    assert w.dead() == [1]
  finally:
    w.stop()


SIGTERM_WHILE_SAYING = """
import os, signal, sys, time
from zero1_jax.cli import peers

class Watch:                       # rank 1 is gone
  def dead(self, wait_s=0.0):
    return [1]
  def stop(self):
    pass

peers._WATCH = Watch()
peers._on_sigterm("out")
peers._ONCE.acquire()              # the main thread's collective failed: its line
os.kill(os.getpid(), signal.SIGTERM)   # mpirun's, at once
time.sleep(1.0)
print("the main thread's line", file=sys.stderr, flush=True)
os._exit(1)
"""


def test_sigterm_while_the_main_thread_says_the_line_leaves_it_status_1():
  """mpirun's SIGTERM arriving while the main thread, its collective failed
  on the dead peer, is saying the line: the SIGTERM thread lets it finish
  and exit 1 instead of leaving first with 143 (seen once in the slow
  suite's mpirun test)."""
  r = subprocess.run([sys.executable, "-c", SIGTERM_WHILE_SAYING],
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
  assert "the main thread's line" in r.stderr
