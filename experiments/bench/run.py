"""Memory, communication and speed of ZeRO-1, measured beside DDP and GSPMD.

One model (the BERT MLM of :mod:`zero1_jax.models.bert` on the byte-level data of
:mod:`zero1_jax.data`), one process, four training steps built from the same
``optax.adamw``, parameters and batches:

* ``zero1_rs``: ``zero1_jax`` with ``reduce="reduce_scatter"`` (the default);
* ``zero1_ar``: ``zero1_jax`` with ``reduce="all_reduce"`` (DeepSpeed's
  ``reduce_scatter: false``);
* ``ddp``: replicated params and optax state, ``pmean``'d gradients
  (:func:`experiments.baselines.ddp_train_step`);
* ``gspmd``: a plain ``jax.jit`` step with the optax state sharded over the
  data axis and the collectives left to the partitioner
  (:func:`experiments.baselines.gspmd_train_step`).

Sections (each a function of :mod:`experiments.bench.sections` that returns
plain JSON-able dicts):

* :func:`state_section`: per-device bytes of optimizer state + master weights
  from ``addressable_shards`` at N = 1, 2, 4, 8, vs 12 Psi / N;
* :func:`memory_section`: compiled per-device memory of the whole donating
  step (``memory_analysis``) vs the ZeRO paper's model-state prediction, fp32
  and bf16; its compiled steps also give the collectives per N;
* :func:`collective_section`: collective ops and bytes per step, read from
  the optimized HLO, vs the ring-traffic theory;
* :func:`speed_section`: interleaved step times (median of repeats) at the
  largest N for several model sizes, and how time and memory grow with Psi;
* :func:`bucket_section`: collective count and step time vs ``bucket_bytes``;
* :func:`overhead_section` (:mod:`experiments.bench.overhead`): each method's
  step time above the no-communication floor, peaks, and the bytes each step
  writes (from the optimized HLO), at N = 2 and 8, ZeRO-2 included;
* :func:`stage2_section`: ZeRO-1 vs ZeRO-2 compiled peaks without and with
  4-step accumulation, and their step-time ratio;
* :func:`adam_bandwidth_section` (``--adam-bw``): bytes an Adam update moves
  per second vs the memory roofline (for the GPU check).

Run (CPU, 8 simulated devices; about 5 minutes on 2 cores)::

    python -m experiments.bench --out experiments/results
    python -m experiments.bench --quick          # seconds, for a smoke test

It writes ``bench.json``, ``tables.md`` and PNG plots to ``--out``.

This module holds the entry point (:func:`run`, :func:`main`; ``python -m
experiments.bench`` runs :func:`main` from ``__main__.py``, which first sets
up the simulated devices) and re-exports the names of the modules it is
split into: :mod:`experiments.bench.plan`
(constants, :class:`Plan`, models, batches, compiled steps, theory),
:mod:`experiments.bench.sections` (the measurements),
:mod:`experiments.bench.report` (:func:`targets`, :func:`tables`) and
:mod:`experiments.bench.plots` (:func:`plots`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform as _pyplatform
import sys
import time
from typing import Any

import jax
import numpy as np
import optax

# Re-exported: tests and scripts use them as ``experiments.bench.run.<name>``.
from experiments.bench.overhead import overhead_section, stage2_section  # noqa: F401
from experiments.bench.plots import plots  # noqa: F401
from experiments.bench.report import tables, targets  # noqa: F401
from experiments.bench.sections import (  # noqa: F401
    activation_bytes, adam_bandwidth_section, bucket_section, collective_section,
    memory_section, speed_section, state_section, time_interleaved)
from experiments.bench.plan import (  # noqa: F401
    _BUILT, COLORS, DEFAULT_BUCKET, DTYPES, K, LABELS, METHODS, QUICK, SIZES, Built,
    Model, Plan, batch, build, device_batch, make_mesh, model, model_state_theory,
    optimizer, sharded_state_theory, state_master_theory, traffic_theory)


def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, float) and x != x:
    return None
  return x


def run(plan: Plan, out: str | None = None, sections: tuple[str, ...] | None = None,
        log=print) -> dict:
  """Runs the sections of ``plan``; writes json, tables and plots to ``out``."""
  sections = sections or ("state", "memory", "speed", "overhead", "stage2",
                          "buckets") + (
      ("adam_bw",) if plan.adam_bw_psi else ())
  t_all = time.perf_counter()
  res: dict[str, Any] = {"plan": dataclasses.asdict(plan), "timing_s": {}}
  res["meta"] = dict(
      jax=jax.__version__, optax=optax.__version__, backend=jax.default_backend(),
      devices=jax.device_count(), device_kind=jax.devices()[0].device_kind,
      cpu_count=os.cpu_count(), python=_pyplatform.python_version(),
      machine=_pyplatform.machine(), command=" ".join(["python -m experiments.bench"]
                                                      + sys.argv[1:]),
      xla_flags=os.environ.get("XLA_FLAGS", ""),
      models={s: dict(SIZES[s], psi=model(s, "fp32", plan.seq_len).psi)
              for s in dict.fromkeys((plan.state_size, plan.bucket_size) + plan.speed_sizes)})
  def memory_and_collectives(plan, log):
    mem, coll = memory_section(plan, log)
    return {"memory": mem, "collectives_all_n": coll,
            "collectives": collective_section(coll, max(plan.ns))}

  steps = (  # section, log line, fn(plan, log) -> {result key: value}
      ("state", "state bytes", lambda p, l: {"state": state_section(p, l)}),
      ("memory", "compiled memory and collectives", memory_and_collectives),
      ("speed", "step times", lambda p, l: {"speed": speed_section(p, l)}),
      ("overhead", "overhead above the floor",
       lambda p, l: {"overhead": overhead_section(p, l)}),
      ("stage2", "ZeRO-1 vs ZeRO-2", lambda p, l: {"stage2": stage2_section(p, l)}),
      ("buckets", "bucket sweep", lambda p, l: {"buckets": bucket_section(p, l)}),
      ("adam_bw", "adam bandwidth",
       lambda p, l: {"adam_bw": adam_bandwidth_section(p, l)}),
  )
  for name, what, fn in steps:
    if name in sections:
      t = time.perf_counter()
      log(f"{what} ...")
      res.update(fn(plan, log))
      res["timing_s"][name] = time.perf_counter() - t
  res["targets"] = targets(res)
  _BUILT.clear()
  res["timing_s"]["total"] = time.perf_counter() - t_all
  res = _jsonable(res)
  if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.json"), "w") as f:
      json.dump(res, f, indent=1)
    with open(os.path.join(out, "tables.md"), "w") as f:
      f.write(tables(res))
    res["plots"] = plots(res, out)
  return res


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(prog="python -m experiments.bench",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
  ap.add_argument("--out", default="experiments/results")
  ap.add_argument("--platform", default="cpu",
                  help="cpu (8 simulated devices, set before jax starts) or anything "
                       "else to use jax's default backend as is")
  ap.add_argument("--ns", default=None, help="comma list of device counts, e.g. 1,2,4,8")
  ap.add_argument("--sections", default=None,
                  help="comma list of: state,memory,speed,overhead,stage2,buckets,adam_bw")
  ap.add_argument("--state-size", default=None, choices=sorted(SIZES))
  ap.add_argument("--speed-sizes", default=None, help="comma list of model sizes")
  ap.add_argument("--ratio-sizes", default=None, help="comma list of model sizes")
  ap.add_argument("--bucket-size", default=None, choices=sorted(SIZES))
  ap.add_argument("--seq-len", type=int, default=None)
  ap.add_argument("--global-batch", type=int, default=None)
  ap.add_argument("--per-device-batch", type=int, default=None)
  ap.add_argument("--speed-budget", type=float, default=None, help="seconds per size")
  ap.add_argument("--adam-bw-psi", type=int, default=None,
                  help="parameters for the Adam bandwidth section (0 = skip)")
  ap.add_argument("--hbm-tb-s", type=float, default=None)
  a = ap.parse_args(argv)
  plan = QUICK if a.quick else Plan()
  over = {}
  if a.ns:
    over["ns"] = tuple(int(x) for x in a.ns.split(","))
  for key, val in (("state_size", a.state_size), ("bucket_size", a.bucket_size),
                   ("seq_len", a.seq_len), ("global_batch", a.global_batch),
                   ("per_device_batch", a.per_device_batch),
                   ("speed_budget_s", a.speed_budget), ("adam_bw_psi", a.adam_bw_psi),
                   ("hbm_tb_s", a.hbm_tb_s)):
    if val is not None:
      over[key] = val
  if a.speed_sizes:
    over["speed_sizes"] = tuple(a.speed_sizes.split(","))
  if a.ratio_sizes:
    over["ratio_sizes"] = tuple(a.ratio_sizes.split(","))
  plan = dataclasses.replace(plan, **over)
  sections = tuple(a.sections.split(",")) if a.sections else None
  res = run(plan, a.out, sections)
  print(tables(res))
  print(f"wrote {a.out}/bench.json, tables.md, " + ", ".join(
      os.path.basename(p) for p in res.get("plots", [])) +
      f" in {res['timing_s']['total']:.0f}s")
  return res
