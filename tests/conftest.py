"""Test setup: 8 simulated CPU devices, set before jax initialises."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

assert jax.device_count() == 8, jax.devices()


# The zero1-train subprocesses the tests start (resume, multi-process,
# output-dir runs) compile the same step several times per test file: they
# inherit a persistent XLA compilation cache, one per test process, removed at
# exit. Set after `import jax`, so this process's own compiles are not cached.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="zero1_jax_test_xla_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
