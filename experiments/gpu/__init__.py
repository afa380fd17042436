"""GPUs: every form's step compiled for 8 to 64 NVIDIA GPUs on a machine
without one (``python -m experiments.gpu.aot``, XLA's cost model; what it
charges each collective alone: ``python -m experiments.gpu.collective_costs``), the
numerical checks against unsharded optax on real devices
(``python -m experiments.gpu.exact``), the same steps run and timed on a real
GPU beside XLA's estimate (``python -m experiments.gpu.measure``), and
``bash experiments/gpu/check.sh``, which runs those checks, the CLI and the
benchmark on one GPU (``check.sh steps``: the timed steps alone).
"""
