"""Every form's step run on one real GPU and timed, beside XLA's estimate.

experiments/gpu/aot.py's figures are XLA's cost model for GPUs that are not
there. This runs the same steps (same model, per-device batch, optimizer
and compiler options, lowered by the same code) on the GPU that is here, at
N = 1, and times them: how far the cost model is from the device.

At N = 1 XLA runs no latency-hiding scheduler (no schedule is written, so
there is no N = 1 estimate to read). The comparison therefore uses the
forms whose per-device work does not depend on N: the no-communication
floor (forward, backward, a local SGD step; at 8 GPUs only a scalar
all-reduce is added) and DDP (every device runs the full Adam update; at 8
GPUs its all-reduces are communication only). Their measured N = 1 step is
set against the compute time of the 8-GPU schedule (``compute_us``: time
during which some compute op runs), which the cost model estimates for the
same per-device program. The zero1 forms are timed too: at N = 1 they run
DDP's arithmetic plus their own packing, so their ratio to measured DDP is
what ZeRO-1 costs with nothing to communicate; no estimate fits them (at 8
GPUs their update is 1/8 of it).

  python -m experiments.gpu.measure --out DIR          # on a machine with a GPU
  python -m experiments.gpu.measure --table DIR/measured.jsonl \\
      experiments/results/gpu_aot_h200.json            # the table, anywhere

Beside the step, the host: its pace (``queued_us``: until the last queued
call returned; where it equals the step, the device waited on the host), a
fixed pure-Python workload timed before and after (``host_probe_us``), the
CPUs' time while timed, and the GPU's clocks between forms in the log. A
plan entry's fourth field names a compiler-flag variant (:data:`VARIANTS`).

Each form runs in its own process (its peak is the device's high-water mark,
``memory_stats()["peak_bytes_in_use"]``); results are appended to
``measured.jsonl`` as they come, so a run cut short keeps what it finished.
``bash experiments/gpu/check.sh steps`` runs this on the device.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("ZERO1_REAL_GPU", "1")   # experiments/gpu/aot.py: no platforms=cpu

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zero1_jax as z1  # noqa: E402
from experiments.gpu import aot  # noqa: E402

# What runs first when time is short: BERT-base fp32 with every form (flax's
# TrainState with and without zero1's new-state check among them), then the
# floor, DDP and the forms that own the step for the rest.
PLAN = (
    [("bert-base", "fp32", f) for f in ("floor", "ddp", "train_step", "jit_vg", "jit_ts",
                                        "jit_ts_nocheck", "zero2", "engine", "jit_grad",
                                        "gspmd")]
    + [("bert-base", "bf16", f) for f in ("floor", "ddp", "ddp_nomaster", "train_step",
                                          "jit_vg")]
    + [(m, dt, f) for m in ("gpt2",) for dt in ("fp32", "bf16")
       for f in ("floor", "ddp", "train_step")])
# Forms whose per-device work at N = 1 is their per-device work at 8 GPUs
# minus communication (see the module docstring).
SAME_WORK = ("floor", "ddp", "ddp_nomaster")
IDS = 2050   # token ids below every model's vocabulary (small-bert's 2050 rows)
# Compiler-flag variants a plan entry may name as its fourth field
# (model:dtype:form:variant), added to XLA_FLAGS of that form's process.
# "nocb": no command buffers (CUDA graphs): each kernel launched by the host.
VARIANTS = {"": "", "nocb": "--xla_gpu_enable_command_buffer="}


def arguments(lowered, compiled, seed: int = 0):
  """Concrete (params, state, batch) for a lowered step: floats uniform in
  [0, .02) (second moments stay >= 0), integers zero but the token ids,
  uniform below ``IDS``; placed as the compiled step expects."""
  rng = np.random.default_rng(seed)
  infos, treedef = jax.tree.flatten(lowered.args_info[0])
  shardings = jax.tree.leaves(compiled.input_shardings[0])
  n_state = len(jax.tree.leaves(lowered.args_info[0][:2]))
  out = []
  for i, (info, sh) in enumerate(zip(infos, shardings)):
    shape, dtype = info.shape, np.dtype(info.dtype)
    if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
      x = rng.uniform(0, 0.02, shape)
    elif i >= n_state:
      x = rng.integers(0, IDS, shape)
    else:
      x = np.zeros(shape)
    out.append(jax.device_put(np.asarray(x).astype(dtype), sh))
  return jax.tree.unflatten(treedef, out)


def host_probe(reps: int = 5) -> float:
  """Microseconds this host takes for a fixed piece of pure-Python work
  (median of ``reps``): a yardstick of the host's speed at this moment, to
  set beside the steps' host time from run to run."""
  per = []
  for _ in range(reps):
    t = time.perf_counter()
    sum(i * i for i in range(200_000))
    per.append(time.perf_counter() - t)
  return 1e6 * float(np.median(per))


