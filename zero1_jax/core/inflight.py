"""Bounded steps in flight on simulated CPU devices (issue #33, item 6).

Why: jax dispatches a jitted step and returns at once, so a Python loop that
never reads a result enqueues step after step. XLA's CPU client launches
each device's part of a program from a thread pool and admits at most 32
programs per device at a time (``CpuClientOptions::
max_inflight_computations_per_device``, a semaphore taken at launch). With
more than 32 steps queued, launches run out of order under load: a device's
slots fill with *later* steps, which wait for this step's outputs, while
this step's launch on that device waits for a slot. The other devices sit in
this step's collective rendezvous (``reduce scatter RendezvousKey...``) until
XLA's 40 s ``xla_cpu_collective_call_terminate_timeout_seconds`` aborts the
process. Measured (experiments/probes/rendezvous.py, gdb on a stuck run): 7 device
threads in ``InProcessCommunicator::ReduceScatter``, the 8th launch in
``CpuPjRtRawLoadedExecutable::Execute -> Semaphore::Acquire``, the process
idle: a deadlock, so raising the timeout only delays the abort.

The fix: never let more than :data:`STEPS_IN_FLIGHT` steps be outstanding:
every ``k``-th call blocks on that call's outputs. ``k = 8``: a quarter of
the 32 slots, so the slots never fill even with a few other programs (a
``device_put``, an eager op on the outputs) enqueued per step; blocking
once every 8 steps leaves 7 of 8 dispatches overlapped with the devices'
work. Only on CPU with more than one device in the outputs (no rendezvous
otherwise; GPUs and TPUs have no such limit), and ``ZERO1_CPU_STEPS_IN_FLIGHT``
(0: unbounded) overrides ``k``.

>>> import jax, jax.numpy as jnp, zero1_jax as z1
>>> step = z1.bounded(jax.jit(lambda x: x + 1))
>>> float(step(jnp.zeros(())))
1.0
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax

XLA_CPU_MAX_IN_FLIGHT = 32   # XLA CpuClientOptions' default, per device
STEPS_IN_FLIGHT = 8


def steps_in_flight() -> int:
  """The bound (0: none): ``ZERO1_CPU_STEPS_IN_FLIGHT`` or 8."""
  return int(os.environ.get("ZERO1_CPU_STEPS_IN_FLIGHT", STEPS_IN_FLIGHT))


def _on_cpu_devices(out: Any) -> bool:
  """Whether ``out``'s arrays span more than one CPU device."""
  for x in jax.tree.leaves(out):
    if isinstance(x, jax.Array):
      devs = x.sharding.device_set
      if len(devs) > 1 and next(iter(devs)).platform == "cpu":
        return True
  return False


class Bounded:
  """``fn`` that blocks on its outputs every ``every``-th call when they live
  on several CPU devices; the rest (``lower``, ``trace``...) is ``fn``'s."""

  def __init__(self, fn: Callable, every: int | None = None):
    self._fn = fn
    self._every = steps_in_flight() if every is None else int(every)
    self._calls = 0

  def __call__(self, *args, **kwargs):
    out = self._fn(*args, **kwargs)
    self._calls += 1
    if self._every > 0 and self._calls % self._every == 0 \
        and _on_cpu_devices(out):
      jax.block_until_ready(out)
    return out

  def __getattr__(self, name):
    return getattr(self._fn, name)


def bounded(fn: Callable, every: int | None = None) -> Bounded:
  """``fn`` (a jitted step) with at most ``every`` (default 8, see the
  module's docstring) calls in flight on simulated CPU devices: the one-line
  fix for a plain-jit training loop there, ``step = z1.bounded(jax.jit(step))``
  (``z1.train_step`` and zero1-train do it themselves)."""
  return Bounded(fn, every)
