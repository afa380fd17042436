"""What each data-parallel method costs above the no-communication floor.

The floor (:func:`experiments.baselines.floor_train_step`) is forward,
backward and a local SGD step with no collective: every method does at least
that. For each N in ``plan.overhead_ns`` the methods are compiled for the same
model and batch and timed interleaved; a method's *overhead* is its step time
minus the floor's in the same round (median over rounds). Beside it: the
compiled per-device peak, and the bytes the step writes to memory per device
(:mod:`experiments.probes.hlo_bytes`, from the optimized HLO), where bucket copies,
padded copies and unpacking slices show.

ZeRO-1 moves the same bytes as DDP and does 1/N of its Adam work, so its
overhead should be below DDP's, and far below at large N.
"""
from __future__ import annotations

import statistics

import zero1_jax as z1
from experiments.bench import plan as bs
from experiments.bench.sections import _summary, time_interleaved
from experiments.probes.hlo_bytes import written

# method label -> (bench_setup method, extra build keywords)
VARIANTS = {
    bs.FLOOR: (bs.FLOOR, {}),
    "zero1_rs": ("zero1_rs", {}),
    "zero1_in_place": ("zero1_rs", {"inplace_bytes": 1 << 16}),
    "zero2": ("zero2", {}),
    "ddp": ("ddp", {}),
    "gspmd": ("gspmd", {}),
}


def overhead_section(plan: bs.Plan, log=print) -> list[dict]:
  """One row per N: times, overheads above the floor, peaks, bytes written."""
  rows = []
  m = bs.model(plan.state_size, "fp32", plan.seq_len)
  for n in plan.overhead_ns:
    batches = [bs.device_batch(bs.batch(plan.per_device_batch * n, plan.seq_len, s), n)
               for s in range(4)]
    builts = {}
    for label, (method, kw) in VARIANTS.items():
      # keep: the memory section's compiles of the same model and batch
      # shape are reused (their params have moved on; shapes have not).
      builts[label] = bs.build(method, m, n, batches[0], keep=True, **kw)
    times = time_interleaved(builts, batches, plan)
    floor = times[bs.FLOOR]
    over = {k: [t - f for t, f in zip(v, floor)] for k, v in times.items()
            if k != bs.FLOOR}
    med = {k: statistics.median(v) for k, v in over.items()}
    mem = {k: z1.inspect.memory(b.compiled) for k, b in builts.items()}
    wrote = {k: written(b.compiled.as_text()) for k, b in builts.items()}
    state = z1.inspect.device_bytes(builts["zero1_rs"].state)
    row = dict(
        n=n, size=plan.state_size, psi=m.psi, grad_bytes=4 * m.psi,
        per_device_batch=plan.per_device_batch, seq_len=plan.seq_len,
        times={k: _summary(v) for k, v in times.items()},
        overhead_ms={k: 1e3 * v for k, v in med.items()},
        zero1_over_ddp_overhead=med["zero1_rs"] / med["ddp"] if med["ddp"] > 0 else None,
        memory=mem, zero1_sharded_state=state,
        written={k: w.total for k, w in wrote.items()},
        written_top={k: w.large[:4] for k, w in wrote.items()})
    rows.append(row)
    log(f"  overhead N={n} ({row['times']['ddp']['n']} rounds): floor="
        f"{row['times'][bs.FLOOR]['median'] * 1e3:.1f}ms; above it " +
        ", ".join(f"{k}={v:.2f}ms" for k, v in row["overhead_ms"].items()) +
        f"; zero1/ddp overhead={_ratio_text(row['zero1_over_ddp_overhead'])}"
        "; written MB " +
        ", ".join(f"{k}={v / 1e6:.1f}" for k, v in row["written"].items()))
    del builts
  return rows


def _ratio_text(ratio: float | None) -> str:
  """The ratio, or why there is none: on a loaded machine a tiny model's DDP
  step can time at or below the floor, leaving no overhead to divide by."""
  return f"{ratio:.3f}" if ratio is not None else "n/a (DDP not above the floor)"


def stage2_section(plan: bs.Plan, log=print) -> list[dict]:
  """Compiled peaks of ZeRO-1 and ZeRO-2 at N = max(ns) without and with
  4-step accumulation, and stage 2 / stage 1 step time
  (:func:`experiments.probes.zero2_compare.compare`)."""
  from experiments.probes.zero2_compare import compare
  rows = compare(plan.state_size, max(plan.ns), (1, 4), seq_len=plan.seq_len,
                 per_device_batch=plan.per_device_batch, rounds=plan.min_rounds,
                 warmup=plan.warmup)
  for r in rows:
    log(f"  stage2 accum={r['accum']}: peak ZeRO-1 {r['peak1'] / 1e6:.3f} MB, "
        f"ZeRO-2 {r['peak2'] / 1e6:.3f} MB, time 2/1 {r['time_ratio']:.3f}")
  return rows


