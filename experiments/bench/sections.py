"""Measurement sections of the ZeRO-1 benchmark (:mod:`experiments.bench`).

Each section takes a :class:`~experiments.bench.plan.Plan` and returns plain
JSON-able dicts:

* :func:`state_section`: per-device bytes of optimizer state + master weights
  from ``addressable_shards`` vs 12 Psi / N;
* :func:`memory_section`: compiled per-device memory of the whole donating
  step vs the ZeRO paper's prediction, plus the collectives of the same
  compiled programs (:func:`collective_section`);
* :func:`speed_section`: interleaved step times (:func:`time_interleaved`);
* :func:`bucket_section`: collective count and step time vs ``bucket_bytes``;
* :func:`adam_bandwidth_section`: bytes an Adam update moves per second vs
  the memory roofline.
"""
from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zero1_jax as z1
from experiments import baselines as bl
from experiments.bench.plan import (DTYPES, K, METHODS, Built, Model, Plan, batch,
                                     build, device_batch, make_mesh, model,
                                     model_state_theory, optimizer, sharded_state_theory,
                                     state_master_theory,
                                     traffic_theory)


def _state_master_bytes(method: str, built_params, built_state, dtype: str, device) -> int:
  state = z1.inspect.device_bytes(built_state, device)
  if dtype != "fp32":
    return state
  return state + z1.inspect.device_bytes(built_params, device)   # params = master


def state_section(plan: Plan, log=print) -> list[dict]:
  """Per-device optimizer state + master bytes (addressable_shards) vs N."""
  rows = []
  for dtype in plan.dtypes:
    m = model(plan.state_size, dtype, plan.seq_len)
    for n in plan.ns:
      mesh = make_mesh(n)
      for method in ("zero1_rs", "ddp", "gspmd"):
        if method == "zero1_rs":
          tx = z1.zero1(optimizer(), axis_name="data")
          p, s = z1.init(tx, m.params, mesh)
          padding = z1.plan(m.params, n).num_padding
        elif method == "ddp":
          p, s = bl.ddp_init(optimizer(), m.params, mesh)
          padding = 0
        else:
          p, s = bl.gspmd_init(optimizer(), m.params, mesh)
          padding = 0
        per_dev = [_state_master_bytes(method, p, s, dtype, d) for d in mesh.devices.flat]
        sharded = max(z1.inspect.device_bytes(s, d) for d in mesh.devices.flat)
        params_b = z1.inspect.device_bytes(p, mesh.devices.flat[0])
        theory = state_master_theory(method, m.psi, n, dtype)
        rows.append(dict(
            dtype=dtype, n=n, method=method, psi=m.psi,
            state_master_bytes=max(per_dev), state_master_bytes_min=min(per_dev),
            params_bytes=params_b,
            model_state_bytes=max(per_dev) + (params_b if dtype != "fp32" else 0),
            sharded_state_bytes=sharded,
            sharded_state_theory=sharded_state_theory(m.psi, n, dtype),
            theory_bytes=theory, ratio=max(per_dev) / theory,
            padding_elems=padding, twelve_psi_over_n=K * m.psi / n))
        del p, s
      log(f"  state {dtype} N={n}: " + ", ".join(
          f"{r['method']}={r['state_master_bytes'] / 1e6:.3f}MB"
          for r in rows if r["n"] == n and r["dtype"] == dtype))
  return rows


def activation_bytes(m: Model, per_device_batch: int, seq_len: int) -> int:
  """Temp bytes of forward + backward alone on one device (activations and
  workspace): what a step holds besides the model states."""
  b = batch(per_device_batch, seq_len)
  c = jax.jit(jax.value_and_grad(m.loss_fn)).lower(
      jax.device_put(m.params, jax.devices()[0]), b).compile()
  return z1.inspect.memory(c)["temp"]


