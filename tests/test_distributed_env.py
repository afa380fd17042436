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
  with pytest.raises(ValueError, match="--coordinator_address, --num_processes "
                                       "and --process_id together"):
    distributed.initialize("127.0.0.1:1234", num_processes=2)
  with pytest.raises(ValueError, match=r"--process_id 2 must be in \[0, 2\)"):
    distributed.initialize("127.0.0.1:1234", num_processes=2, process_id=2)
