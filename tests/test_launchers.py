"""zero1-train and the Python API under the launchers clusters use: Open
MPI's ``mpirun`` and SLURM's ``srun`` / ``sbatch``, for real, on 127.0.0.1.

A single-node SLURM (munged, slurmctld, slurmd) is started by a fixture in a
temporary directory and stopped by PID. Each job joins once through JAX's own
cluster detection (OMPI_* / SLURM_* variables, no coordinates given) and
must train as the local launcher's 2 processes x 2 devices do; a rank killed
with SIGKILL ends the job within seconds with one line naming it.

Install the launchers with ``bash .ci/install-launchers.sh`` (Debian's
openmpi-bin, slurmd, slurmctld, slurm-client, munge); without them these
tests are skipped, saying which command is missing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from zero1_jax import checkpoint
from zero1_jax.cli.launch import free_port
from test_distributed import CONFIG, final_params, train as local_train
from helpers import assert_close

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SBIN = ("/usr/sbin", "/sbin")


def _which(cmd: str) -> str | None:
  return shutil.which(cmd) or shutil.which(cmd, path=os.pathsep.join(SBIN))


def _need(*cmds: str) -> None:
  missing = [c for c in cmds if _which(c) is None]
  if missing:
    pytest.skip(f"{', '.join(missing)} not installed: run `bash "
                f".ci/install-launchers.sh` (Debian: openmpi-bin slurmd "
                f"slurmctld slurm-client munge)")


def _mpirun(n: int) -> list[str]:
  _need("mpirun")
  # As root (CI) Open MPI refuses without --allow-run-as-root; 2 slots on a
  # 2-core machine need --oversubscribe; lo only: nothing leaves 127.0.0.1.
  return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n),
          "--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include",
          "lo"]


SLURM_CONF = """\
ClusterName=zero1test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SrunPortRange={srun_lo}-{srun_hi}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser={user}
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
  """A one-node SLURM on 127.0.0.1 (CPUs=8 declared, so 2 tasks fit on a
  2-core machine): the environment its commands need (SLURM_CONF)."""
  _need("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")
  if os.geteuid() != 0:
    pytest.skip("slurmd runs its jobs' tasks as their user only as root: "
                "these tests need root (CI runs as root)")
  d = tmp_path_factory.mktemp("slurm")
  os.chmod(d, 0o755)      # munged checks the socket's directory
  for sub in ("state", "spool"):
    (d / sub).mkdir()
  key = d / "munge.key"
  key.write_bytes(os.urandom(1024))
  os.chmod(key, 0o400)
  ctld, dport = free_port(), free_port()
  lo = 40000 + os.getpid() % 20000
  conf = d / "slurm.conf"
  conf.write_text(SLURM_CONF.format(d=d, ctld_port=ctld, d_port=dport,
                                    srun_lo=lo, srun_hi=lo + 200, user="root"))
  env = {**os.environ, "SLURM_CONF": str(conf)}
  procs = []

  def start(cmd, name):
    log = open(d / f"{name}.out", "wb")
    procs.append(subprocess.Popen(cmd, env=env, stdout=log,
                                  stderr=subprocess.STDOUT))

  try:
    start([_which("munged"), "--foreground", "--force", f"--key-file={key}",
           f"--socket={d}/munge.sock", f"--pid-file={d}/munged.pid",
           f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
          "munged")
    _wait(lambda: (d / "munge.sock").exists(), 20, d / "munged.out")
    start([_which("slurmctld"), "-D", "-i", "-f", str(conf)], "slurmctld")
    start([_which("slurmd"), "-D", "-N", "localhost", "-f", str(conf)], "slurmd")

    def idle():
      out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env,
                           capture_output=True, text=True).stdout
      return out.strip() in ("idle", "mix", "alloc")
    _wait(idle, 60, d / "slurmd.out")
    yield env
  finally:
    for p in reversed(procs):    # by PID: only the daemons started here
      if p.poll() is None:
        p.terminate()
    for p in reversed(procs):
      try:
        p.wait(10)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    _stop_stepds(d)


