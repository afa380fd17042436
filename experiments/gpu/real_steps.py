"""What experiments/gpu/nanodo_step.py and lm1b_step.py share: published
programs' own steps, compiled for H100s with optax and with zero1.

``stub_unused`` stands in for the modules a program imports but its step
never reads (data pipelines, logging); ``measure`` compiles one lowered step
on the compile-only topology (XLA's cost model and ``memory_analysis()``);
``table`` prints optax's and zero1's side by side, with zero1's peak against
optax's less the state zero1 shards.
"""
from __future__ import annotations

import sys
import tempfile
import types
from typing import Any, Callable, Sequence

from experiments.gpu import aot   # first: it keeps jax off the GPU backend

import zero1_jax as z1  # noqa: E402
from zero1_jax.inspect import gpu, schedule as sched  # noqa: E402


class _Inert(type):
  """A class whose every attribute is itself (``tf.data.Dataset`` in an
  annotation)."""

  def __getattr__(cls, name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    return cls


class _Unused(types.ModuleType):
  """A module the step never reads: any attribute is an inert class."""

  def __getattr__(self, name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    return _Inert(name, (), {"__init__": lambda self, *a, **k: None})


def stub_unused(names: Sequence[str]) -> None:
  """Stands in for modules a program imports but its step never reads
  (``names`` lists parents before their children)."""
  for name in names:
    sys.modules.setdefault(name, _Unused(name))
  for name in names:
    parent, _, child = name.rpartition(".")
    if parent:
      setattr(sys.modules[parent], child, sys.modules[name])


def xla_options(text: str) -> dict:
  """``--xla KEY=VALUE,...``: more XLA options for both steps (as
  ``jax.jit(..., compiler_options=...)`` gives them)."""
  return aot.key_values(text)


def measure(lowered: Callable, program: Any, gpus: int, zero1: bool,
            xla: dict | None = None) -> dict:
  """``lowered(program, gpus, zero1) -> (Lowered, param count)``, compiled
  (with ``xla``'s options too): XLA's estimated step and exposed collective
  time (µs), the collectives ``{kind: (count, bytes)}``, arguments and peak
  per GPU (bytes)."""
  low, psi = lowered(program, gpus, zero1)
  with tempfile.TemporaryDirectory() as d:
    compiled, schedule = gpu.compile(low, {**aot.OPTIONS, **(xla or {})}, dump_to=d)
  s = sched.summary(schedule)
  mem = z1.inspect.memory(compiled)
  return {"step_us": s.step_us, "exposed_us": s.exposed_us, "psi": psi,
          "collectives": {k: (v.count, v.bytes)
                          for k, v in z1.inspect.hlo_collectives(compiled.as_text()).items()},
          "argument": mem["argument"], "peak": mem["peak"]}


def table(title: str, lowered: Callable, program: Any, gpus: Sequence[int],
          state_bytes: int, zero1_only: bool = False, xla: dict | None = None) -> None:
  """Prints optax's and zero1's step per GPU count (``zero1_only``: zero1's
  alone); the line: optax's peak less ``state_bytes`` a param, ``(1 -
  1/N)`` of them (the state zero1 shards)."""
  mib, nan = 2 ** 20, float("nan")
  print(f"{title}; XLA's cost model (µs) and memory_analysis (MiB per GPU)")
  print(f"{'GPUs':>4} {'optimizer':9} {'step':>8} {'/ optax':>8} {'exposed':>8} "
        f"{'arguments':>10} {'peak':>8} {'line':>8}  collectives (count, MiB)")
  for n in gpus:
    base = None if zero1_only else measure(lowered, program, n, False, xla)
    ours = measure(lowered, program, n, True, xla)
    line = nan if base is None else base["peak"] - state_bytes * base["psi"] * (1 - 1 / n)
    for name, r in (("optax", base), ("zero1", ours)):
      if r is None:
        continue
      colls = ", ".join(f"{k} {c} x {b / mib:,.1f}"
                        for k, (c, b) in sorted(r["collectives"].items()))
      ratio = nan if base is None else r["step_us"] / base["step_us"]
      print(f"{n:4d} {name:9} {r['step_us']:8,.0f} {ratio:8.3f} "
            f"{r['exposed_us']:8,.0f} {r['argument'] / mib:10,.1f} {r['peak'] / mib:8,.1f} "
            f"{(line / mib if r is ours else nan):8,.1f}  {colls}", flush=True)
