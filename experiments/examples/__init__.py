"""Small training programs written the way Flax users write them, each run
with plain optax and with zero1 changing only the optimizer line
(tests/test_flax_programs.py trains them against each other)."""