def _stop_stepds(d) -> None:
  """A slurmstepd of this SLURM can outlive slurmd (seen once, a minute
  after the last step): those whose environment names this directory."""
  for pid in os.listdir("/proc"):
    try:
      if (pid.isdigit() and open(f"/proc/{pid}/comm").read().strip() == "slurmstepd"
          and str(d) in open(f"/proc/{pid}/environ").read()):
        os.kill(int(pid), signal.SIGKILL)
    except OSError:
      pass


def _wait(ok, timeout_s, log):
  deadline = time.monotonic() + timeout_s
  while not ok():
    if time.monotonic() > deadline:
      raise AssertionError(f"not ready after {timeout_s} s: "
                           f"{log.read_text()[-2000:] if log.exists() else ''}")
    time.sleep(0.3)


def _train_cmd(tmp, out, steps, extra=()):
  cfg = tmp / "ds.json"
  cfg.write_text(json.dumps(CONFIG))
  # the README's command: no coordinates, the launcher's variables name them
  return [shutil.which("zero1-train") or os.path.join(
      os.path.dirname(sys.executable), "zero1-train"),
      "--deepspeed", str(cfg), "--model_name_or_path", "bert-tiny",
      "--seq_len", "16", "--max_steps", str(steps), "--no_progress",
      "--save_steps", "2", "--output_dir", str(tmp / out),
      "--num_devices", "2", *extra]


def _env(extra=None):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "SLURM_", "PMI_", "JAX_COORDINATOR"))}
  env["XLA_FLAGS"] = ""          # not the test process's 8 devices
  env.update(extra or {})
  return env


def _run(cmd, env, timeout=400):
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
  return proc


def _losses(path):
  return [json.loads(l)["loss"] for l in open(path / "metrics.jsonl")]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
  """The local launcher's 2 processes x 2 devices, 6 steps: the reference."""
  tmp = tmp_path_factory.mktemp("local")
  local_train(tmp, "ref", procs=2, steps=6)
  return tmp


def _same_as_local(tmp, out, local, proc):
  # Same layout (2 x 2), same programs, same reduction order across the
  # processes: the runs are the same computation, so the losses and the
  # parameters agree to rounding; the local-launcher tolerances of
  # test_distributed.py (1e-5 on losses, 1e-6 per leaf) apply unchanged.
  np.testing.assert_allclose(_losses(tmp / out), _losses(local / "ref"),
                             rtol=1e-5)
  assert_close(final_params(tmp, out), final_params(local, "ref"), 1e-6,
               f"{out} vs local ")
  text = proc.stdout
  assert text.count("weights start random") == 1, text      # process 0 only
  assert "Gloo" not in text and "peer ranks" not in text, text
  assert "Check failure" not in proc.stderr, proc.stderr[-3000:]
  assert checkpoint.committed_steps(tmp / out / "checkpoints") == [2, 4, 6]


def test_mpirun_runs_the_readme_command_like_the_local_launcher(tmp_path, local):
  """`mpirun -np 2 zero1-train ...` (no coordinates): it joined, then
  engine.initialize joined again after the backend started and both
  processes exited 1 ('must be called before any JAX calls')."""
  proc = _run(_mpirun(2) + _train_cmd(tmp_path, "mpi", 6), _env())
  _same_as_local(tmp_path, "mpi", local, proc)
  # --resume latest from step 4 continues exactly: the same step-6 params
  shutil.copytree(tmp_path / "mpi" / "checkpoints" / "4",
                  tmp_path / "mpi_r" / "checkpoints" / "4")
  proc = _run(_mpirun(2) + _train_cmd(tmp_path, "mpi_r", 6,
                                      ["--resume", "latest"]), _env())
  assert proc.stdout.count("resumed from") == 1, proc.stdout   # process 0
  assert_close(final_params(tmp_path, "mpi_r", 6), final_params(local, "ref"),
               1e-6, "mpirun resumed ")


