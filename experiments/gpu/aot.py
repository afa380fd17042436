"""Every form's step compiled for 8 to 64 NVIDIA GPUs, on a machine without one.

XLA's real GPU compiler builds each step for H100s (jax's compile-only
topologies, :mod:`zero1_jax.inspect.gpu`), and its latency-hiding scheduler's
timeline says what one step costs: every figure here is XLA's cost model
(NCCL tables for collectives, a roofline for fusions), an estimate, not a
measurement. Per form: the estimated step, its time above the
no-communication floor, the collective time no compute hides, the bytes its
collectives move, its peak per device (``memory_analysis``) and the bytes
live at that peak (the rest is what the heap's packing leaves unused; read
from XLA's dump of the compile).

  python -m experiments.gpu.aot                      # BERT-base + GPT-2 small, fp32 + bf16, 8 GPUs
  python -m experiments.gpu.aot --gpus 8,16,32,64 --forms floor,ddp,train_step
  python -m experiments.gpu.aot --out experiments/results   # writes gpu_aot.json / gpu_aot.md
  python -m experiments.gpu.aot --tables experiments/results/gpu_aot.json --lines   # peaks
  python -m experiments.gpu.aot --forms jit_grad --xla xla_gpu_reduce_scatter_combine_threshold_bytes=8388608

Forms: ``floor`` (forward, backward, a local SGD step; only the loss's scalar
all-reduce), ``ddp`` (optax in plain jit, params and state replicated: the
partitioner all-reduces the gradients; bf16 params keep an fp32 master, as
DeepSpeed's bf16 does), ``ddp_nomaster`` (bf16 only: optax straight on the
bf16 params), ``gspmd`` (optax's state sharded over the data axis, the
partitioner's collectives), ``train_step`` / ``zero2`` (``z1.train_step``),
``train_step_gathered`` (``train_step`` with ``shard_lookups=False``: the
embedding gathered whole before its lookup, the plan before
core/lookup.py),
``engine`` (``z1.initialize``'s step from a DeepSpeed config with
gradient clipping), ``jit_grad`` (``z1.zero1`` in plain jit after
``jax.value_and_grad``), ``jit_vg`` (after ``z1.value_and_grad``) and
``jit_vg_gathered`` (``jit_vg`` with ``shard_lookups=False``); not in the
default list, ``jit_ts`` (flax's ``TrainState.apply_gradients`` with
``z1.zero1`` in plain jit) and ``jit_ts_nocheck`` (the same without zero1's
check for a state restored new mid-run; that check now runs at trace time,
so the two compile to the same program).
Needs jax's CUDA plugin at jax's version (``make gpu-aot`` installs it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

PLUGINS = os.path.join(sys.prefix, "aot-plugins")
if os.path.isdir(PLUGINS):   # the Makefile's: the plugin beside the venv, not in it
  sys.path.insert(0, PLUGINS)

import jax  # noqa: E402

# Compile-only: jax's CPU backend hosts the run. experiments/gpu/measure.py,
# which runs these steps on a real GPU, sets ZERO1_REAL_GPU=1 first.
if os.environ.get("ZERO1_REAL_GPU") != "1":
  jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zero1_jax as z1  # noqa: E402
from experiments import baselines as bl  # noqa: E402
from zero1_jax.deepspeed import engine as ds_engine  # noqa: E402
from zero1_jax.deepspeed import config as ds_config  # noqa: E402
from zero1_jax.inspect import gpu, schedule as sched  # noqa: E402
from zero1_jax.models import bert, gpt  # noqa: E402
from experiments.probes import peak_breakdown  # noqa: E402
from experiments.gpu.aot_tables import (  # noqa: E402
    BASELINES, FORMS, REFERENCE, glance, goals, lines, scaling, table)

# the params' dtype and the compute dtype: "mixed" is fp32 params computing
# in bf16 (flax's lm1b's and nanodo's precision), where DDP keeps no master
PRECISIONS = {"fp32": (jnp.float32, jnp.float32),
              "bf16": (jnp.bfloat16, jnp.bfloat16),
              "mixed": (jnp.float32, jnp.bfloat16)}
# (config, per-device batch, sequence length): BERT-base MLM at 8 x 128
# tokens a device (the 64 x 128 on 8 GPUs); GPT-2 small at 2 x 1024.
MODELS = {
    "bert-base": (lambda dt: bert.make_config("bert-base-uncased", 30522, 128, dt), 8, 128),
    "gpt2": (lambda dt: gpt.make_config("gpt2", 50257, 1024, dt), 2, 1024),
    # small enough for tests/test_gpu_aot.py (3.7M params, ~10 s a compile);
    # 2050 rows, as BERT-base's 30522 and GPT-2's 50257 do not divide by 8:
    # the table is split on its columns, and its lookups read the blocks
    "small-bert": (lambda dt: bert.make_config(
        "bert-tiny", 2050, 128, dt, num_layers=4, hidden_size=256, num_heads=4,
        intermediate_size=1024), 32, 128),
}


# Every form compiles with cuBLAS gemms, as MaxText's GPU configs set
# (configs/gpu/*/*.sh: --xla_gpu_enable_triton_gemm=false): with Triton's,
# XLA's cost model puts BERT-base's bf16 gemms at CUDA-core speed (the bf16
# floor estimated at 23,374 µs, against 9,315 in fp32; 6,712 with cuBLAS).
OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def optimizer() -> optax.GradientTransformation:
  return optax.adamw(1e-4, weight_decay=0.01)


def model(name: str, dtype: str):
  """(param ShapeDtypeStructs, loss_fn, per-device batch, seq length)."""
  make, per_device, seq = MODELS[name]
  param_dtype, compute_dtype = PRECISIONS[dtype]
  cfg = make(compute_dtype)
  mod = gpt if isinstance(cfg, gpt.GptConfig) else bert
  shapes = jax.eval_shape(
      lambda k: mod.init_params(cfg, k, param_dtype=param_dtype), jax.random.key(0))
  return shapes, mod.make_loss_fn(cfg), per_device, seq


def placed(tree, mesh, spec_of=lambda _: P()):
  """ShapeDtypeStructs carrying NamedShardings on ``mesh``."""
  return jax.tree.map(lambda x, s=None: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, spec_of(x))), tree)


def with_shardings(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def ds_json(dtype: str, stage: int, bucket_bytes: int | None = None,
            gather_bucket_bytes: int | None = None) -> dict:
  """A DeepSpeed config as HF's integration writes one: AdamW, clipping 1.0
  (``bucket_bytes``: reduce and all-gather bucket sizes, as fp32 elements;
  ``gather_bucket_bytes``: the all-gather's alone)."""
  zero = {"stage": stage}
  if bucket_bytes:
    zero.update(reduce_bucket_size=bucket_bytes // 4,
                allgather_bucket_size=bucket_bytes // 4)
  if gather_bucket_bytes:
    zero.update(allgather_bucket_size=gather_bucket_bytes // 4)
  cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
         "zero_optimization": zero,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
  if dtype == "bf16":
    cfg["bf16"] = {"enabled": True}
  return cfg


def lower(form: str, name: str, dtype: str, mesh, **zero1_kw):
  """The form's step lowered for ``mesh`` on abstract arguments
  (``zero1_kw``: more keywords for z1.zero1 / z1.zero2, and
  ``shard_lookups`` / ``grad_accum_steps`` for the step)."""
  step_kw = {k: zero1_kw.pop(k) for k in ("shard_lookups", "grad_accum_steps")
             if k in zero1_kw}
  if form in ("train_step_gathered", "jit_vg_gathered"):
    form, step_kw = form[:-9], {**step_kw, "shard_lookups": False}
  shapes, loss_fn, per_device, seq = model(name, dtype)
  n = mesh.shape["data"]
  key = "input_ids"
  b = {key: jax.ShapeDtypeStruct((n * per_device, seq), jnp.int32)}
  if name != "gpt2":
    b["labels"] = b[key]
  batch = placed(b, mesh, lambda _: P("data"))
  params = placed(shapes, mesh)
  rep = NamedSharding(mesh, P())
  if form == "floor":
    return bl.floor_train_step(loss_fn, mesh, mean_loss=True).lower(params, None, batch)
  if form in ("ddp", "ddp_nomaster", "gspmd"):
    tx = optimizer()
    if form == "ddp_nomaster":
      state = placed(jax.eval_shape(tx.init, shapes), mesh)

      def step(p, s, bt):
        loss, g = jax.value_and_grad(loss_fn)(p, bt)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss
      return jax.jit(step, out_shardings=(rep, rep, rep),
                     donate_argnums=(0, 1)).lower(params, state, batch)
    abstract = jax.eval_shape(lambda p: bl._init_state(tx, p), shapes)
    if form == "gspmd":
      state = with_shardings(abstract, bl.gspmd_state_shardings(tx, shapes, mesh))
      return bl.gspmd_train_step(loss_fn, tx, mesh, shapes).lower(params, state, batch)
    state = placed(abstract, mesh)

    def step(p, s, bt):
      loss, g = jax.value_and_grad(loss_fn)(p, bt)
      p, s = bl._update(tx, g, s, p)
      return p, s, loss
    return jax.jit(step, out_shardings=(rep, rep, rep),
                   donate_argnums=(0, 1)).lower(params, state, batch)
  if form in ("jit_ts", "jit_ts_nocheck"):
    return _lower_train_state(form, shapes, loss_fn, params, batch, mesh)
  if form == "engine":
    cfg = ds_config.load_config(ds_json(dtype, 1, **zero1_kw), world_size=n)
    tx = ds_engine.build_tx(cfg, "data")
    step = ds_engine.make_step(cfg, tx, loss_fn, mesh)
  else:
    tx = (z1.zero2 if form == "zero2" else z1.zero1)(optimizer(), axis_name="data",
                                                     **zero1_kw)
    step = (z1.train_step(loss_fn, tx, mesh, **step_kw)
            if form in ("train_step", "zero2") else None)
  state = with_shardings(jax.eval_shape(lambda p: z1.init(tx, p, mesh)[1], shapes),
                         z1.state_shardings(tx, shapes, mesh))
  if step is not None:
    return step.lower(params, state, batch)
  grad = jax.value_and_grad if form == "jit_grad" else (
      lambda f: z1.value_and_grad(f, tx, **step_kw))
  # BERT's loss is a masked mean (total / count): under z1.value_and_grad
  # each device divides by its own rows' count, which zero1 warns of
  # (core/rows.py). The fix (n * total / the whole batch's count, an
  # argument) adds one scalar all-reduce; the step timed here keeps the
  # model's loss as written (docs/gpu.md) and silences that warning.

  def user_step(p, s, bt):
    loss, g = grad(loss_fn)(p, bt)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"zero1: z1\.value_and_grad "
                            r"runs the loss on each device's rows")
    return jax.jit(user_step, donate_argnums=(0, 1)).lower(params, state, batch)


def _lower_train_state(form, shapes, loss_fn, params, batch, mesh):
  """flax's TrainState with ``z1.zero1`` in plain jit, as flax's examples
  step (``jit_ts_nocheck``: without zero1's check for a state restored new
  mid-run, core/fresh_state.py, which now runs at trace time: the two
  compile to the same step; measured before that, the check cost 2.1x).
  Lowered as ``(train_state, None, batch) -> (train_state, None, loss)``."""
  from flax.training import train_state
  from zero1_jax.core import fresh_state
  tx = z1.zero1(optimizer(), axis_name="data", mesh=mesh)
  ts = jax.eval_shape(lambda p: train_state.TrainState.create(
      apply_fn=None, params=p, tx=tx), shapes)
  rep = NamedSharding(mesh, P())
  # zero1's boxed state (Partitioned-like leaves) keeps its tree; each leaf
  # placed as z1.state_shardings plans it
  flat, tree = jax.tree.flatten(ts.opt_state)
  plan = jax.tree.leaves(z1.state_shardings(tx, shapes, mesh))
  ts = ts.replace(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), params=params,
                  opt_state=jax.tree.unflatten(tree, [
                      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                      for x, s in zip(flat, plan, strict=True)]))

  def step(t, _, bt):
    loss, g = jax.value_and_grad(loss_fn)(t.params, bt)
    return t.apply_gradients(grads=g), None, loss
  check = fresh_state.warn_if_new
  if form == "jit_ts_nocheck":
    fresh_state.warn_if_new = lambda *a: None
  try:
    with jax.set_mesh(mesh):
      return jax.jit(step, donate_argnums=(0,)).lower(ts, None, batch)
  finally:
    fresh_state.warn_if_new = check


def zero1_kw_for(form: str, zero1_kw: dict) -> dict | None:
  """The keywords ``form`` compiles with (None: it cannot take them); the
  engine takes the two bucket sizes its DeepSpeed config has."""
  if form in BASELINES or not zero1_kw:
    return {}
  if form == "engine" and set(zero1_kw) - {"bucket_bytes", "gather_bucket_bytes"}:
    return None
  return dict(zero1_kw)


def measure(form: str, name: str, dtype: str, gpus: int, kind: str = "h100",
            zero1_kw: dict | None = None, xla: dict | None = None) -> dict:
  """One compiled form: XLA's estimate, exposure, bytes and peak
  (``zero1_kw``: more keywords for the zero1 forms, see :func:`lower`;
  ``xla``: more XLA options, for every form, as ``jax.jit(...,
  compiler_options=...)`` or ``XLA_FLAGS`` would give them)."""
  hosts = max(1, gpus // 8)
  mesh = gpu.mesh(gpus, ("data",), gpu=kind, hosts=hosts)
  kw = zero1_kw_for(form, zero1_kw or {})
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="zero1_aot_") as dump:
    compiled, schedule = gpu.compile(lower(form, name, dtype, mesh, **kw),
                                     {**OPTIONS, **(xla or {})},
                                     dump_to=dump)
    mem = z1.inspect.memory(compiled)
    temp_live = peak_breakdown.temp_live_at_peak(dump, mem["temp"])
  s = sched.summary(schedule)
  colls = z1.inspect.hlo_collectives(compiled.as_text())
  return {
      "form": form, "model": name, "dtype": dtype, "gpus": gpus, "gpu": kind,
      **({"zero1_kw": kw} if kw else {}), **({"xla": dict(xla)} if xla else {}),
      "step_us": s.step_us, "compute_us": s.compute_us, "exposed_us": s.exposed_us,
      "exposed_by_kind": s.exposed_by_kind,
      "collectives": {k: {"count": c.count, "bytes": c.bytes} for k, c in colls.items()},
      "peak_bytes": mem["peak"],
      # what the step holds at its peak: its arguments and outputs, and the
      # temporaries live there (peak_bytes less the heap's unused gaps)
      "live_peak_bytes": mem["argument"] + mem["output"] - mem["alias"] + temp_live,
      "compile_s": time.perf_counter() - t0,
  }


def key_values(text: str) -> dict:
  """``KEY=VALUE,...`` as a dict, digits as integers, true/false as bools
  (XLA's options take no string for a bool)."""
  value = lambda v: (int(v) if v.isdigit() else
                     {"true": True, "false": False}.get(v.lower(), v))
  return {k: value(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


GOALS_HEAD = ("Each zero1 form against the goals of docs/gpu.md (XLA's cost model; "
              "`python -m experiments.gpu.aot --tables experiments/results/gpu_aot.json "
              "--lines --goals --out experiments/results`)\n\n")
REFERENCE_HEAD = ("\n\nFor scale, XLA's own sharding of the state (GSPMD, not a zero1 "
                  "form) held to the same bounds:\n\n")


def applicable(form: str, dtype: str) -> bool:
  return form != "ddp_nomaster" or dtype == "bf16"


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="bert-base,gpt2")
  ap.add_argument("--dtypes", default="fp32,bf16",
                  help=f"of {','.join(PRECISIONS)} (mixed: fp32 params, bf16 compute)")
  ap.add_argument("--gpus", default="8")
  ap.add_argument("--forms", default=",".join(FORMS))
  ap.add_argument("--gpu", default="h100", choices=sorted(gpu.GPUS))
  ap.add_argument("--out", default=None, help="directory for gpu_aot.json / .md")
  ap.add_argument("--tables", nargs="*", default=None,
                  help="only write the tables of these gpu_aot.json files (merged; a later "
                       "file's row replaces an earlier one's)")
  ap.add_argument("--zero1", default="",
                  help="KEY=VALUE,... more keywords for the zero1 forms (integers, or a "
                       "dtype's name), e.g. gather_bucket_bytes=33554432 or "
                       "reduce_dtype=bfloat16 (the engine takes the two bucket sizes)")
  ap.add_argument("--xla", default="",
                  help="KEY=VALUE,... XLA options for every form compiled, e.g. "
                       "xla_gpu_reduce_scatter_combine_threshold_bytes=8388608")
  ap.add_argument("--lines", action="store_true",
                  help="also print each zero1 form's peak against DDP's less the state it saves")
  ap.add_argument("--goals", action="store_true",
                  help="also print which rows meet each goal of aot_tables.GOALS")
  a = ap.parse_args(argv)
  zero1_kw, xla = key_values(a.zero1), key_values(a.xla)
  rows = []
  if a.tables is not None:   # a later file's row replaces an earlier one's
    merged = {}
    for path in a.tables:
      with open(path) as f:
        merged.update({(r["model"], r["dtype"], r["gpus"], r["form"],
                        r.get("gpu")): r for r in json.load(f)})
    rows = list(merged.values())
    a.models = a.dtypes = a.gpus = a.forms = ""
  for m in filter(None, a.models.split(",")):
    for dt in filter(None, a.dtypes.split(",")):
      for g in map(int, filter(None, a.gpus.split(","))):
        for f in filter(None, a.forms.split(",")):
          if not applicable(f, dt) or zero1_kw_for(f, zero1_kw) is None:
            continue
          r = measure(f, m, dt, g, a.gpu, zero1_kw, xla)
          rows.append(r)
          print(f"{m:10} {dt} {g:3} GPUs {f:13} step {r['step_us']:9,.0f} µs  exposed "
                f"{r['exposed_us']:7,.0f}  peak {r['peak_bytes'] / 2 ** 30:6.2f} GiB  "
                f"(compiled in {r['compile_s']:.0f} s)", flush=True)
  md = table([r for r in rows if r["gpus"] == 8])
  if len({r["gpus"] for r in rows}) > 1:
    md += ("\n\n**Step (µs) at 8 to 64 H100s, 8 a host** (XLA's cost model; in "
           "brackets: / DDP's step)\n\n" + scaling(rows)
           + "\n\n**At a glance** (step / DDP's, the range over the models)\n\n"
           + glance(rows))
  sizes = lambda: {m: sum(x.size for x in jax.tree.leaves(model(m, "fp32")[0]))
                   for m in {r["model"] for r in rows}}
  if a.lines:
    md += "\n\n**Peak per GPU against the memory line**\n\n" + lines(rows, sizes())
  goals_md = lambda: (GOALS_HEAD + goals(rows, sizes()) + REFERENCE_HEAD
                      + goals(rows, sizes(), REFERENCE))
  if a.goals:
    print(goals_md())
  print(md)
  if a.out:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_aot.json"), "w") as f:
      json.dump(rows, f, indent=1)
    with open(os.path.join(a.out, "gpu_aot.md"), "w") as f:
      f.write(md + "\n")
    if a.goals:
      with open(os.path.join(a.out, "gpu_goals.md"), "w") as f:
        f.write(goals_md() + "\n")


if __name__ == "__main__":
  main()
