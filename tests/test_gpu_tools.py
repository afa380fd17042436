"""The tools behind experiments/gpu/aot.py's tables, on this CPU-only machine.

What the GPU compile (tests/test_gpu_aot.py) is read with: ``"auto"``
collectives decided by the devices a program is compiled for;
``z1.inspect.hlo_collectives`` on each jax version's GPU HLO; XLA's H100
target config read without an error line; each collective priced alone
(experiments/gpu/collective_costs.py); docs/gpu.md's memory line; the
``--zero1`` keywords given only to the forms that take them.
"""

import jax
import numpy as np
import pytest

import zero1_jax as z1
from experiments.gpu import aot as gpu_aot
from zero1_jax.inspect import gpu


@pytest.fixture(scope="module")
def mesh():
  return gpu.mesh(8)


def test_auto_collectives_follow_the_devices_compiled_for(mesh):
  """inplace_bytes="auto": in place (one collective per large leaf, XLA
  combining them) for a program compiled for GPUs, packed (one bucket) on
  CPU, whatever backend jax runs on (here: CPU)."""
  assert jax.default_backend() == "cpu"
  params = {f"w{i}": jax.ShapeDtypeStruct((256, 256), np.float32) for i in range(3)}
  loss = lambda p, b: sum((b["x"] @ w).sum() for w in p.values())
  batch = {"x": jax.ShapeDtypeStruct((8, 256), np.float32)}

  def reduce_scatters(m):
    tx = z1.zero1(gpu_aot.optimizer(), axis_name="data")
    state = jax.eval_shape(lambda p: z1.init(tx, p, m)[1], params)
    state = gpu_aot.with_shardings(state, z1.state_shardings(tx, params, m))
    sds = lambda t, spec: gpu_aot.placed(t, m, lambda _: spec)
    low = z1.train_step(loss, tx, m, shard_params=False).lower(
        sds(params, jax.sharding.PartitionSpec()), state,
        sds(batch, jax.sharding.PartitionSpec("data")))
    return low.as_text().count("reduce_scatter")
  assert reduce_scatters(mesh) == 3
  assert reduce_scatters(jax.make_mesh((8,), ("data",))) == 1


@pytest.mark.parametrize("version", ["0.10.2", "0.12.0.1"])
def test_hlo_collectives_read_each_jax_versions_gpu_hlo(version):
  """tests/fixtures/make_gpu_hlo.py's program (an all-reduce of 16 MiB, a
  reduce-scatter and an all-gather of 2 MiB each) as each jax's XLA prints
  it for 8 H100s: jax 0.12 prints the async all-reduce as
  ((operands), results), which was counted twice (32 MiB)."""
  import pathlib
  text = (pathlib.Path(__file__).parent / "fixtures"
          / f"gpu_hlo_jax-{version}.txt").read_text()
  coll = z1.inspect.hlo_collectives(text)
  assert {k: (c.count, c.bytes) for k, c in coll.items()} == {
      "all-reduce": (1, 16 << 20), "reduce-scatter": (1, 2 << 20),
      "all-gather": (1, 2 << 20)}