def test_srun_and_sbatch_run_the_readme_command(tmp_path, local, slurm):
  env = {**slurm, **_env()}
  proc = _run(["srun", "-n", "2"] + _train_cmd(tmp_path, "srun", 6), env)
  _same_as_local(tmp_path, "srun", local, proc)
  script = tmp_path / "job.sbatch"
  cmd = " ".join(_train_cmd(tmp_path, "sbatch", 6))
  script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output="
                    f"{tmp_path}/sbatch.log\nsrun {cmd}\n")
  _run(["sbatch", "--wait", str(script)], env)
  log = (tmp_path / "sbatch.log").read_text()
  assert log.count("weights start random") == 1 and "Gloo" not in log, log
  np.testing.assert_allclose(_losses(tmp_path / "sbatch"),
                             _losses(local / "ref"), rtol=1e-5)


COUNT = ("from zero1_jax import inspect; "
         "print('on this host:', inspect.processes_on_this_host())")


def test_each_launcher_says_how_many_processes_share_the_host(slurm):
  """The memory check divides the host's RAM among the processes on it:
  `srun -n 2` sets SLURM_TASKS_PER_NODE=2 but not SLURM_NTASKS_PER_NODE
  (read alone before: 1, an estimate 2x too generous); `srun
  --ntasks-per-node=2`, mpirun (OMPI_COMM_WORLD_LOCAL_SIZE) the same 2."""
  env = {**slurm, **_env()}
  for launcher in (["srun", "-n", "2"], ["srun", "-N", "1", "--ntasks-per-node=2"],
                   _mpirun(2)):
    out = _run(launcher + [sys.executable, "-c", COUNT], env).stdout
    assert out.splitlines() == ["on this host: 2"] * 2, (launcher, out)


PYTHON_API = """
import sys
import numpy as np, jax.numpy as jnp, zero1_jax as z1
z1.distributed.initialize()                  # joins: the launcher's variables
import jax
mesh = jax.make_mesh((jax.device_count(),), ("data",))
cfg = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
e = z1.initialize(cfg, loss_fn=loss, params={"w": np.zeros((3, 2), np.float32)},
                  mesh=mesh)                 # joins again: must do nothing
r = np.random.default_rng(0)
batch = {"x": r.normal(size=(8, 3)).astype(np.float32),
         "y": r.normal(size=(8, 2)).astype(np.float32)}
m = e.train_batch(batch)
# one write: print() writes each piece apart, and with unbuffered output the
# two ranks' pieces interleaved ("trainedtrained 1  0 2 ...")
sys.stdout.write(f"trained {jax.process_index()} {jax.process_count()} "
                 f"{float(m['loss'])}\\n")
"""


