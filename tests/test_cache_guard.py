"""jax 0.12.1 hangs a multi-process CPU job on a step it reads back from the
persistent compilation cache (zero1_jax/distributed/cache_guard.py): joining
such a job turns the cache off, with one note naming it and the jax that
keeps it. Everywhere else the cache stays as the user set it.

Seen on this machine: two 2-process zero1-train runs into one
JAX_COMPILATION_CACHE_DIR, the second hangs in its first step on jax 0.12.1
(both processes waiting in the collective) and completes on 0.12.0.1 and
0.10.2; a shard_map psum alone hangs the same way. The multi-process tests
(tests/test_distributed.py, tests/test_launchers.py) share one cache across
their runs (tests/conftest.py), so on jax 0.12.1 they hang without this.
"""

import logging

import jax
import pytest

from zero1_jax import distributed
from zero1_jax.distributed import cache_guard


@pytest.mark.parametrize("version,hangs", [
    ((0, 10, 2), False), ((0, 12, 0), False), ((0, 12, 1), True),
    ((0, 13, 0), True)])
def test_the_jax_versions_that_hang(version, hangs):
  assert cache_guard.hangs(version) is hangs


@pytest.fixture
def job(monkeypatch, tmp_path):
  """A 2-process CPU job on a jax that hangs, with the cache on in
  ``tmp_path``; the cache settings restored afterwards."""
  before = (jax.config.jax_compilation_cache_dir,
            jax.config.jax_enable_compilation_cache)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  jax.config.update("jax_enable_compilation_cache", True)
  monkeypatch.setattr(cache_guard, "hangs", lambda: True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  yield tmp_path
  jax.config.update("jax_compilation_cache_dir", before[0])
  jax.config.update("jax_enable_compilation_cache", before[1])


def test_a_multi_process_cpu_job_turns_the_cache_off_and_says_so(job, caplog):
  with caplog.at_level(logging.WARNING, logger="zero1_jax"):
    assert cache_guard.turn_off_if_it_hangs() is True
  assert jax.config.jax_enable_compilation_cache is False
  (note,) = [r.getMessage() for r in caplog.records]
  assert f"the persistent compilation cache ({job}) is off" in note
  assert f"on jax {jax.__version__}" in note and "0.12.0.1" in note


def test_process_0_says_it_once_for_the_job(job, monkeypatch, caplog):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  with caplog.at_level(logging.WARNING, logger="zero1_jax"):
    assert cache_guard.turn_off_if_it_hangs() is True
  assert jax.config.jax_enable_compilation_cache is False
  assert not caplog.records


@pytest.mark.parametrize("case", ["one process", "jax that runs it",
                                  "no cache dir", "cache off already"])
def test_the_cache_stays_where_nothing_hangs(job, monkeypatch, caplog, case):
  if case == "one process":
    monkeypatch.setattr(jax, "process_count", lambda: 1)
  elif case == "jax that runs it":
    monkeypatch.setattr(cache_guard, "hangs", lambda: False)
  elif case == "no cache dir":
    jax.config.update("jax_compilation_cache_dir", None)
  else:
    jax.config.update("jax_enable_compilation_cache", False)
  on = jax.config.jax_enable_compilation_cache
  with caplog.at_level(logging.WARNING, logger="zero1_jax"):
    assert cache_guard.turn_off_if_it_hangs() is False
  assert jax.config.jax_enable_compilation_cache is on
  assert not caplog.records


def test_joining_a_job_runs_the_guard(monkeypatch):
  """z1.distributed.initialize (zero1-train and z1.initialize join through
  it) checks once the job is joined, before any step compiles."""
  calls = []
  monkeypatch.setattr(distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(distributed.jax.distributed, "initialize",
                      lambda **kw: None)
  monkeypatch.setattr(cache_guard, "turn_off_if_it_hangs",
                      lambda: calls.append(1) or False)
  assert distributed.initialize("127.0.0.1:1", num_processes=2, process_id=0)
  assert calls == [1]
