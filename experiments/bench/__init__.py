"""The ZeRO-1 benchmark: memory, communication and speed beside DDP and GSPMD.

  python -m experiments.bench --out experiments/results   # make bench
  python -m experiments.bench --quick --out /tmp/bench    # a smoke run

``run`` (the entry point and the sections in order), ``plan`` (what is
measured: methods, model sizes, :class:`~experiments.bench.plan.Plan`,
compiled steps, the theory), ``sections`` (the measurements), ``overhead``
(each method above the no-communication floor, and ZeRO-1 vs ZeRO-2),
``report`` (targets and tables) and ``plots``. The baselines it measures
against are :mod:`experiments.baselines`. Nothing here imports jax until a
module below is imported (``__main__`` sets up devices first).
"""
