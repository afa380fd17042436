"""``make mutate``'s planted bugs still apply to the code they plant into.

Each mutant is a text that must occur exactly once in its file
(experiments/testing/mutate.py). Code moved under one (the fp16 skip, into the
offload split) and ``make mutate`` failed before planting anything; this
says so in the fast suite instead, naming the mutant to update.
"""
import pathlib

import pytest

from experiments.testing import mutate

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("m", mutate.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_applies_once_and_names_tests_that_exist(m):
  mutate.check(m)
  files = [t.split("::")[0] for t in m.tests if t.startswith("tests/")]
  assert files, f"{m.name}: no test file to run"
  for f in files:
    assert (ROOT / f).is_file(), f"{m.name}: {f} does not exist"
