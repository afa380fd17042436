"""experiments.bench and experiments.baselines on a tiny BERT at N = 1, 2.

Checks what the benchmark measures (bytes, collectives, the plumbing of the
timing and the report), never how fast anything is.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zero1_jax as z1
from experiments import baselines as bl
from experiments.bench import run as bench
from helpers import assert_close, batch, float_part, loss_fn, mesh, odd_params, optax_run

TINY = dict(hidden_size=16, num_layers=1, num_heads=1, intermediate_size=32)
PLAN = bench.Plan(ns=(2,), state_size="test", speed_sizes=("test",),
                  ratio_sizes=("test",), bucket_size="test",
                  buckets=(1 << 12, bench.DEFAULT_BUCKET), seq_len=8,
                  per_device_batch=1, global_batch=2, dtypes=("fp32", "bf16"),
                  speed_budget_s=0.0, min_rounds=2, max_rounds=2, warmup=1,
                  overhead_ns=(2,))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  bench.SIZES["test"] = TINY
  out = str(tmp_path_factory.mktemp("bench"))
  # state in both dtypes; the costly compiles (memory, collectives) in fp32 only
  res = bench.run(PLAN, out=None, sections=("state",), log=lambda *_: None)
  plan2 = bench.dataclasses.replace(PLAN, dtypes=("fp32",))
  res2 = bench.run(plan2, out=out, sections=("memory", "speed", "overhead", "buckets"),
                   log=lambda *_: None)
  res2["state"] = res["state"]
  yield res2, out
  del bench.SIZES["test"]


@pytest.mark.slow   # the tiny benchmark run (the `result` fixture): ~70 s
def test_state_bytes_match_theory(result):
  res, _ = result
  rows = res["state"]
  assert {(r["dtype"], r["n"]) for r in rows} == {("fp32", 2), ("bf16", 2)}
  for r in rows:
    assert r["state_master_bytes"] == r["state_master_bytes_min"]  # same on every device
    if r["method"] == "zero1_rs":
      # sharded: 8 bytes (fp32: mu, nu; the params are the master) or 12
      # (bf16: + the fp32 master) per padded element + 20 bytes of scalars
      per = 8 if r["dtype"] == "fp32" else 12
      assert r["sharded_state_bytes"] <= per * (r["psi"] + r["padding_elems"]) / r["n"] + 20
      assert r["sharded_state_bytes"] >= per * r["psi"] / r["n"]
      assert r["sharded_state_theory"] == per * r["psi"] / r["n"]
      assert r["ratio"] == pytest.approx(1.0, abs=2e-3)
    else:
      # adam's count is the only extra (4 bytes)
      assert r["state_master_bytes"] == pytest.approx(r["theory_bytes"], abs=8)
  by = {(r["dtype"], r["method"]): r for r in rows}
  psi = rows[0]["psi"]
  assert by["fp32", "ddp"]["state_master_bytes"] == 12 * psi + 4      # + adam's count
  assert by["fp32", "gspmd"]["state_master_bytes"] == 4 * psi + 4 * psi + 4
  assert by["bf16", "gspmd"]["state_master_bytes"] == 6 * psi + 4
  # fp32: ZeRO-1 holds what GSPMD holds (params as master + moments / N),
  # up to its padding and loss-scale scalars.
  z = by["fp32", "zero1_rs"]
  assert z["state_master_bytes"] == (4 * psi + z["sharded_state_bytes"])


@pytest.mark.slow   # the tiny benchmark run (the `result` fixture): ~70 s
def test_collectives_follow_theory(result):
  res, _ = result
  coll = {r["method"]: r for r in res["collectives"]}
  assert set(coll) == set(bench.METHODS)
  assert set(coll["ddp"]["kinds"]) == {"all-reduce"}
  assert coll["zero1_rs"]["kinds"]["reduce-scatter"]["count"] == 1
  assert coll["zero1_rs"]["vs_ddp"] == pytest.approx(1.0, rel=0.01)
  assert coll["zero1_ar"]["vs_ddp"] == pytest.approx(1.5, rel=0.01)
  for m in ("zero1_rs", "zero1_ar", "ddp"):
    assert coll[m]["ratio"] == pytest.approx(1.0, rel=0.01)


@pytest.mark.slow   # the tiny benchmark run (the `result` fixture): ~70 s
def test_memory_rows_and_donation(result):
  res, _ = result
  mem = {r["method"]: r for r in res["memory"]}
  for r in mem.values():
    assert r["peak"] == r["argument"] + r["output"] - r["alias"] + r["temp"]
    assert r["alias"] > 0.9 * r["argument"] - 4096   # params and state donated
  # sharded state: ZeRO-1 holds less than DDP once N > 1
  assert mem["zero1_rs"]["argument"] < mem["ddp"]["argument"]


@pytest.mark.slow   # the tiny benchmark run (the `result` fixture): ~70 s
def test_speed_buckets_targets_and_outputs(result):
  res, out = result
  (sp,) = res["speed"]
  assert set(sp["times"]) == set(bench.METHODS)
  assert all(t["n"] == 2 and t["median"] > 0 for t in sp["times"].values())
  assert sp["zero1_over_ddp"]["ratio"] > 0
  rows = res["buckets"]["rows"]
  assert rows[0]["reduce_scatter"] == rows[0]["expected_per_kind"] > 1
  assert rows[-1]["reduce_scatter"] == rows[-1]["all_gather"] == 1
  names = {t["target"].split(" <=")[0].split(" =")[0] for t in res["targets"]}
  assert any("collective" in n for n in names) and any("DDP" in n for n in names)
  with open(os.path.join(out, "bench.json")) as f:
    assert json.load(f)["plan"]["ns"] == [2]
  for name in ("tables.md", "collectives.png", "step_time.png", "buckets.png",
               "memory_vs_n.png"):
    assert os.path.getsize(os.path.join(out, name)) > 0
  assert "| zero1_rs |" in bench.tables(res)


@pytest.mark.slow   # the tiny benchmark run (the `result` fixture): ~70 s
def test_overhead_section_measures_above_the_floor(result):
  """The floor communicates nothing and writes less than DDP; the report
  carries the overhead targets. (That in place writes less than packed is
  asserted on a model with large leaves in tests/test_memory_comm.py.)"""
  res, out = result
  (r,) = res["overhead"]
  assert r["n"] == 2 and set(r["overhead_ms"]) == {"zero1_rs", "zero1_in_place", "zero2",
                                                  "ddp", "gspmd"}
  floor = bench.build("floor", bench.model("test", "fp32", PLAN.seq_len), 2,
                      bench.device_batch(bench.batch(2, PLAN.seq_len), 2))
  assert z1.inspect.collectives(floor.compiled) == {}
  assert r["written"]["floor"] < r["written"]["ddp"]
  names = [t["target"] for t in res["targets"]]
  assert any("overhead above the floor" in n for n in names)
  assert any("floor peak" in n for n in names)
  with open(os.path.join(out, "tables.md")) as f:
    assert "| 2 | zero1_in_place |" in f.read()


def test_hlo_bytes_counts_buffers_not_views():
  from experiments.probes.hlo_bytes import written
  hlo = """HloModule m

