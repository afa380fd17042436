"""The tables of experiments/gpu/aot.py: each form's estimated step against
DDP's and the floor's, the step at 8 to 64 GPUs, and each zero1 form's peak
per GPU against the memory line (DDP's peak less the state ZeRO-1 saves).

Rows are :func:`experiments.gpu.aot.measure`'s dicts; every time in them is
XLA's cost model, an estimate.
"""
from __future__ import annotations

FORMS = ("floor", "ddp", "ddp_nomaster", "gspmd", "train_step",
         "train_step_gathered", "zero2", "engine", "jit_grad", "jit_vg",
         "jit_vg_gathered")
BASELINES = ("floor", "ddp", "ddp_nomaster", "gspmd")
# The forms that keep their param shard between steps (plain jit's do not).
KEEP_SHARD = ("train_step", "train_step_gathered", "zero2", "engine")


def table(rows: list[dict]) -> str:
  """Markdown: one table per (model, dtype, GPUs), ratios against DDP."""
  out = []
  groups = sorted({(r["model"], r["dtype"], r["gpus"]) for r in rows},
                  key=lambda g: (g[0], g[1], g[2]))
  for m, dt, g in groups:
    rs = {r["form"]: r for r in rows if (r["model"], r["dtype"], r["gpus"]) == (m, dt, g)}
    floor, ddp = rs.get("floor"), rs.get("ddp")
    kind = next(iter(rs.values())).get("gpu", "h100").upper()
    what = "fp32 params, bf16 compute" if dt == "mixed" else f"{dt} params"
    out += [f"\n**{m}, {what}, {g} x {kind}** (XLA's cost model, µs)\n",
            "| form | step | / DDP | above floor | / DDP's | exposed comm | "
            "reduce-scatter + all-reduce + all-gather MiB | peak MiB |",
            "|---|---|---|---|---|---|---|---|"]
    for f in FORMS:
      r = rs.get(f)
      if r is None:
        continue
      above = r["step_us"] - floor["step_us"] if floor else float("nan")
      d_above = ddp["step_us"] - floor["step_us"] if floor and ddp else float("nan")
      mib = sum(c["bytes"] * (2 if k == "all-reduce" else 1)
                for k, c in r["collectives"].items()
                if k in ("reduce-scatter", "all-reduce", "all-gather")) / 2 ** 20
      out.append(
          f"| {f} | {r['step_us']:,.0f} | "
          f"{r['step_us'] / ddp['step_us']:.3f} | {above:,.0f} | "
          f"{above / d_above:.2f} | {r['exposed_us']:,.0f} | {mib:,.0f} | "
          f"{r['peak_bytes'] / 2 ** 20:,.0f} |" if ddp else f"| {f} | {r['step_us']:,.0f} |")
  return "\n".join(out)


def memory_line(row: dict, ddp: dict, params: int, key: str = "peak_bytes") -> float:
  """The peak ``row``'s form should not pass (bytes a device): DDP's peak
  less the optimizer state ZeRO-1 shards away (``params`` x 8 bytes x
  (1 - 1/N) with fp32 params, two moments; x 12 with bf16 params, whose DDP keeps
  an fp32 master too), plus the param shard the forms that own the step
  keep (``params`` x 4 or 2 bytes / N). ``key="live_peak_bytes"``: the same
  line for the bytes live at the peak (without the heap's unused gaps)."""
  n, fp32 = row["gpus"], row["dtype"] != "bf16"   # "mixed": fp32 params
  saved = (8 if fp32 else 12) * params * (1 - 1 / n)
  kept = (4 if fp32 else 2) * params / n if row["form"] in KEEP_SHARD else 0
  return ddp[key] - saved + kept


def lines(rows: list[dict], params: dict[str, int]) -> str:
  """Markdown: each zero1 form's peak against :func:`memory_line`
  (``params``: model -> its parameter count), and the bytes live at the
  peak against the same line drawn from DDP's live bytes, where both rows
  carry them."""
  mib = lambda b: f"{b / 2 ** 20:,.1f}"
  out = ["| model, params | GPUs | form | peak MiB | line MiB | over MiB | "
         "live at peak MiB | its line MiB | over MiB |",
         "|---|---|---|---|---|---|---|---|---|"]
  ddps = {(r["model"], r["dtype"], r["gpus"]): r for r in rows if r["form"] == "ddp"}
  for r in rows:
    d = ddps.get((r["model"], r["dtype"], r["gpus"]))
    if r["form"] in BASELINES or d is None:
      continue
    line = memory_line(r, d, params[r["model"]])
    cells = [mib(r["peak_bytes"]), mib(line), mib(max(0.0, r["peak_bytes"] - line))]
    if "live_peak_bytes" in r and "live_peak_bytes" in d:
      live = memory_line(r, d, params[r["model"]], "live_peak_bytes")
      cells += [mib(r["live_peak_bytes"]), mib(live),
                mib(max(0.0, r["live_peak_bytes"] - live))]
    else:
      cells += [""] * 3
    out.append(f"| {r['model']}, {r['dtype']} | {r['gpus']} | {r['form']} | "
               + " | ".join(cells) + " |")
  return "\n".join(out)


def scaling(rows: list[dict]) -> str:
  """Markdown: the step at each GPU count, one row per (model, dtype, form),
  with its ratio to DDP's step there."""
  gpus = sorted({r["gpus"] for r in rows})
  out = ["| model, params | form | " + " | ".join(f"{g} GPUs" for g in gpus) + " |",
         "|---|---|" + "---|" * len(gpus)]
  by = {(r["model"], r["dtype"], r["form"], r["gpus"]): r for r in rows}
  for m, dt in sorted({(r["model"], r["dtype"]) for r in rows}):
    for f in FORMS:
      cells = []
      for g in gpus:
        r, d = by.get((m, dt, f, g)), by.get((m, dt, "ddp", g))
        cells.append("" if r is None else f"{r['step_us']:,.0f}" + (
            f" ({r['step_us'] / d['step_us']:.2f})" if d and f != "ddp" else ""))
      if any(cells):
        out.append(f"| {m}, {dt} | {f} | " + " | ".join(cells) + " |")
  return "\n".join(out)