def test_python_api_joins_once_under_both_launchers(tmp_path, slurm):
  """The README's order: z1.distributed.initialize(), a mesh, then
  z1.initialize(mesh=...) (which joined a second time and failed)."""
  script = tmp_path / "api.py"
  script.write_text(PYTHON_API)
  env = _env({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
  for launcher, e in ((_mpirun(2), env), (["srun", "-n", "2"], {**slurm, **env})):
    out = _run(launcher + [sys.executable, str(script)], e).stdout
    # Gloo prints "[Gloo] Rank ... is connected ..." to the same stdout
    # without a newline of its own, so a rank's line may follow it directly
    # (seen: "...is : 1trained 0 2 ..."): read the lines wherever they start.
    got = sorted(re.findall(r"trained (\d+) (\d+) (\S+)", out))
    assert [g[:2] for g in got] == [("0", "2"), ("1", "2")], out
    assert got[0][2] == got[1][2], out


def _kill_rank(launcher, env, tmp, out, rank, rank_var):
  """Starts a long run, SIGKILLs the process of ``rank`` once step 4 is
  committed; returns (seconds from the kill to the job's end, stderr)."""
  cmd = launcher + _train_cmd(tmp, out, 100000)
  job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
  try:
    ckpt = tmp / out / "checkpoints"
    deadline = time.monotonic() + 600   # start-up hang guard (loaded hosts: minutes)
    while 4 not in checkpoint.committed_steps(ckpt):
      assert job.poll() is None, job.stderr.read()[-3000:]
      assert time.monotonic() < deadline
      time.sleep(0.2)
    pid = _rank_pid(tmp / out, rank, rank_var)
    os.kill(pid, signal.SIGKILL)
    t = time.monotonic()
    _, err = job.communicate(timeout=120)
    return time.monotonic() - t, err
  finally:
    if job.poll() is None:
      os.killpg(job.pid, signal.SIGKILL)
      job.wait()
    _kill_run(tmp / out)


def _kill_run(out_dir) -> None:
  """SIGKILL to every process left of the run writing ``out_dir`` (a hung
  job's ranks: mpirun starts them in their own process groups)."""
  for pid in os.listdir("/proc"):
    try:
      if pid.isdigit() and str(out_dir) in open(
          f"/proc/{pid}/cmdline").read().split("\0"):
        os.kill(int(pid), signal.SIGKILL)
    except OSError:
      pass


def _rank_pid(out_dir, rank, rank_var) -> int:
  """The training process of ``rank`` in the run writing ``out_dir``: of the
  processes with its command line and rank, the one whose parent is not
  another of them (its output helper's parent is the training process)."""
  cands = {}
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      argv = open(f"/proc/{pid}/cmdline").read().split("\0")
      environ = open(f"/proc/{pid}/environ").read().split("\0")
      ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
      continue
    if (str(out_dir) in argv and f"{rank_var}={rank}" in environ
        and not any(a.endswith(("mpirun", "srun", "orted")) for a in argv[:1])):
      cands[int(pid)] = ppid
  found = [p for p, pp in cands.items() if pp not in cands]
  assert len(found) == 1, cands
  return found[0]


def _check_dead_line(err, rank, tmp, out, elapsed):
  lines = [l for l in err.splitlines() if "died;" in l]
  assert len(lines) == 1, err[-3000:]
  assert f"process {rank} of 2 died" in lines[0], lines[0]
  last = checkpoint.committed_steps(tmp / out / "checkpoints")[-1]
  assert f"the last committed checkpoint is step {last}" in lines[0], lines[0]
  assert "--resume latest" in lines[0], lines[0]
  assert "Check failure" not in err and "stack trace" not in err, err[-3000:]
  # the survivors' own bound is ~1 s (gloo's reset, a pid gone on this host)
  # plus the watch's 3 s grace; the launcher's teardown comes on top. The
  # coordination service's heartbeat timeout (100 s) must not be waited for.
  assert elapsed < 30, (elapsed, err[-3000:])


@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_rank_ends_the_mpirun_job_with_one_line(tmp_path, rank):
  elapsed, err = _kill_rank(_mpirun(2), _env(), tmp_path, "k", rank,
                            "OMPI_COMM_WORLD_RANK")
  _check_dead_line(err, rank, tmp_path, "k", elapsed)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_rank_ends_the_srun_job_with_one_line(tmp_path, slurm, rank):
  elapsed, err = _kill_rank(["srun", "-n", "2"], {**slurm, **_env()},
                            tmp_path, "k", rank, "SLURM_PROCID")
  _check_dead_line(err, rank, tmp_path, "k", elapsed)
  # the last committed checkpoint is intact: the job resumes from it
  _run(["srun", "-n", "2"] + _train_cmd(
      tmp_path, "k", checkpoint.committed_steps(tmp_path / "k" / "checkpoints")[-1] + 2,
      ["--resume", "latest"]), {**slurm, **_env()})
