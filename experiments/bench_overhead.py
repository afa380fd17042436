"""What each data-parallel method costs above the no-communication floor.

The floor (:func:`experiments.baselines.floor_train_step`) is forward,
backward and a local SGD step with no collective: every method does at least
that. For each N in ``plan.overhead_ns`` the methods are compiled for the same
model and batch and timed interleaved; a method's *overhead* is its step time
minus the floor's in the same round (median over rounds). Beside it: the
compiled per-device peak, and the bytes the step writes to memory per device
(:mod:`experiments.hlo_bytes`, from the optimized HLO), where bucket copies,
padded copies and unpacking slices show.

ZeRO-1 moves the same bytes as DDP and does 1/N of its Adam work, so its
overhead should be below DDP's, and far below at large N.
"""
from __future__ import annotations

import statistics

import zero1_jax as z1
from experiments import bench_setup as bs
from experiments.bench_sections import _summary, time_interleaved
from experiments.hlo_bytes import written

# method label -> (bench_setup method, extra build keywords)
VARIANTS = {
    bs.FLOOR: (bs.FLOOR, {}),
    "zero1_rs": ("zero1_rs", {}),
    "zero1_packed": ("zero1_rs", {"inplace_bytes": None}),
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
      builts[label] = bs.build(method, m, n, batches[0], **kw)
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
        f"; zero1/ddp overhead={row['zero1_over_ddp_overhead']:.3f}; written MB " +
        ", ".join(f"{k}={v / 1e6:.1f}" for k, v in row["written"].items()))
    del builts
  return rows


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
    peak = r["memory"]["zero1_rs"]["peak"]
    out.append(dict(
        target=f"ZeRO-1 peak <= floor peak + sharded state + 0.3 x gradient bytes "
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
           "`zero1_packed`: ZeRO-1 with every leaf packed into buckets "
           "(`inplace_bytes=None`, the old layout).", "",
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
