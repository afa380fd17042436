"""Plots written by zero1-train: the loss curve and per-device memory."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_MB = 1024 ** 2


def loss_curve(history: list[dict], path: str) -> None:
  steps = [h["step"] for h in history if not h["skipped"]]
  loss = [h["loss"] for h in history if not h["skipped"]]
  skipped = [h for h in history if h["skipped"]]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(steps, loss, lw=1.2, label="loss")
  if skipped:   # at their own loss (computed before the skip); else the top
    top = max(loss or [0])
    ax.scatter([h["step"] for h in skipped],
               [top if h["loss"] is None else h["loss"] for h in skipped],
               marker="x", color="tab:red", label="skipped (fp16 overflow)")
  ax.set_xlabel("optimizer step")
  ax.set_ylabel("MLM loss")
  ax.set_title("zero1-train loss")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def memory_bars(mem: dict, path: str) -> None:
  n = mem["num_devices"]
  ranks = mem.get("ranks", list(range(n)))
  fig, ax = plt.subplots(figsize=(6, 3.5))
  w = 0.4
  ax.bar([r - w / 2 for r in ranks], [mem["replicated_bytes"] / _MB] * len(ranks), w,
         label="replicated (DDP)")
  ax.bar([r + w / 2 for r in ranks],
         [b / _MB for b in mem["zero1_bytes_per_rank"]], w,
         label=f"ZeRO-{mem.get('stage', 1)}")
  ax.set_xticks(ranks, [f"rank {r}" for r in ranks])
  ax.set_ylabel("optimizer state (MiB)" if mem.get("fp32_params") else
                "optimizer state, fp32 master incl. (MiB)")
  which = ("" if len(ranks) == n else   # multi-process: process 0 plots its own
           ": process 0's ranks")
  ax.set_title(f"Optimizer state per device, N={n}{which} (measured)"
               + ("\nstage 2 shards the gradients too (not shown)"
                  if mem.get("stage") == 2 else ""), fontsize=10)
  ax.set_ylim(0, 1.3 * mem["replicated_bytes"] / _MB)   # room for the legend
  ax.legend(loc="upper center", ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