def cpu_times() -> dict[str, float]:
  """This machine's CPU time so far, all CPUs (/proc/stat, seconds): user,
  system, idle and steal (time a hypervisor gave this VM's CPUs to others);
  empty where there is no /proc/stat."""
  try:
    with open("/proc/stat") as f:
      v = [int(x) for x in f.readline().split()[1:9]]
  except (OSError, ValueError):
    return {}
  hz = os.sysconf("SC_CLK_TCK")
  return {"user": (v[0] + v[1]) / hz, "system": (v[2] + v[5] + v[6]) / hz,
          "idle": (v[3] + v[4]) / hz, "steal": v[7] / hz}


def timed(compiled, args, *, warmup: int = 3, iters: int = 20, repeats: int = 5
          ) -> tuple[list[float], list[float], list[float]]:
  """Seconds per step over ``repeats`` runs of ``iters`` steps each, the
  outputs fed back as the next step's donated inputs; seconds the host
  takes to dispatch one call with the device idle (the call returns once
  the step is queued: where that is near the step's time, the host, not
  the device, sets the pace); and per run, seconds per step until the last
  of the ``iters`` calls returned (the host's pace: where it equals the
  step's, the device waited on the host)."""
  p, s, b = args
  for _ in range(warmup):
    p, s, *_ = compiled(p, s, b)
  jax.block_until_ready((p, s))
  per, queued = [], []
  for _ in range(repeats):
    t = time.perf_counter()
    for _ in range(iters):
      p, s, *rest = compiled(p, s, b)
    queued.append((time.perf_counter() - t) / iters)
    jax.block_until_ready((p, s, rest))
    per.append((time.perf_counter() - t) / iters)
  host = []
  for _ in range(repeats):
    t = time.perf_counter()
    p, s, *rest = compiled(p, s, b)
    host.append(time.perf_counter() - t)
    jax.block_until_ready((p, s, rest))
  return per, host, queued


def one(form: str, name: str, dtype: str, iters: int = 20, repeats: int = 5,
        warmup: int = 3, variant: str = "") -> dict:
  """One form on the first device: compiled, run, timed (the host's speed
  probed before and after)."""
  probe_before = host_probe()
  dev = jax.devices()[0]
  mesh = jax.make_mesh((1,), ("data",), devices=[dev],
                       axis_types=(jax.sharding.AxisType.Auto,))
  t0 = time.perf_counter()
  lowered = aot.lower(form, name, dtype, mesh)
  compiled = lowered.compile(compiler_options=aot.OPTIONS)
  compile_s = time.perf_counter() - t0
  args = arguments(lowered, compiled)
  cpu0, t0 = cpu_times(), time.perf_counter()
  per, host, queued = timed(compiled, args, warmup=warmup, iters=iters, repeats=repeats)
  cpu1, wall = cpu_times(), time.perf_counter() - t0
  # while timed: each kind of CPU time over the wall time (in CPUs' worth)
  cpu = {k: (cpu1[k] - cpu0[k]) / wall for k in cpu1}
  stats = dev.memory_stats() or {}
  return {
      "form": form, "model": name, "dtype": dtype, "gpus": 1, "variant": variant,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "device": dev.device_kind, "jax": jax.__version__,
      "step_us": 1e6 * float(np.median(per)), "min_us": 1e6 * min(per),
      "max_us": 1e6 * max(per), "dispatch_us": 1e6 * float(np.median(host)),
      "queued_us": 1e6 * float(np.median(queued)),
      "host_probe_us": [probe_before, host_probe()], "loadavg": list(os.getloadavg()),
      "host_cpus": len(os.sched_getaffinity(0)), "cpus_busy_while_timed": cpu,
      "xla_peak_bytes": z1.inspect.memory(compiled)["peak"],
      "device_peak_bytes": stats.get("peak_bytes_in_use"),
      "compile_s": compile_s,
  }


