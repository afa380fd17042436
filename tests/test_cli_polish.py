"""A new user's first contact (issue 30, items 4 and 5): nothing sharded
silently on a lone CPU device, and zero1-train's console (the demo config's
notes, fp16 warm-up skips, a typo'd flag, steps_per_print)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import jax
import optax
import pytest

import zero1_jax as z1
from zero1_jax.core import one_device

from helpers import SEED_CONFIG, mesh

# What a first run on a laptop does: one process, one CPU device (no
# XLA_FLAGS), and each of the three ways in: z1.init, tx.init under plain jit
# (jax.set_mesh), z1.initialize. Each says it (the once-per-process flag is
# reset between them); a second call says nothing.
_ONE_CPU = r"""
import warnings
import jax, jax.numpy as jnp, optax
import zero1_jax as z1
from zero1_jax.core import one_device
assert jax.device_count() == 1 and jax.default_backend() == "cpu"
warnings.simplefilter("always")
m = jax.make_mesh((1,), ("data",))
params = {"w": jnp.ones((4, 3))}
tx = z1.zero1(optax.sgd(0.1), axis_name="data", check_elementwise=False)

def said(f):
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    f()
    f()      # once per process: the second call says nothing
  return [str(x.message) for x in w
          if issubclass(x.category, one_device.OneDeviceWarning)]

def plain_jit():
  with jax.set_mesh(m):
    tx.init(jax.device_put(params, jax.sharding.NamedSharding(
        m, jax.sharding.PartitionSpec())))

cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
       "zero_allow_untested_optimizer": True}
ways = {"z1.init": lambda: z1.init(tx, params, m),
        "tx.init": plain_jit,
        "z1.initialize": lambda: z1.initialize(
            cfg, lambda p, b: jnp.sum(p["w"]), params, m)}
for name, f in ways.items():
  one_device._said = False
  print(name, said(f))
"""


def test_a_lone_cpu_device_says_once_that_nothing_is_sharded():
  """The README's examples exited 0 on one CPU device with nothing sharded
  and not a word: each way in now warns once, naming XLA_FLAGS."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run([sys.executable, "-c", _ONE_CPU], env=env,
                     capture_output=True, text=True, timeout=300,
                     cwd=os.path.dirname(__file__))
  assert r.returncode == 0, r.stderr[-3000:]
  lines = r.stdout.strip().splitlines()
  assert [l.split(" ", 1)[0] for l in lines] == [
      "z1.init", "tx.init", "z1.initialize"], r.stdout
  for line in lines:
    msgs = eval(line.split(" ", 1)[1])   # noqa: S307 - our own repr of a list
    assert len(msgs) == 1, line          # once, not once per call
    assert "nothing is sharded" in msgs[0]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in msgs[0]
    assert "before jax is imported" in msgs[0]


def test_one_device_chosen_of_eight_says_nothing():
  """One device picked out of eight (as many tests do) is the user's choice:
  no warning, and it does not use up the once-per-process flag."""
  tx = z1.zero1(optax.sgd(0.1), axis_name="data", check_elementwise=False)
  with warnings.catch_warnings():
    warnings.simplefilter("error", one_device.OneDeviceWarning)
    z1.init(tx, {"w": jax.numpy.ones(3)}, mesh(1))
  assert not one_device._said
