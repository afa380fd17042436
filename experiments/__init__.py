"""What zero1_jax is measured, checked and shown with; run from the
repository (``python -m experiments.<...>``), never installed.

* :mod:`experiments.bench`: the benchmark, memory, communication and speed
  of ZeRO-1 beside DDP and GSPMD (``make bench``);
* :mod:`experiments.baselines`: those baselines (DDP, GSPMD, the
  no-communication floor), shared by the benchmark, ``gpu`` and the tests;
* :mod:`experiments.gpu`: steps compiled for 8-64 GPUs without one
  (``gpu.aot``), the numerical checks on a real GPU (``gpu.exact``) and the
  one-GPU run (``gpu/check.sh``);
* :mod:`experiments.probes`: one question each, answered by measuring
  (a collective's cost, the forms side by side, bytes a step writes,
  plain jit vs ``train_step``, a peak's breakdown, CPU rendezvous under load,
  start-up cost, ZeRO-1 vs ZeRO-2);
* :mod:`experiments.testing`: the test suite examined (planted bugs,
  tolerances under other XLA code, optax's outcomes table, ``make test``
  under load);
* :mod:`experiments.deepspeed_ref`: DeepSpeed itself, in a torch venv
  (parity fixtures recorded, its config parser probed, a peer benchmark);
* :mod:`experiments.examples`: training programs as users write them
  (Flax linen and nnx, a ported DeepSpeed script);
* ``configs/``: DeepSpeed JSON configs (``make demo``); ``results/``: what
  the runs above recorded (docs/results.md reads them).
"""
