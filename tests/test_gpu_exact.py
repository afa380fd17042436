"""experiments/gpu/exact.py, the numerical half of experiments/gpu/check.sh,
runs here on the 8 simulated CPU devices, so a change that breaks it is seen
before a lent GPU's minutes are spent on it."""

import jax.numpy as jnp
import pytest

from experiments.gpu import exact as gpu_exact


@pytest.mark.slow   # the GPU check script dry-run on the CPU mesh (~20 s)
def test_gpu_exact_passes_on_the_cpu_mesh(capsys):
  assert gpu_exact.main() == 0
  out = capsys.readouterr().out
  assert "N=8 (cpu" in out
  assert out.count(" yes") == 4, out          # the fp32 rows hold their limit
  assert "NO" not in out


def test_its_error_measure_sees_one_changed_element():
  p = gpu_exact.params(jnp.float32)
  q = dict(p, b2=p["b2"].at[3].add(1e-3))
  assert gpu_exact.rel_err(p, p) == 0.0
  assert gpu_exact.rel_err(q, p) > 1e-4
  missing = {k: v for k, v in p.items() if k != "gain"}
  with pytest.raises(AssertionError):
    gpu_exact.rel_err(missing, p)
