"""Test setup: 8 simulated CPU devices, set before jax initialises."""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

# One persistent XLA compilation cache for the whole run, removed at exit:
# the tests compile the same programs many times (every in-process
# zero1-train run of a file compiles the same bert-tiny step; the
# subprocesses of the resume, multi-process and output-dir tests too).
# Measured: tests/test_output_dir.py 158 s -> 82 s from a cold cache.
# Set before `import jax`, which reads it; the pytest-xdist workers and every
# subprocess inherit it. Only compiles over jax's default 1 s are stored, and
# a cached executable reports the same memory_analysis() and HLO text.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="zero1_jax_test_xla_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache

# The elementwise verdicts' disk cache (core/verdicts.py) in a directory of
# this run's own, shared by the workers and subprocesses like the XLA cache:
# a verdict left in ~/.cache by an earlier run (or another checkout) never
# decides a test here.
if "ZERO1_VERDICT_CACHE" not in os.environ:
  _verdicts = tempfile.mkdtemp(prefix="zero1_jax_test_verdicts_")
  atexit.register(shutil.rmtree, _verdicts, ignore_errors=True)
  os.environ["ZERO1_VERDICT_CACHE"] = _verdicts

# What the CLI reads from the host is pinned: the memory each simulated
# device may use (zero1-train's fit check and its suggestions) would
# otherwise follow the host's free RAM at that moment. 22 GiB shared by 8
# devices: this machine kind (24 GiB) with nothing else running. Tests of the
# reading itself unset it (test_memory_estimate.py).
os.environ.setdefault("ZERO1_DEVICE_MEMORY_BYTES", str(22 * 1024 ** 3 // 8))

# jax's CUDA plugin, installed beside the venv by the Makefile, for the tests
# that compile steps for GPUs without one (tests/test_gpu_aot.py): on
# sys.path before jax looks for plugins; JAX_PLATFORMS=cpu keeps it from
# trying to open a GPU.
import sys  # noqa: E402

_PLUGINS = os.path.join(sys.prefix, "aot-plugins")
if os.path.isdir(_PLUGINS) and _PLUGINS not in sys.path:
  sys.path.insert(0, _PLUGINS)

import jax  # noqa: E402

assert jax.device_count() == 8, jax.devices()
