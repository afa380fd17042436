"""Small training programs written the way Flax users write them, each run
with plain optax and with zero1 changing only the optimizer line
(tests/test_flax_programs.py trains them against each other): a linen LM
with logical axis rules (``linen_lm``), an nnx LM with ``nnx.Optimizer``
(``nnx_lm``), a linen model with zero1's TrainState in a shard_map step
(``flax_linen``), and a DeepSpeed script ported to JAX (``deepspeed_port/``).
"""