def run_plan(plan, out: str, deadline_s: float, per_form_s: float, timing: list[str]) -> None:
  """Each (model, dtype, form) in its own process, until ``deadline_s``."""
  path = os.path.join(out, "measured.jsonl")
  start = time.monotonic()
  for name, dtype, form, *variant in plan:
    variant = variant[0] if variant else ""
    left = deadline_s - (time.monotonic() - start)
    if left < 20:
      print(f"measure: out of time, skipped {name} {dtype} {form} and the rest", flush=True)
      break
    cmd = [sys.executable, "-m", "experiments.gpu.measure", "--one", form, name, dtype,
           *timing, "--jsonl", path, "--variant", variant]
    env = {**os.environ,
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {VARIANTS[variant]}".strip()}
    try:
      r = subprocess.run(cmd, timeout=min(per_form_s, left), capture_output=True, text=True,
                         env=env)
      status = "ok" if r.returncode == 0 else f"exit {r.returncode}: {r.stderr[-600:]}"
    except subprocess.TimeoutExpired:
      status = f"timed out after {min(per_form_s, left):.0f} s"
    what = f"{name} {dtype} {form}" + (f" ({variant})" if variant else "")
    print(f"measure: {what}: {status}; gpu {gpu_state()}", flush=True)


def gpu_state() -> str:
  """The GPU's clocks, temperature and power now (nvidia-smi), for the log."""
  try:
    return subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "?"


def _ddp_for(measured: list[dict], i: int) -> dict | None:
  """The DDP row row ``i`` is set against: same run, model, dtype and
  variant; the nearest before it, else the first after it (a form timed
  beside DDP in one run is compared with that DDP, not another run's)."""
  key = lambda r: (r.get("run"), r["model"], r["dtype"], r.get("variant", ""))
  same = [j for j, r in enumerate(measured) if r["form"] == "ddp" and key(r) == key(measured[i])]
  before = [j for j in same if j <= i]
  return measured[before[-1] if before else same[0]] if same else None


def table(measured: list[dict], estimates: list[dict]) -> str:
  """Markdown: measured N = 1 steps beside the 8-GPU estimates, a row per
  measured step in file order (with a ``run`` column where rows name runs)."""
  est = {(r["model"], r["dtype"], r["form"]): r for r in estimates if r["gpus"] == 8}
  runs = any("run" in r for r in measured)
  dev = measured[0]["device"] if measured else "?"
  out = [("| run " if runs else "") + f"| model, params | form | measured step, 1 x {dev} (µs) | "
         "range | host µs a call | host µs a step, queued | / DDP's | "
         "XLA's compute estimate, 8 GPUs (µs) | measured / estimate | "
         "peak GiB: device / XLA |", "|---" * (11 if runs else 10) + "|"]
  for i, r in enumerate(measured):
    m, dt, f, v = r["model"], r["dtype"], r["form"], r.get("variant", "")
    ddp, e = _ddp_for(measured, i), est.get((m, dt, f))
    comp = e["compute_us"] if e else None
    dpeak = r.get("device_peak_bytes")
    cells = [f"{m}, {dt}", f + (f" ({v})" if v else ""), f"{r['step_us']:,.0f}",
             f"{r['min_us']:,.0f}-{r['max_us']:,.0f}",
             f"{r['dispatch_us']:,.0f}" if "dispatch_us" in r else "",
             f"{r['queued_us']:,.0f}" if "queued_us" in r else "",
             f"{r['step_us'] / ddp['step_us']:.3f}" if ddp else "",
             f"{comp:,.0f}" if comp else "",
             f"{r['step_us'] / comp:.2f}" if comp and f in SAME_WORK else "—",
             (f"{dpeak / 2 ** 30:.2f}" if dpeak else "?")
             + f" / {r['xla_peak_bytes'] / 2 ** 30:.2f}"]
    out.append("| " + " | ".join(([str(r.get("run", ""))] if runs else []) + cells) + " |")
  return "\n".join(out)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--one", nargs=3, metavar=("FORM", "MODEL", "DTYPE"))
  ap.add_argument("--jsonl", default=None)
  ap.add_argument("--variant", default="", choices=sorted(VARIANTS))
  ap.add_argument("--plan", default=None,
                  help="model:dtype:form[:variant],... (default: PLAN, most wanted first)")
  ap.add_argument("--out", default=os.environ.get("OUT", "experiments/results/gpu"))
  ap.add_argument("--deadline", type=float, default=420.0, help="seconds for the whole plan")
  ap.add_argument("--per-form", type=float, default=150.0)
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--table", nargs=2, metavar=("MEASURED_JSONL", "ESTIMATES_JSON"))
  a = ap.parse_args(argv)
  if a.table:
    with open(a.table[0]) as f:
      measured = [json.loads(line) for line in f if line.strip()]
    with open(a.table[1]) as f:
      print(table(measured, json.load(f)))
    return
  if a.one:
    r = one(*a.one, iters=a.iters, repeats=a.repeats, warmup=a.warmup, variant=a.variant)
    print(json.dumps(r))
    with open(a.jsonl, "a") as f:
      f.write(json.dumps(r) + "\n")
    return
  plan = PLAN if not a.plan else [tuple(p.split(":")) for p in a.plan.split(",")]
  os.makedirs(a.out, exist_ok=True)
  # No jax backend in this process: it would take the GPU's memory from the
  # processes that measure.
  run_plan(plan, a.out, a.deadline, a.per_form,
           ["--iters", str(a.iters), "--repeats", str(a.repeats), "--warmup", str(a.warmup)])


if __name__ == "__main__":
  main()