def memory_section(plan: Plan, log=print) -> tuple[list[dict], list[dict]]:
  """Compiled per-device memory of each method's whole step, and the
  collectives of the same compiled programs."""
  mem_rows, coll_rows = [], []
  for dtype in plan.dtypes:
    m = model(plan.state_size, dtype, plan.seq_len)
    act = activation_bytes(m, plan.per_device_batch, plan.seq_len)
    for n in plan.ns:
      b = device_batch(batch(plan.per_device_batch * n, plan.seq_len), n)
      # At the largest N also ZeRO-1 with large leaves in place (the GPU
      # default; on CPU the default packs every leaf).
      extra = (("zero1_in_place",) if n == max(plan.ns) else ())
      # Kept: the speed (largest N) and overhead sections reuse these compiles.
      keep = dtype == "fp32" and (n == max(plan.ns) or n in plan.overhead_ns)
      for method in METHODS + extra:
        if method == "zero1_in_place":
          built = build("zero1_rs", m, n, b, inplace_bytes=1 << 16, keep=keep)
        else:
          built = build(method, m, n, b, keep=keep)
        mem = z1.inspect.memory(built.compiled)
        theory = model_state_theory("zero1_rs" if method == "zero1_in_place" else method,
                                    m.psi, n, dtype)
        mem_rows.append(dict(dtype=dtype, n=n, method=method, psi=m.psi, **mem,
                             theory_model_states=theory, activations=act,
                             theory_total=theory + act,
                             ratio=mem["peak"] / (theory + act),
                             compile_s=built.compile_s))
        if method in METHODS:
          coll_rows.extend(_collective_rows(built, m, dtype, n))
        del built
      log(f"  memory {dtype} N={n}: " + ", ".join(
          f"{r['method']}={r['peak'] / 1e6:.2f}MB"
          for r in mem_rows if r["n"] == n and r["dtype"] == dtype))
  return mem_rows, coll_rows


def _collective_rows(built: Built, m: Model, dtype: str, n: int) -> list[dict]:
  coll = z1.inspect.collectives(built.compiled)
  itemsize = jnp.dtype(DTYPES[dtype]).itemsize
  theory = traffic_theory(built.method, m.psi, itemsize) if n > 1 else {"total": 0}
  total = sum(c.traffic for c in coll.values())
  return [dict(dtype=dtype, n=n, method=built.method, psi=m.psi,
               kinds={k: dict(count=c.count, bytes=c.bytes, traffic=c.traffic)
                      for k, c in coll.items()},
               count=sum(c.count for c in coll.values()),
               traffic=total, theory=theory,
               ratio=(total / theory["total"]) if theory["total"] else None)]


def collective_section(coll_rows: list[dict], n: int) -> list[dict]:
  """The collectives at ``n`` devices, with each method's traffic relative to
  DDP's in the same dtype."""
  out = []
  for r in coll_rows:
    if r["n"] != n:
      continue
    ddp = next(x for x in coll_rows if x["n"] == n and x["dtype"] == r["dtype"]
               and x["method"] == "ddp")
    out.append({**r, "vs_ddp": r["traffic"] / ddp["traffic"] if ddp["traffic"] else None})
  return out


def _rounds(plan: Plan, est_s: float) -> int:
  return int(min(plan.max_rounds, max(plan.min_rounds, plan.speed_budget_s / max(est_s, 1e-6))))


def time_interleaved(builts: dict[str, Built], batches: list, plan: Plan) -> dict[str, list[float]]:
  """Step times (seconds, ``block_until_ready``), the methods interleaved in
  every round, in a rotating order so none always runs first."""
  names = list(builts)
  for name in names:                      # warm-up (and first-call allocation)
    for i in range(plan.warmup):
      builts[name].run(batches[i % len(batches)])
    builts[name].block()
  est = 0.0
  for name in names:
    t0 = time.perf_counter()
    builts[name].run(batches[0])
    builts[name].block()
    est += time.perf_counter() - t0
  rounds = _rounds(plan, est)
  times = {name: [] for name in names}
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      b = batches[r % len(batches)]
      t0 = time.perf_counter()
      builts[name].run(b)
      builts[name].block()
      times[name].append(time.perf_counter() - t0)
  return times


