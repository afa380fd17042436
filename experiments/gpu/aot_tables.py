"""The tables of experiments/gpu/aot.py: each form's estimated step against
DDP's and the floor's, the step at 8 to 64 GPUs, the ratios at a glance, and
each zero1 form's peak per GPU against the memory line (DDP's peak less the
state ZeRO-1 saves).

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


# docs/gpu.md's table at a glance: (form, its name for a reader)
GLANCE = (("floor", "no-communication floor"),
          ("gspmd", "GSPMD (optax's state sharded)"),
          ("train_step", "`z1.train_step`"),
          ("zero2", "`z1.zero2` (`train_step`)"),
          ("engine", "`z1.initialize`'s engine"),
          ("jit_vg", "plain jit, `z1.value_and_grad`"),
          ("jit_grad", "plain jit, `jax.value_and_grad`"))


def glance(rows: list[dict]) -> str:
  """Markdown: per form of :data:`GLANCE`, the range of its step over
  DDP's across the models, per params' dtype, on one host (8 GPUs) and on
  several (16 or more).

  Example:
    >>> rows = [{"model": m, "dtype": "fp32", "gpus": 8, "form": f, "step_us": t}
    ...         for m, f, t in [("a", "ddp", 100), ("a", "train_step", 80),
    ...                         ("b", "ddp", 200), ("b", "train_step", 170)]]
    >>> glance(rows).splitlines()[2]
    '| `z1.train_step` | 0.80-0.85 |'
  """
  ddp = {(r["model"], r["dtype"], r["gpus"]): r["step_us"]
         for r in rows if r["form"] == "ddp"}
  cols = [(dt, hosts) for dt in ("fp32", "bf16", "mixed") for hosts in (False, True)
          if any(r["dtype"] == dt and (r["gpus"] > 8) == hosts for r in rows)]
  out = ["| form | " + " | ".join(f"{dt}, {'16-64' if h else '8'}" for dt, h in cols)
         + " |", "|---|" + "---|" * len(cols)]
  for form, name in GLANCE:
    cells = []
    for dt, hosts in cols:
      v = [r["step_us"] / ddp[k] for r in rows
           if r["form"] == form and r["dtype"] == dt and (r["gpus"] > 8) == hosts
           and (k := (r["model"], r["dtype"], r["gpus"])) in ddp]
      lo, hi = (f"{min(v):.2f}", f"{max(v):.2f}") if v else ("", "")
      cells.append(lo if lo == hi else f"{lo}-{hi}")
    if any(cells):
      out.append(f"| {name} | " + " | ".join(cells) + " |")
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


# The goals the estimates are held to (issue #39, item 5): the forms that own
# the step, and plain jit with z1.value_and_grad, by their time above the
# floor against DDP's on one host; every zero1 form against GSPMD's step, and
# against DDP's across hosts; and each peak against memory_line.
OWN_STEP = ("train_step", "zero2", "engine")
ZERO1_FORMS = OWN_STEP + ("jit_vg", "jit_grad")
GOALS = (
    ("own the step: above floor <= 0.25 x DDP's, 8 GPUs", OWN_STEP, "above", 0.25),
    ("z1.value_and_grad: above floor <= 0.75 x DDP's, 8 GPUs", ("jit_vg",), "above", 0.75),
    ("every form: step <= GSPMD's", ZERO1_FORMS, "gspmd", 1.0),
    ("every form, 16-64 GPUs: step <= DDP's", ZERO1_FORMS, "ddp", 1.0),
    ("every form: peak <= the memory line", ZERO1_FORMS, "peak", 0.0),
)
# The same bounds held to XLA's own sharding of the state (not a zero1 form):
# how close the partitioner's program comes to them, for scale (the memory
# line is drawn from ideal state bytes; a heap's packing moves a peak by KiB).
REFERENCE = (
    ("GSPMD, 16-64 GPUs: step <= DDP's", ("gspmd",), "ddp", 1.0),
    ("GSPMD: peak <= the memory line", ("gspmd",), "peak", 0.0),
)


def goals(rows: list[dict], params: dict[str, int],
          held: tuple = GOALS) -> str:
  """Markdown: per goal of ``held`` (:data:`GOALS`; :data:`REFERENCE`
  holds GSPMD to the same bounds), the rows it applies to (fp32 and
  bf16 params; fp32 params computing in bf16 apart), how many meet it, and
  each one that does not, with its value against the bound
  (``params``: model -> its parameter count, for :func:`memory_line`).

  Example:
    >>> rows = [{"model": "a", "dtype": "fp32", "gpus": 16, "form": f, "step_us": t}
    ...         for f, t in [("floor", 50), ("ddp", 100), ("gspmd", 105),
    ...                      ("jit_vg", 90), ("jit_grad", 103)]]
    >>> print(goals(rows, {"a": 1}).splitlines()[3])
    | every form, 16-64 GPUs: step <= DDP's | fp32, bf16 | 1 of 2 | a fp32 16 jit_grad: 1.030 |
  """
  by = {(r["model"], r["dtype"], r["gpus"], r["form"]): r for r in rows}
  out = ["| goal | params | met | not met (value against the bound) |",
         "|---|---|---|---|"]
  for name, forms, kind, bound in held:
    for dtypes in (("fp32", "bf16"), ("mixed",)):
      met, missed = 0, []
      for r in rows:
        m, dt, g, f = r["model"], r["dtype"], r["gpus"], r["form"]
        if f not in forms or dt not in dtypes:
          continue
        if kind in ("above",) and g != 8 or kind == "ddp" and g == 8:
          continue
        floor, ddp, gspmd = (by.get((m, dt, g, b)) for b in ("floor", "ddp", "gspmd"))
        if kind == "above" and floor and ddp:
          v = (r["step_us"] - floor["step_us"]) / (ddp["step_us"] - floor["step_us"])
          ok, txt = v <= bound, f"{v:.2f} x"
        elif kind in ("gspmd", "ddp") and (gspmd if kind == "gspmd" else ddp):
          v = r["step_us"] / (gspmd if kind == "gspmd" else ddp)["step_us"]
          ok, txt = v <= bound, f"{v:.3f}"
        elif kind == "peak" and ddp and "peak_bytes" in r:
          v = r["peak_bytes"] - memory_line(r, ddp, params[m])
          ok, txt = v <= bound, (f"+{v / 2 ** 20:.1f} MiB" if v >= 2 ** 20
                                 else f"+{v / 2 ** 10:.0f} KiB")
        else:
          continue
        met += ok
        if not ok:
          missed.append(f"{m} {dt} {g} {f}: {txt}")
      if met or missed:
        out.append(f"| {name} | {', '.join(dtypes)} | {met} of {met + len(missed)} | "
                   + "; ".join(missed) + " |")
  return "\n".join(out)
