"""jax 0.12.1's persistent compilation cache and multi-process CPU jobs.

On jax 0.12.1 a multi-process job on the CPU backend (gloo) hangs on the
first computation with a collective that it reads back from JAX's persistent
compilation cache: every process waits in the collective, none fails. The
first run of a program compiles and fills the cache and completes; the next
run of the same program never does. jax 0.12.0.1 and 0.10.2 run both (a
shard_map ``psum``, ``all_gather`` or ``psum_scatter`` over 2 processes x 2
CPU devices, run twice with ``JAX_COMPILATION_CACHE_DIR`` set).

Where a multi-process CPU job has that cache on, :func:`turn_off_if_it_hangs`
turns it off for the process (its steps then compile afresh) and says so. A
jax release before 0.12.1 keeps it; GPU and TPU jobs keep it.
"""

from __future__ import annotations

import logging

import jax

log = logging.getLogger("zero1_jax")

HANGS_FROM = (0, 12, 1)   # the first jax seen hanging; no later one is known fixed

NOTE = (
    "the persistent compilation cache ({where}) is off in this "
    "multi-process CPU job: on jax {version} a step read back from it waits "
    "in its collectives for ever (seen from jax 0.12.1; 0.12.0.1 and earlier "
    "run it), so every process compiles its steps afresh. To keep the cache, "
    "use jax 0.12.0.1; on GPUs and TPUs it stays on.")


def hangs(version: tuple = tuple(jax.__version_info__)) -> bool:
  """Whether this jax is one that hangs on cached multi-process CPU steps."""
  return tuple(version[:3]) >= HANGS_FROM


def turn_off_if_it_hangs() -> bool:
  """After joining a multi-process job (before its first compile): turns
  JAX's persistent compilation cache off where this jax hangs on a
  multi-process CPU step read from it, with one note from process 0.
  Returns whether it did."""
  where = jax.config.jax_compilation_cache_dir
  if not where or not jax.config.jax_enable_compilation_cache or not hangs():
    return False
  if jax.process_count() == 1 or jax.default_backend() != "cpu":
    return False
  jax.config.update("jax_enable_compilation_cache", False)
  if jax.process_index() == 0:
    log.warning(NOTE.format(where=where, version=jax.__version__))
  return True