def stage2_targets(rows: list[dict]) -> list[dict]:
  out = []
  for r in rows:
    g, n = r["grad_bytes"], r["n"]
    if r["accum"] == 1 and r["floor_peak"]:
      budget = r["floor_peak"] + r["state_bytes"] + 0.3 * g
      out.append(dict(
          target=f"ZeRO-2 peak <= floor peak + sharded state + 0.3 x gradient bytes "
                 f"at N={n}",
          value=r["peak2"] / budget,
          detail=f"{r['peak2']} B vs {budget:.0f} B", met=r["peak2"] <= budget))
    if r["accum"] > 1:
      want = 0.8 * (1 - 1 / n) * g
      saved = r["peak1"] - r["peak2"]
      out.append(dict(
          target=f"ZeRO-2 peak below ZeRO-1's by >= 0.8 (1-1/N) x gradient bytes "
                 f"with {r['accum']}-step accumulation at N={n}",
          value=saved / want,
          detail=f"saved {saved} B vs {want:.0f} B (ZeRO-1 {r['peak1']} B, ZeRO-2 "
                 f"{r['peak2']} B)", met=saved >= want))
  return out


def stage2_table(rows: list[dict]) -> list[str]:
  if not rows:
    return []
  r0 = rows[0]
  lines = [f"### ZeRO-1 vs ZeRO-2 (model `{r0['size']}`, N={r0['n']}, fp32)", "",
           "| accumulation | ZeRO-1 peak MB | ZeRO-2 peak MB | saved / gradient bytes "
           "| floor peak MB | ZeRO-2 / ZeRO-1 step time |", "|---|---|---|---|---|---|"]
  for r in rows:
    fl = "-" if not r["floor_peak"] else f"{r['floor_peak'] / 1e6:.3f}"
    lines.append(f"| {r['accum']} | {r['peak1'] / 1e6:.3f} | {r['peak2'] / 1e6:.3f} "
                 f"| {(r['peak1'] - r['peak2']) / r['grad_bytes']:.3f} | {fl} "
                 f"| {r['time_ratio']:.3f} |")
  lines.append("")
  return lines


def overhead_targets(rows: list[dict]) -> list[dict]:
  """Issue #12's targets for the overhead section."""
  out = []
  for r in rows:
    lim = 1.0 if r["n"] <= 2 else 0.5
    ratio = r["zero1_over_ddp_overhead"]
    out.append(dict(
        target=f"ZeRO-1 overhead above the floor <= {lim} x DDP's at N={r['n']}",
        value=ratio if ratio is not None else float("nan"),
        detail=f"ZeRO-1 {r['overhead_ms']['zero1_rs']:.2f} ms vs DDP "
               f"{r['overhead_ms']['ddp']:.2f} ms above a "
               f"{r['times']['floor']['median'] * 1e3:.1f} ms floor (medians of "
               f"per-round differences)",
        met=ratio is not None and ratio <= lim))
    floor_peak = r["memory"]["floor"]["peak"]
    budget = floor_peak + r["zero1_sharded_state"] + 0.3 * r["grad_bytes"]
    for k in ("zero1_rs", "zero1_in_place", "zero2"):
      peak = r["memory"][k]["peak"]
      out.append(dict(
          target=f"{k} peak <= floor peak + sharded state + 0.3 x gradient bytes "
                 f"at N={r['n']}",
          value=peak / budget,
          detail=f"{peak} B vs {budget:.0f} B (floor {floor_peak} B, state "
                 f"{r['zero1_sharded_state']} B, gradients {r['grad_bytes']} B)",
          met=peak <= budget))
  return out


def overhead_table(rows: list[dict]) -> list[str]:
  """Markdown lines for :func:`zero1_jax` bench's tables."""
  if not rows:
    return []
  names = [k for k in rows[0]["times"]]
  r0 = rows[0]
  lines = [f"### Overhead above the no-communication floor (model `{r0['size']}`, "
           f"Psi = {r0['psi']:,}, fp32, {r0['per_device_batch']} x {r0['seq_len']} "
           "tokens per device)", "",
           "Floor = forward + backward + local SGD, no collective. Overhead = step time "
           "minus the floor's in the same round (median over rounds). written = bytes "
           "the compiled step writes per device (optimized HLO, ENTRY instructions). "
           "`zero1_rs`: ZeRO-1 with its default `inplace_bytes=\"auto\"` (on CPU: "
           "every leaf packed into buckets, 2 collectives); `zero1_in_place`: leaves "
           "of >= 64 KiB reduced and gathered in place, one collective each (the "
           "GPU/TPU default); `zero2`: in place as well.", "",
           "| N | method | step ms | overhead ms | overhead / DDP's | peak MB | written MB |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    for k in names:
      o = r["overhead_ms"].get(k)
      rel = "" if o is None or not r["overhead_ms"]["ddp"] else \
          f"{o / r['overhead_ms']['ddp']:.3f}"
      lines.append(f"| {r['n']} | {k} | {r['times'][k]['median'] * 1e3:.1f} "
                   f"| {'-' if o is None else format(o, '.2f')} | {rel} "
                   f"| {r['memory'][k]['peak'] / 1e6:.3f} | {r['written'][k] / 1e6:.2f} |")
  lines.append("")
  return lines
