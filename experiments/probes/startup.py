"""Start-up cost of zero1's elementwise check on a bert-large-sized tree:
the first process (cold: the check runs), a second process (its verdict read
from the disk cache, core/verdicts.py), and with the cache off, without a
mesh and inside ``jax.set_mesh`` of 8 devices (where users call ``tx.init``).
Each run is a fresh Python process, timed inside it around the check alone.

  python -m experiments.probes.startup      # prints one line per run
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import contextlib, json, os, time, jax, jax.numpy as jnp, optax
from zero1_jax.core import elementwise as ew
from zero1_jax.models import bert
cfg = bert.make_config("bert-large-uncased", vocab_size=30522, max_len=512)
shapes = jax.eval_shape(lambda k: bert.init_params(cfg, k), jax.random.key(0))
leaves = len(jax.tree.leaves(shapes))
mesh = (jax.set_mesh(jax.make_mesh((8,), ("data",))) if os.environ["MESH"] == "1"
        else contextlib.nullcontext())
t = time.perf_counter()
with mesh:
  ew.check_elementwise(optax.adamw(2e-5, weight_decay=0.01), shapes, 8)
print(json.dumps({"seconds": time.perf_counter() - t, "leaves": leaves}))
"""


def run(cache: str, mesh: bool = False) -> dict:
  env = {**os.environ, "ZERO1_VERDICT_CACHE": cache, "JAX_PLATFORMS": "cpu",
         "MESH": "1" if mesh else "0",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True,
                       capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def main() -> None:
  with tempfile.TemporaryDirectory() as d:
    for what, cache, mesh in (("first process (cold)", d, False),
                              ("second process (disk cache)", d, False),
                              ("cache off", "0", False),
                              ("cache off, in jax.set_mesh", "0", True)):
      r = run(cache, mesh)
      print(f"{what:30s} {r['seconds']:7.3f} s  ({r['leaves']} leaves)")


if __name__ == "__main__":
  main()