def _summary(ts: list[float]) -> dict:
  q = np.percentile(ts, [25, 50, 75])
  return dict(median=float(q[1]), q25=float(q[0]), q75=float(q[2]), n=len(ts))


def _ratio(times: dict, a: str, b: str) -> dict:
  """``ratio``: the median of per-round ratios a/b (each pair ran back to
  back, so slow drifts of the machine's load cancel); ``ratio_of_medians``:
  median(a) / median(b)."""
  per_round = [x / y for x, y in zip(times[a], times[b])]
  return dict(ratio=statistics.median(per_round),
              ratio_of_medians=statistics.median(times[a]) / statistics.median(times[b]),
              per_round_median=statistics.median(per_round),
              per_round_q25=float(np.percentile(per_round, 25)),
              per_round_q75=float(np.percentile(per_round, 75)))


def speed_section(plan: Plan, log=print) -> list[dict]:
  """Interleaved step times at N = max(ns) (fp32), per model size."""
  n = max(plan.ns)
  rows = []
  batches = [device_batch(batch(plan.global_batch, plan.seq_len, s), n) for s in range(4)]
  for size in plan.speed_sizes:
    m = model(size, "fp32", plan.seq_len)
    builts = {method: build(method, m, n, batches[0], keep=True) for method in METHODS}
    times = time_interleaved(builts, batches, plan)
    row = dict(size=size, n=n, psi=m.psi, dtype="fp32", global_batch=plan.global_batch,
               seq_len=plan.seq_len,
               times={k: _summary(v) for k, v in times.items()},
               raw={k: v for k, v in times.items()},
               memory={k: z1.inspect.memory(b.compiled) for k, b in builts.items()},
               compile_s={k: b.compile_s for k, b in builts.items()},
               zero1_over_ddp=_ratio(times, "zero1_rs", "ddp"),
               zero1_over_gspmd=_ratio(times, "zero1_rs", "gspmd"),
               zero1_ar_over_ddp=_ratio(times, "zero1_ar", "ddp"))
    rows.append(row)
    log(f"  speed {size} (psi={m.psi / 1e6:.2f}M, {row['times']['ddp']['n']} rounds): " +
        ", ".join(f"{k}={v['median'] * 1e3:.1f}ms" for k, v in row["times"].items()) +
        f"; zero1/ddp={row['zero1_over_ddp']['ratio']:.3f}"
        f" zero1/gspmd={row['zero1_over_gspmd']['ratio']:.3f}")
    del builts
  return rows


def bucket_section(plan: Plan, log=print) -> dict:
  """ZeRO-1 (reduce-scatter) collective count and step time vs bucket_bytes
  with every leaf packed into buckets (``inplace_bytes=None``), timed
  interleaved with DDP as the reference."""
  n = max(plan.ns)
  m = model(plan.bucket_size, "fp32", plan.seq_len)
  batches = [device_batch(batch(plan.global_batch, plan.seq_len, s), n) for s in range(4)]
  # Every leaf packed (inplace_bytes=None): what bucket_bytes alone does.
  builts = {f"b{bb}": build("zero1_rs", m, n, batches[0], bucket_bytes=bb,
                            inplace_bytes=None) for bb in plan.buckets}
  builts["ddp"] = build("ddp", m, n, batches[0], keep=True)
  times = time_interleaved(builts, batches, plan)
  padded = 4 * n * sum(l.shard_size for l in z1.plan(m.params, n).leaves
                       if l.kind == "shard")
  rows = []
  for bb in plan.buckets:
    coll = z1.inspect.collectives(builts[f"b{bb}"].compiled)
    rows.append(dict(
        bucket_bytes=bb,
        reduce_scatter=coll.get("reduce-scatter", z1.inspect.Collective(0, 0, 0)).count,
        all_gather=coll.get("all-gather", z1.inspect.Collective(0, 0, 0)).count,
        expected_per_kind=math.ceil(padded / bb),
        traffic=sum(c.traffic for c in coll.values()),
        time=_summary(times[f"b{bb}"]),
        over_ddp=_ratio(times, f"b{bb}", "ddp"),
        temp=z1.inspect.memory(builts[f"b{bb}"].compiled)["temp"]))
    log(f"  bucket {bb:>9d}: rs={rows[-1]['reduce_scatter']} ag={rows[-1]['all_gather']}"
        f" t={rows[-1]['time']['median'] * 1e3:.1f}ms"
        f" /ddp={rows[-1]['over_ddp']['ratio']:.3f}")
  return dict(size=plan.bucket_size, psi=m.psi, n=n, grad_bytes=padded,
              ddp_time=_summary(times["ddp"]), rows=rows)