def test_the_target_config_is_read_without_an_error_line():
  """jaxlib 0.10.2's parser predates a field of XLA's spec: the field is
  left out up front, not after an error line from XLA's C++ on the user's
  first screen (jax 0.12 reads the spec whole)."""
  import subprocess
  import sys
  code = ("import jax; jax.config.update('jax_platforms', 'cpu'); "
          "import experiments.gpu.aot; from zero1_jax.inspect import gpu; "
          "print(dict(gpu.mesh(8).shape))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "{'data': 8}" in out.stdout
  assert "Error parsing" not in out.stderr, out.stderr[-2000:]


def test_gpu_compiles_stay_out_of_the_persistent_cache(mesh, tmp_path):
  """An executable compiled for the compile-only topology cannot be loaded
  back from jax's persistent cache (the tests set one, conftest.py): read,
  it warned "PjRtCompiler must be constructed with a Client" and compiled
  again. ``gpu.compile`` writes no entry and passes over one written by a
  plain ``lowered.compile()`` with the same options, without the warning."""
  import os
  import warnings
  from jax.sharding import NamedSharding, PartitionSpec as P
  where = jax.config.jax_compilation_cache_dir
  x = jax.ShapeDtypeStruct((64, 64), np.float32, sharding=NamedSharding(mesh, P("data")))

  def entries(name):
    return [f for f in os.listdir(where) if f.startswith(f"jit_{name}-")] if where else []

  def zero1_cache_probe_written(x):
    return (x @ x.T).sum()

  def zero1_cache_probe_not_written(x):
    return (x @ x.T).max()

  key = "jax_persistent_cache_min_compile_time_secs"
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update(key, 0.0)      # write even a compile of milliseconds
  try:
    written = jax.jit(zero1_cache_probe_written).lower(x)
    written.compile(compiler_options={   # gpu.compile's options: the same key
        "xla_dump_to": str(tmp_path), "xla_dump_latency_hiding_schedule": True})
    if not entries("zero1_cache_probe_written"):
      pytest.skip("jax's persistent cache is not in use in this process")
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      compiled, schedule = gpu.compile(written)
      gpu.compile(jax.jit(zero1_cache_probe_not_written).lower(x))
  finally:
    jax.config.update(key, before)
  assert compiled.as_text() and schedule.ops
  assert jax.config.jax_persistent_cache_min_compile_time_secs == before
  assert entries("zero1_cache_probe_not_written") == []


def test_collective_costs_times_each_collective_alone():
  """experiments/gpu/collective_costs.py (docs/gpu.md's ratio of a
  reduce-scatter plus a gather to one all-reduce of the same bytes): each
  collective compiled with nothing beside it, so its window is its cost;
  more bytes cost more."""
  from experiments.gpu import collective_costs as cc
  try:
    small, large = cc.costs(2, 4), cc.costs(2, 16)
  except cc.Unpriced as e:   # jax 0.12: the tables are jax 0.10.2's
    if jax.__version_info__ < (0, 11):
      raise
    pytest.skip(str(e))
  assert set(small) == {"all-reduce", "reduce-scatter", "all-gather"}
  for kind in small:
    assert 0 < small[kind] < large[kind], kind


def test_the_memory_line_is_ddps_peak_less_the_state_zero1_saves():
  """docs/gpu.md's line for each form's peak per GPU: DDP's, less the
  optimizer state sharded away (2 fp32 moments; with bf16 params 3 fp32
  copies, DDP's master included), plus the param shard the forms that own
  the step keep between steps. Psi = 1 Mi params: figures in MiB."""
  from experiments.gpu import aot_tables as tables
  psi, mib = 1 << 20, 1 << 20
  ddp = {"form": "ddp", "model": "m", "gpus": 8, "peak_bytes": 100 * mib}
  rows = [dict(ddp, dtype=dt) for dt in ("fp32", "bf16")] + [
      {"form": f, "model": "m", "dtype": dt, "gpus": 8, "peak_bytes": pk * mib}
      for f, dt, pk in [("jit_vg", "fp32", 93), ("train_step", "fp32", 94),
                        ("jit_vg", "bf16", 89.5), ("zero2", "bf16", 89.75),
                        ("floor", "fp32", 1)]]
  line = {(r["form"], r["dtype"]): tables.memory_line(r, rows[0 if r["dtype"] == "fp32" else 1], psi)
          / mib for r in rows}
  assert line["jit_vg", "fp32"] == 100 - 8 * 7 / 8
  assert line["train_step", "fp32"] == 100 - 8 * 7 / 8 + 4 / 8
  assert line["jit_vg", "bf16"] == 100 - 12 * 7 / 8
  assert line["zero2", "bf16"] == 100 - 12 * 7 / 8 + 2 / 8
  out = tables.lines(rows, {"m": psi}).splitlines()[2:]
  assert [r.split("|")[3].strip() for r in out] == ["jit_vg", "train_step", "jit_vg", "zero2"]
  assert [r.split("|")[6].strip() for r in out] == ["0.0", "0.5", "0.0", "0.0"]
  assert [r.split("|")[7].strip() for r in out] == [""] * 4   # no live bytes measured
  # the same line for the bytes live at the peak, drawn from DDP's live bytes
  live = {("ddp", "fp32"): 90, ("ddp", "bf16"): 90, ("jit_vg", "fp32"): 83.5,
          ("train_step", "fp32"): 83, ("jit_vg", "bf16"): 79.5, ("zero2", "bf16"): 80}
  for r in rows:
    if (r["form"], r["dtype"]) in live:
      r["live_peak_bytes"] = live[r["form"], r["dtype"]] * mib
  out = tables.lines(rows, {"m": psi}).splitlines()[2:]
  assert [r.split("|")[8].strip() for r in out] == ["83.0", "83.5", "79.5", "79.8"]
  assert [r.split("|")[9].strip() for r in out] == ["0.5", "0.0", "0.0", "0.2"]


def test_zero1_keywords_reach_only_the_forms_that_take_them():
  """``--zero1 gather_bucket_bytes=...``: the zero1 forms compile with it,
  the baselines without; the engine takes what its DeepSpeed config has
  (``allgather_bucket_size``, in fp32 elements) and is left out, rather
  than compiled without it, for what the config has not."""
  kw = {"gather_bucket_bytes": 1 << 25}
  assert gpu_aot.zero1_kw_for("train_step", kw) == kw
  assert gpu_aot.zero1_kw_for("jit_grad", kw) == kw
  assert gpu_aot.zero1_kw_for("ddp", kw) == {}
  assert gpu_aot.zero1_kw_for("engine", kw) == kw
  assert gpu_aot.zero1_kw_for("engine", {"inplace_bytes": 1 << 16}) is None
  zero = gpu_aot.ds_json("fp32", 1, **kw)["zero_optimization"]
  assert zero == {"stage": 1, "allgather_bucket_size": 1 << 23}


def test_the_docs_table_at_a_glance_is_the_committed_estimates():
  """docs/gpu.md's table at a glance is :func:`aot_tables.glance` of the
  committed results (experiments/results/gpu_aot.json), so the two cannot
  drift apart; and a range spans the models: each form's lowest and
  highest step over DDP's."""
  import json
  import pathlib
  from experiments.gpu import aot_tables as tables
  root = pathlib.Path(__file__).resolve().parent.parent
  rows = json.loads((root / "experiments/results/gpu_aot.json").read_text())
  made = tables.glance(rows)
  page = (root / "docs/gpu.md").read_text()
  assert made in page, "regenerate docs/gpu.md's table at a glance:\n" + made
  ddp = {(r["model"], r["gpus"]): r["step_us"] for r in rows
         if r["form"] == "ddp" and r["dtype"] == "fp32"}
  ratios = [r["step_us"] / ddp[r["model"], r["gpus"]] for r in rows
            if r["form"] == "train_step" and r["dtype"] == "fp32" and r["gpus"] > 8]
  row = next(x for x in made.splitlines() if x.startswith("| `z1.train_step`"))
  assert row.split(" | ")[2] == f"{min(ratios):.2f}-{max(ratios):.2f}"


def test_each_goal_lists_the_rows_that_miss_it():
  """``--goals``: per goal, the rows it applies to, how many meet it, and
  each miss with its value; a row exactly at a bound meets it. One planted
  miss per goal (fp32, 8 GPUs unless said): ``train_step`` above the floor
  at 0.30 x DDP's, ``jit_vg`` at 0.80 x, ``jit_grad`` slower than GSPMD, and
  on 16 GPUs ``jit_vg`` slower than DDP and 2 MiB over the memory line."""
  from experiments.gpu import aot_tables as tables
  mib = 1 << 20
  row = lambda f, t, g=8, pk=100: {"model": "m", "dtype": "fp32", "gpus": g,
                                  "form": f, "step_us": t, "peak_bytes": pk * mib}
  line16 = 100 - 8 * 15 / 16   # DDP's peak less 8 Psi (1 - 1/N), Psi = 1 Mi
  rows = [row("floor", 1000), row("ddp", 2000), row("gspmd", 2100),
          row("train_step", 1300, pk=93), row("zero2", 1250, pk=93),
          row("engine", 1250, pk=93.5), row("jit_vg", 1800, pk=93),
          row("jit_grad", 2150, pk=93),
          row("floor", 1000, 16), row("ddp", 2000, 16), row("gspmd", 2500, 16),
          row("jit_vg", 2010, 16, line16 + 2), row("jit_grad", 2000, 16, line16)]
  out = {tuple(c.strip() for c in r.split("|")[1:3]): r.split("|")[3:5]
         for r in tables.goals(rows, {"m": 1 << 20}).splitlines()[2:]}
  got = {k[0]: (v[0].strip(), v[1].strip()) for k, v in out.items()}
  assert got == {
      "own the step: above floor <= 0.25 x DDP's, 8 GPUs":
          ("2 of 3", "m fp32 8 train_step: 0.30 x"),
      "z1.value_and_grad: above floor <= 0.75 x DDP's, 8 GPUs":
          ("0 of 1", "m fp32 8 jit_vg: 0.80 x"),
      "every form: step <= GSPMD's": ("6 of 7", "m fp32 8 jit_grad: 1.024"),
      "every form, 16-64 GPUs: step <= DDP's": ("1 of 2", "m fp32 16 jit_vg: 1.005"),
      "every form: peak <= the memory line":
          ("6 of 7", "m fp32 16 jit_vg: +2.0 MiB")}
  assert all(k[1] == "fp32, bf16" for k in out)   # no mixed rows: no mixed lines


def test_gspmd_is_held_to_the_same_bounds_for_scale():
  """``aot_tables.REFERENCE``: GSPMD (no zero1 form) against DDP's step
  across hosts and against the memory line, the zero1 forms' rows left
  out. Planted on 16 GPUs: GSPMD 1.050 of DDP's step and 1 MiB over the
  line; on 32, level with DDP and exactly on the line (met)."""
  from experiments.gpu import aot_tables as tables
  mib = 1 << 20
  row = lambda f, t, g, pk: {"model": "m", "dtype": "fp32", "gpus": g,
                             "form": f, "step_us": t, "peak_bytes": pk * mib}
  line = lambda g: 100 - 8 * (1 - 1 / g)   # DDP's peak less 8 Psi (1 - 1/N)
  rows = [row("ddp", 2000, 16, 100), row("gspmd", 2100, 16, line(16) + 1),
          row("jit_grad", 2500, 16, 200),
          row("ddp", 2000, 32, 100), row("gspmd", 2000, 32, line(32))]
  got = [[c.strip() for c in r.split("|")[1:5]]
         for r in tables.goals(rows, {"m": 1 << 20}, tables.REFERENCE).splitlines()[2:]]
  assert got == [
      ["GSPMD, 16-64 GPUs: step <= DDP's", "fp32, bf16", "1 of 2", "m fp32 16 gspmd: 1.050"],
      ["GSPMD: peak <= the memory line", "fp32, bf16", "1 of 2", "m fp32 16 gspmd: +1.0 MiB"]]


def test_the_tables_examples_hold():
  """experiments/ is outside ``make test``'s doctest run: its tables'
  examples run here."""
  import doctest
  from experiments.gpu import aot_tables as tables
  result = doctest.testmod(tables)
  assert result.attempted >= 4 and result.failed == 0, result


def test_the_committed_goals_are_the_estimates():
  """experiments/results/gpu_goals.md is :func:`aot_tables.goals` of the
  committed estimates (the zero1 forms, and GSPMD for scale), so the two
  cannot drift apart."""
  import json
  import pathlib
  from experiments.gpu import aot_tables as tables
  root = pathlib.Path(__file__).resolve().parent.parent
  rows = json.loads((root / "experiments/results/gpu_aot.json").read_text())
  sizes = {m: sum(x.size for x in jax.tree.leaves(gpu_aot.model(m, "fp32")[0]))
           for m in {r["model"] for r in rows}}
  made = (tables.goals(rows, sizes), tables.goals(rows, sizes, tables.REFERENCE))
  text = (root / "experiments/results/gpu_goals.md").read_text()
  assert all(m in text for m in made), (
      "regenerate: python -m experiments.gpu.aot --tables "
      "experiments/results/gpu_aot.json --lines --goals --out experiments/results")