%f (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%a)
}

ENTRY %main (p: f32[4], q: f32[2,3]) -> (f32[4], f32[8]) {
  %p = f32[4]{0} parameter(0)
  %q = f32[2,3]{1,0} parameter(1)
  %b = f32[4]{0} bitcast(%p)
  %fusion.1 = f32[4]{0} fusion(%b), kind=kLoop, calls=%f
  %all-gather = f32[8]{0} all-gather(%fusion.1), dimensions={0}
  %t = (f32[4]{0}, f32[8]{0}) tuple(%fusion.1, %all-gather)
  ROOT %g = f32[4]{0} get-tuple-element(%t), index=0
}
"""
  w = written(hlo)
  assert w.total == 16 + 32          # the fusion and the all-gather only
  assert w.by_op == {"fusion:fusion": 16, "all-gather": 32}


def test_baselines_train_like_optax():
  """A few DDP / GSPMD steps equal optax on the loss each one means: DDP
  averages the devices' mean losses, GSPMD takes the global mean (the same
  here: equal rows per device). Odd leaves stay replicated under GSPMD."""
  params = dict(float_part(odd_params()), even=jnp.ones((4, 6)))
  bs = [batch(8, seed=s) for s in range(3)]
  want = optax_run(optax.adam(1e-2), params, bs)
  msh = mesh(2)
  for name, init, make in (
      ("ddp", bl.ddp_init, lambda tx: bl.ddp_train_step(loss_fn, tx, msh)),
      ("gspmd", bl.gspmd_init, lambda tx: bl.gspmd_train_step(loss_fn, tx, msh, params))):
    tx = optax.adam(1e-2)
    p, s = init(tx, params, msh)
    step = make(tx)
    for b in bs:
      p, s, metrics = step(p, s, b)
    assert_close(p, want, 1e-5, f"{name} ")
  p, s = bl.gspmd_init(optax.adam(1e-2), params, msh)
  mu = s.inner[0].mu
  assert mu["even"].sharding.spec == P("data", None)
  assert mu["dense"]["kernel"].sharding.spec == P()        # (5, 7): nothing divides
  assert s.master is None                                  # fp32: params are the master
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  _, s16 = bl.ddp_init(optax.adam(1e-2), p16, msh)
  assert s16.master["even"].dtype == jnp.float32


def test_theory_formulas():
  psi = 1000
  assert bench.model_state_theory("zero1_rs", psi, 8, "bf16") == (2 + 2 + 12 / 8) * psi
  assert bench.model_state_theory("ddp", psi, 8, "bf16") == 16 * psi
  assert bench.model_state_theory("zero1_rs", psi, 8, "fp32") == (4 + 4 + 8 / 8) * psi
  assert bench.state_master_theory("zero1_rs", psi, 4, "fp32") == 4 * psi + 2 * psi
  assert bench.state_master_theory("zero1_rs", psi, 4, "bf16") == 3 * psi
  assert bench.sharded_state_theory(psi, 4, "fp32") == 2 * psi
  assert bench.sharded_state_theory(psi, 4, "bf16") == 3 * psi
  assert bench.traffic_theory("zero1_rs", psi, 4)["total"] == bench.traffic_theory(
      "ddp", psi, 4)["total"] == 8 * psi
  assert bench.traffic_theory("zero1_ar", psi, 2)["total"] == 6 * psi
  assert bench.state_master_theory("gspmd", psi, 4, "fp32") == 4 * psi + 2 * psi


def test_collective_costs_programs_compute_what_they_are_named():
  """experiments.probes.collective_costs times the programs it names: each one's
  result is checked at N=2 (a psum doubles, a scatter keeps this device's
  part of the sum, a gather rebuilds the first part of every shard), then a
  quick table has a row per program."""
  from experiments.probes import collective_costs as cc
  n, k, e = 2, 4, 16
  m = mesh(n)
  host = np.arange(n * e, dtype=np.float32)
  x = jax.device_put(host, jax.sharding.NamedSharding(m, P("data")))
  mine = host.reshape(n, e)                  # row r: device r's vector
  total = mine.sum(0)
  got = {name.split(" (")[0]: np.asarray(jax.jit(jax.shard_map(
      f, mesh=m, in_specs=P("data"), out_specs=P("data"), check_vma=False))(x)).reshape(n, -1)
         for name, f in cc.programs(n, k, axis="data").items()}
  both = lambda v: np.stack([v] * n)         # the same on every device
  first = lambda rows: np.concatenate([r[:r.shape[0] // n] for r in rows])
  want = {
      "copy": 2 * mine, "psum": both(total), "psum_scatter": total.reshape(n, -1),
      "all_gather": both(first(mine)), f"split into {k}": mine,
      f"psum of a {k}-leaf tree": both(total),
      f"{k} psum_scatters": np.stack(
          [np.concatenate([p.reshape(n, -1)[r] for p in total.reshape(k, -1)])
           for r in range(n)]),
      f"{k} all_gathers": both(np.concatenate(
          [first(mine[:, j * e // k:(j + 1) * e // k]) for j in range(k)]))}
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  lines = cc.table({2: cc.measure(2, 64, k=2, rounds=2)}, 64)
  assert sum(l.startswith("| ") for l in lines) == 1 + len(cc.programs(2, 2)) + 2


def test_peak_breakdown_reads_xla_dumps_that_add_up(tmp_path):
  """experiments.probes.peak_breakdown on a real dump of a small jitted ``step``
  (written by this jax's XLA): the heap it reads is memory_analysis's peak
  within 8 KiB, and the buffers live at the peak fit in that heap."""
  import subprocess
  import sys
  import textwrap
  from experiments.probes import peak_breakdown as pb
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp
      def step(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g
      c = jax.jit(step).lower(jnp.ones((256, 256)), jnp.ones((64, 256))).compile()
      m = c.memory_analysis()
      print(m.argument_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes + m.temp_size_in_bytes)
  """)
  env = {**os.environ, "XLA_FLAGS": (
      f"--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=.*jit_step.* "
      f"--xla_dump_hlo_as_text"), "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True).stdout
  peak = int(out.split()[-1])
  got = pb.parse(str(tmp_path))
  assert abs(got["heap"] - peak) <= 8192, (got["heap"], peak)
  assert 0 < got["live"] <= got["heap"]
  # here the update writes over the gradient's buffer: both are listed live
  # at the peak, and counted once
  assert got["live"] < sum(b for _, b, _ in got["buffers"])
  assert any(op == "(argument)" and b == 256 * 256 * 4 for _, b, op in got["buffers"])


def test_overhead_log_survives_ddp_at_the_floor():
  """A tiny model's DDP step can time at or below the floor on a loaded
  machine: the ratio is None, and the log line once crashed formatting it
  (every test of this file then errored in the fixture)."""
  from experiments.bench import overhead as bench_overhead
  assert bench_overhead._ratio_text(None) == "n/a (DDP not above the floor)"
  assert bench_overhead._ratio_text(0.5) == "0.500"


def test_a_target_that_could_not_be_measured_is_missed_not_a_crash():
  """On loaded CI cores the tiny bench once produced a target without a
  value, and writing tables.md crashed (TypeError formatting None): every
  test of this file errored. It reads '-' and MISSED."""
  from experiments.bench import report as bench_report
  res = {"plan": {"ns": [2], "dtypes": ["fp32"]},
         "targets": [{"target": "x <= 1", "value": None, "met": False,
                      "detail": "not measured"}]}
  assert "| x <= 1 | - | MISSED | not measured |" in bench_report.tables(res)