def _median_update_time(update, p, s, g, warmup: int = 3, reps: int = 20):
  """Median seconds of ``p, s = update(p, s, g)`` (donating), after warm-up;
  returns ``(median, p, s)`` so the donated buffers stay owned."""
  for _ in range(warmup):
    p, s = update(p, s, g)
  jax.block_until_ready((p, s))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    p, s = update(p, s, g)
    jax.block_until_ready((p, s))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts), p, s


def adam_bandwidth_section(plan: Plan, log=print) -> dict:
  """Time of one jitted, donating ``optax.adamw`` update of ``adam_bw_psi``
  fp32 parameters on one device, as bytes moved per second vs the roofline.

  An elementwise Adam step must read p, g, mu, nu and write p, mu, nu:
  28 bytes per parameter. zero1's per-device update at N=1 (the
  ``apply`` in a shard_map, which also packs, unscales and norms the
  gradients) is timed beside it.
  """
  psi = plan.adam_bw_psi
  dev = jax.devices()[0]
  tx = optimizer()
  rows = max(1, psi // 4096)
  shape = (rows, 4096)
  psi = rows * 4096
  p = jax.device_put(jnp.full(shape, 0.5, jnp.float32), dev)
  g = jax.device_put(jnp.full(shape, 1e-3, jnp.float32), dev)
  s = jax.jit(tx.init)(p)

  def adam_step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  adam = jax.jit(adam_step, donate_argnums=(0, 1))
  t, p, s = _median_update_time(adam, p, s, g)
  moved = 28 * psi
  out = dict(psi=psi, bytes_moved=moved, median_s=t, tb_s=moved / t / 1e12,
             roofline_tb_s=plan.hbm_tb_s, fraction_of_roofline=moved / t / 1e12 / plan.hbm_tb_s,
             device=str(dev.device_kind))
  del p, s

  # zero1 at N=1: the whole update path (gradients given), params fp32.
  mesh = make_mesh(1)
  ztx = z1.zero1(tx, axis_name="data")
  params = {"w": jnp.full(shape, 0.5, jnp.float32)}
  zp, zs = z1.init(ztx, params, mesh)
  specs = z1.specs.state_specs(ztx, params, 1)
  rep = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), params)

  def per_device(p, s, g):
    np_, ns, _ = ztx.apply(jax.lax.pcast(g, "data", to="varying"), s, p)
    return np_, ns

  zstep = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(rep, specs, rep),
                                out_specs=(rep, specs), check_vma=False),
                  donate_argnums=(0, 1))
  out["zero1_median_s"], zp, zs = _median_update_time(zstep, zp, zs, {"w": g})
  out["zero1_over_adam"] = out["zero1_median_s"] / t
  log(f"  adam bw: psi={psi / 1e6:.0f}M {t * 1e3:.2f}ms = {out['tb_s']:.2f} TB/s "
      f"({100 * out['fraction_of_roofline']:.0f}% of {plan.hbm_tb_s} TB/s); "
      f"zero1 N=1 update {out['zero1_median_s'] * 1e3:.2f}ms")
  return out
