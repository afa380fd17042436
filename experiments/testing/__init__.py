"""The test suite examined (docs/testing.md): planted bugs the tests must
catch (``python -m experiments.testing.mutate``, ``make mutate``), the worst
error each tolerance sees under other XLA:CPU code (``tolerance_sweep``,
``make tolerances`` -> docs/tolerances.md), optax's own tests through zero1 as
a table (``optimizer_table`` -> docs/optimizers.md), and ``make test`` from a
clean clone under load (``bash experiments/testing/load_check.sh``).
"""
