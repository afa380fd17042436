"""Process coordinates: flags, or what a cluster launcher put in the environment."""

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
