"""``python -m experiments.bench``: the benchmark (:mod:`experiments.bench.run`)."""
import os
import sys

# Before jax is imported: 8 simulated CPU devices unless told otherwise.
_platform = "cpu"
for _i, _a in enumerate(sys.argv):
  if _a == "--platform" and _i + 1 < len(sys.argv):
    _platform = sys.argv[_i + 1]
  elif _a.startswith("--platform="):
    _platform = _a.split("=", 1)[1]
if _platform == "cpu":
  os.environ["JAX_PLATFORMS"] = "cpu"
  _flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (
        _flags + " --xla_force_host_platform_device_count=8").strip()

from experiments.bench.run import main  # noqa: E402

main()
