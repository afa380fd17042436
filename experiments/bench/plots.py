"""Plots of the ZeRO-1 benchmark (:mod:`experiments.bench`).

:func:`plots` writes PNGs of a result dict: memory vs N, collectives per
step, step time and memory vs model size, and the bucket size sweep.
matplotlib is imported only when plotting.
"""
from __future__ import annotations

import os

import numpy as np

from experiments.bench.plan import COLORS, LABELS, METHODS


def _plain_log_ticks(ax, matplotlib) -> None:
  """Log axes labelled 0.1M / 20 instead of 10^5 / 2x10^1."""
  fmt = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
  for axis in (ax.xaxis, ax.yaxis):
    axis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
  ax.yaxis.set_major_formatter(fmt)
  ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
      lambda v, _: f"{v / 1e6:g}M"))
  ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _versus_size(ax, matplotlib, ylabel: str, title: str, sizes: int) -> None:
  """Log-log axes of a quantity against parameter count; with one model
  size, linear from 0 (a log axis over a 0.0004% spread labelled every tick
  "1058.31")."""
  if sizes > 1:
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_ticks(ax, matplotlib)
  else:
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.15)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v / 1e6:g}M"))
  ax.set_xlabel("parameters Psi")
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, which="both")


def _save(fig, out: str, name: str, plt) -> str:
  """Lays out, writes and closes ``fig``; returns its path."""
  fig.tight_layout()
  path = os.path.join(out, name)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plots(res: dict, out: str) -> list[str]:
  """PNG plots; returns the paths written."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  paths = []
  st, mem = res.get("state"), res.get("memory")
  panels = [name for name, v in (("state", st), ("memory", mem)) if v]
  if panels:
    dtypes = res["plan"]["dtypes"]
    ticks = res["plan"]["ns"]
    fig, axes = plt.subplots(len(panels), len(dtypes),
                             figsize=(6.5 * len(dtypes), 5.6 * len(panels)), squeeze=False)
    for j, dtype in enumerate(dtypes):
      for i, panel in enumerate(panels):
        ax = axes[i, j]
        if panel == "state":
          # GSPMD first, ZeRO-1 on top in hollow markers: the two coincide
          for method, size in (("gspmd", 4), ("ddp", 5), ("zero1_rs", 10)):
            rs = sorted((r for r in st if r["dtype"] == dtype and r["method"] == method),
                        key=lambda r: r["n"])
            ns = [r["n"] for r in rs]
            hollow = dict(mfc="none", mew=1.5) if method == "zero1_rs" else {}
            ax.plot(ns, [r["model_state_bytes"] / 1e6 for r in rs], "o-", ms=size,
                    color=COLORS[method], label=f"{LABELS[method]}: params + opt state",
                    **hollow)
            ax.plot(ns, [r["state_master_bytes"] / 1e6 for r in rs], "s--", ms=size,
                    color=COLORS[method], alpha=0.6,
                    label=f"{LABELS[method]}: opt state + master only", **hollow)
          rs = sorted((r for r in st if r["dtype"] == dtype and r["method"] == "zero1_rs"),
                      key=lambda r: r["n"])
          theory = ("4Psi + 8Psi/N (theory: fp32 params are the master)"
                    if dtype == "fp32" else "12Psi/N (theory)")
          ax.plot([r["n"] for r in rs], [r["theory_bytes"] / 1e6 for r in rs], "k:",
                  lw=2, label=f"ZeRO-1 opt state + master: {theory}")
          ax.set_title(f"Model + optimizer state per device, {dtype} "
                       f"(Psi={rs[0]['psi'] / 1e6:.2f}M)", fontsize=10)
        else:
          for method in METHODS:
            rs = sorted((r for r in mem if r["dtype"] == dtype and r["method"] == method),
                        key=lambda r: r["n"])
            ns = [r["n"] for r in rs]
            ax.plot(ns, [r["peak"] / 1e6 for r in rs], "o-" if method != "zero1_ar" else "x--",
                    color=COLORS[method], label=f"{LABELS[method]}: compiled peak")
            if method != "zero1_ar":
              ax.plot(ns, [r["theory_total"] / 1e6 for r in rs], ":", color=COLORS[method],
                      label=f"{LABELS[method]}: predicted")
          ax.set_title(f"Compiled peak of the whole step per device, {dtype}", fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.minorticks_off()
        ax.set_xlabel("data-parallel devices N")
        ax.set_ylabel("MB per device")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
        ax.grid(alpha=0.3)
    paths.append(_save(fig, out, "memory_vs_n.png", plt))

  coll = res.get("collectives")
  if coll and any(r["traffic"] for r in coll):   # none at N=1: no plot
    dtypes = res["plan"]["dtypes"]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    kinds = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
    kcol = {"all-reduce": "tab:red", "reduce-scatter": "tab:blue", "all-gather": "tab:orange",
            "all-to-all": "tab:purple", "collective-permute": "tab:gray"}
    for j, dtype in enumerate(dtypes):
      ax = axes[0, j]
      rs = [r for r in coll if r["dtype"] == dtype]
      x = np.arange(len(rs))
      bottom = np.zeros(len(rs))
      for kind in kinds:
        v = np.array([r["kinds"].get(kind, {}).get("traffic", 0) / 1e6 for r in rs])
        if v.any():
          ax.bar(x, v, bottom=bottom, color=kcol[kind], label=kind)
          bottom += v
      for i, r in enumerate(rs):
        th = r["theory"]["total"]
        if th is not None and th == th:
          ax.plot([i - 0.4, i + 0.4], [th / 1e6] * 2, "k--", lw=1.5,
                  label="theory" if i == 0 else None)
        cnt = r["count"]
        ax.text(i, bottom[i], f"{bottom[i]:.2f} MB\n{cnt} ops", ha="center", va="bottom",
                fontsize=8)
      ax.set_xticks(x, [LABELS[r["method"]].replace(" (", "\n(") for r in rs], fontsize=8)
      ax.set_ylabel("per-device ring traffic per step (MB)")
      ax.set_ylim(0, bottom.max() * 1.25)
      note = ("\nXLA:CPU runs 16-bit collectives in f32: measured = 2x the 16-bit theory"
              if dtype != "fp32" and res["meta"]["backend"] == "cpu" else "")
      ax.set_title(f"Collectives per step, N={rs[0]['n']}, {dtype} "
                   f"(Psi={rs[0]['psi'] / 1e6:.2f}M){note}", fontsize=10)
      ax.legend(fontsize=7, loc="upper left")
      ax.grid(axis="y", alpha=0.3)
    paths.append(_save(fig, out, "collectives.png", plt))

  sp = res.get("speed")
  if sp:
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    x = np.arange(len(sp))
    w = 0.27
    for k, (key, label, col) in enumerate((
        ("zero1_over_ddp", "ZeRO-1 / DDP", "tab:red"),
        ("zero1_over_gspmd", "ZeRO-1 / GSPMD", "tab:green"),
        ("zero1_ar_over_ddp", "ZeRO-1 all-reduce path / DDP", "tab:cyan"))):
      v = [r[key]["ratio"] for r in sp]
      lo = [r[key]["ratio"] - r[key]["per_round_q25"] for r in sp]
      hi = [r[key]["per_round_q75"] - r[key]["ratio"] for r in sp]
      ax.bar(x + (k - 1) * w, v, w, color=col, label=label,
             yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], capsize=3)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(x, [f"{r['size']}\n{r['psi'] / 1e6:.2f}M" for r in sp])
    ax.set_ylabel("step-time ratio (median; bars: per-round IQR)")
    ax.set_title(f"Step-time ratios at N={sp[0]['n']} (fp32)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14),
              ncol=2)   # below: inside, it covered the bars and the 1.0 line
    ax.grid(axis="y", alpha=0.3)
    ax = axes[1]
    psis = [r["psi"] for r in sp]
    for method in METHODS:
      ax.errorbar(psis, [r["times"][method]["median"] * 1e3 for r in sp],
                  yerr=[[(r["times"][method]["median"] - r["times"][method]["q25"]) * 1e3
                         for r in sp],
                        [(r["times"][method]["q75"] - r["times"][method]["median"]) * 1e3
                         for r in sp]],
                  fmt="o-", color=COLORS[method], label=LABELS[method], capsize=3)
    _versus_size(ax, matplotlib, "step time (ms)",
                 f"Step time vs model size, N={sp[0]['n']}", len(sp))
    ax = axes[2]
    for method in METHODS:
      ax.plot(psis, [r["memory"][method]["peak"] / 1e6 for r in sp], "o-",
              color=COLORS[method], label=LABELS[method])
    _versus_size(ax, matplotlib, "compiled peak MB per device",
                 f"Step memory vs model size, N={sp[0]['n']}", len(sp))
    paths.append(_save(fig, out, "step_time.png", plt))

  bk = res.get("buckets")
  if bk:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bb = [r["bucket_bytes"] for r in bk["rows"]]
    ax.errorbar(bb, [r["time"]["median"] * 1e3 for r in bk["rows"]],
                yerr=[[(r["time"]["median"] - r["time"]["q25"]) * 1e3 for r in bk["rows"]],
                      [(r["time"]["q75"] - r["time"]["median"]) * 1e3 for r in bk["rows"]]],
                fmt="o-", color="tab:blue", capsize=3, label="ZeRO-1 step time (median, IQR)")
    ax.axhline(bk["ddp_time"]["median"] * 1e3, color="tab:red", ls="--", label="DDP step time")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bb, [f"{x / 2**20:g} MiB" if x >= 2**20 else f"{x / 2**10:g} KiB"
                       for x in bb], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("bucket_bytes")
    ax.set_ylabel("step time (ms)")
    ax2 = ax.twinx()
    ax2.plot(bb, [r["reduce_scatter"] + r["all_gather"] for r in bk["rows"]], "s:",
             color="tab:orange", label="reduce-scatter + all-gather ops")
    ax2.set_yscale("log")
    ax2.set_ylabel("collective ops per step")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper center")
    ax.set_title(f"Bucket size sweep, model {bk['size']} (Psi={bk['psi'] / 1e6:.2f}M), "
                 f"N={bk['n']}")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out, "buckets.png", plt))
  return paths
