"""The step compiled for 8 H100s, without a GPU: its plan read from XLA's GPU
program and its latency-hiding schedule (zero1_jax.inspect.gpu).

Structure, never time: every collective async; the reduce-scatters move the
padded Psi once in the gradient dtype and start under the backward (the
first before the backward's last compute); the gathers of the shards
train_step keeps between steps run under the next forward; between steps a
device holds 1/N of the params and of the state (jax.grad's gradients in a
flax TrainState loop reaching tx.update by reduce-scatter:
tests/test_gpu_trainstate.py). XLA's estimates of the step are
experiments/gpu/aot.py's (docs/results.md); the tools that read them are
tests/test_gpu_tools.py's.

The model: a 4-layer BERT of 3.7M params at 32 x 128 tokens a device, with
1 MiB buckets so that its 15 MB of gradients make 17 groups (BERT-base's
437 MB make about as many with the default 64 MiB).
"""

import re

import jax
import numpy as np
import pytest

import zero1_jax as z1
from experiments.gpu import aot as gpu_aot
from zero1_jax.core import layout as lay
from zero1_jax.inspect import gpu, hlo_graph, schedule as sc
from helpers import BARRIER_DUMP, text_with_barriers

MODEL, BUCKET = "small-bert", 1 << 20
FORMS = ("train_step", "zero2", "engine", "jit_vg")


@pytest.fixture(scope="module")
def mesh():
  return gpu.mesh(8)


DUMPS: dict = {}   # (form, dtype) -> the directory of XLA's dump of its compile


@pytest.fixture(scope="module")
def compiled(mesh, tmp_path_factory):
  """form -> (compiled, Schedule) for fp32 params, and train_step in bf16."""
  out = {}
  for form, dtype in [(f, "fp32") for f in FORMS] + [("train_step", "bf16"),
                                                      ("ddp", "fp32")]:
    kw = {} if form == "ddp" else {"bucket_bytes": BUCKET}
    low = gpu_aot.lower(form, MODEL, dtype, mesh, **kw)
    DUMPS[form, dtype] = str(tmp_path_factory.mktemp(f"{form}_{dtype}"))
    c, schedule = gpu.compile(low, BARRIER_DUMP, dump_to=DUMPS[form, dtype])
    out[form, dtype] = (c, schedule)
  return out


def psi_padded(dtype: str) -> int:
  shapes = gpu_aot.model(MODEL, dtype)[0]
  return sum(s.shard_size * 8 for s in lay.plan(shapes, 8).leaves
             if s.kind == lay.SHARD)


def backward_end(schedule) -> float:
  return max(o.end for o in schedule.ops
             if sc.is_compute(o) and "transpose(" in o.op_name)


@pytest.mark.parametrize("form", FORMS)
def test_every_collective_is_async_and_reduce_scatters_start_under_the_backward(
    compiled, form):
  c, schedule = compiled[form, "fp32"]
  text = c.as_text()
  # jax 0.12's XLA turns a collective with nothing to run beside into a
  # synchronous one: tiny ones (a 62 KB gather of the packed small leaves,
  # the loss's scalar all-reduce, plain jit's last 8 KB reduce-scatter
  # group) and the first gather of the step, which the forward's first
  # layer waits for. jax 0.10.2's keeps all async.
  def sync(kind, min_bytes=0):
    return [l for l in text.splitlines() if f" {kind}(" in l and "=" in l
            and hlo_graph.shape_bytes(l.split("=", 1)[1].split(kind)[0]) >= min_bytes]
  newer = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
  big_sync = sync("reduce-scatter") if not newer else sync(
      "reduce-scatter", 64 << 10)
  assert not big_sync, (form, big_sync[:1])
  assert len(sync("reduce-scatter")) <= newer, form
  assert not sync("all-reduce", 1 << 20 if newer else 0), form
  assert len(sync("all-gather", 1 << 20 if newer else 0)) <= (
      newer and form != "jit_vg"), form
  windows = sc.summary(schedule).collectives
  rs = [w for w in windows if w.kind == "reduce-scatter"]
  assert len(rs) > 4, form   # grouped, not one reduce-scatter after the backward
  assert min(w.start for w in rs) < backward_end(schedule), form


@pytest.mark.parametrize("dtype,itemsize", [("fp32", 4), ("bf16", 2)])
def test_reduce_scatter_moves_psi_once_in_the_gradient_dtype(compiled, dtype, itemsize):
  c, _ = compiled["train_step", dtype]
  coll = z1.inspect.hlo_collectives(c.as_text())
  ids = 8 * 32 * 128 * 4   # the token ids every device's lookup reads (int32)
  assert coll["reduce-scatter"].bytes == psi_padded(dtype) * itemsize
  assert coll["all-gather"].bytes == psi_padded(dtype) * itemsize + ids
  assert coll["all-reduce"].bytes <= 16   # the loss and the norm's scalars


@pytest.mark.parametrize("form", ["train_step", "zero2", "engine"])
def test_kept_shards_are_gathered_under_the_forward(compiled, form):
  """The forms that own the step keep each device's updated shards and
  gather them at the start of the next step: every gather but the first
  few (what the first layer reads: nothing runs before it) overlaps
  forward compute; none waits for the backward."""
  c, schedule = compiled[form, "fp32"]
  ag = [w for w in sc.summary(schedule).collectives if w.kind == "all-gather"]
  first_backward = min(o.start for o in schedule.ops
                       if sc.is_compute(o) and "transpose(" in o.op_name)
  # Leaves padded to split (the MLM bias: 2050 -> 2056) are not kept as
  # shards (a jax.Array divides evenly): gathered after their update.
  padded = {f"f32[{int(np.prod(s.padded_shape))}]" for s in lay.plan(
      gpu_aot.model(MODEL, "fp32")[0], 8).leaves
      if s.kind == lay.SHARD and s.padded_shape != s.shape}
  lines = {l.split("=")[0].strip().lstrip("%"): l for l in c.as_text().splitlines()
           if "all-gather-start" in l and "=" in l}
  late = [w for w in ag if w.end >= first_backward]
  assert all(any(p in lines[w.name] for p in padded) for w in late), form
  ag = [w for w in ag if w not in late]
  assert sum(w.overlapped > 0 for w in ag) >= len(ag) // 2, [
      (round(w.start), round(w.overlapped)) for w in ag]


def collective_starts(instrs, kind):
  """Indices of ``kind``'s collectives (async starts, or jax 0.12's
  synchronous ones) among ``instrs``."""
  return [k for k, i in enumerate(instrs)
          if i.opcode in (kind, f"{kind}-start")
          or (i.opcode == "async-start" and kind in i.attrs)]


@pytest.fixture(scope="module")
def zero2_accumulating(mesh):
  """zero2's train_step at 2 micro-batches: its backward's hooks reduce."""
  low = gpu_aot.lower("zero2", MODEL, "fp32", mesh, bucket_bytes=BUCKET,
                      grad_accum_steps=2)
  return gpu.compile(low, gpu_aot.OPTIONS)[0]


def made_in_the_backward(c) -> tuple[int, int]:
  """(how many of the reduce-scatters of ``c`` its backward made, their JAX
  op under a ``transpose``: the hooks'; how many there are)."""
  names = re.findall(r"reduce-scatter(?:-start)?\([^\n]*op_name=\"([^\"]+)\"",
                     c.as_text())
  return sum("transpose(" in n for n in names), len(names)


@pytest.mark.parametrize("form", ["zero2 accumulating", "jit_vg"])
def test_hooks_reduce_scatter_each_leaf_in_its_own_shape(compiled, zero2_accumulating,
                                                         form):
  """On GPUs the backward's hooks hand XLA one reduce-scatter a leaf, in the
  leaf's shape, and XLA combines a group's into one by its combiner_key: the
  reduce-scatters' operands are the SHARD leaves' gradients, not a packed
  copy of them (zero2.reduce_hook's per_leaf). (zero2's train_step uses its
  hooks with accumulation: below.)"""
  c = zero2_accumulating if form == "zero2 accumulating" else compiled[form, "fp32"][0]
  hooks, every = made_in_the_backward(c)
  assert hooks == every > 0, form
  module = hlo_graph.parse(c.as_text())
  rs = [i for comp in module.computations.values() for k in
        collective_starts(comp, "reduce-scatter") for i in [comp[k]]]
  leaves = [s for s in lay.plan(gpu_aot.model(MODEL, "fp32")[0], 8).leaves
            if s.kind == lay.SHARD]
  assert len(rs) < len(leaves)                     # XLA combined them
  assert sum(len(i.operands) for i in rs) == len(leaves), form


def test_zero2_with_one_micro_batch_reduces_as_stage_1(compiled, zero2_accumulating):
  """zero2's hooks keep 1/N of the gradient the micro-batches sum. With one
  micro-batch no gradient outlives the backward, and on GPUs zero2's
  train_step reduce-scatters as stage 1's (core/step.py): from the update,
  each leaf in place in the backward's order, with the same collectives and
  a peak no higher (XLA ran the hooks' reduce-scatters late: across hosts
  zero2 was up to 1.04 x DDP's step, docs/gpu.md)."""
  zero2, stage1 = compiled["zero2", "fp32"][0], compiled["train_step", "fp32"][0]
  hooks, every = made_in_the_backward(zero2)
  assert hooks == 0 and every > 4
  assert z1.inspect.hlo_collectives(zero2.as_text()) == z1.inspect.hlo_collectives(
      stage1.as_text())
  assert z1.inspect.memory(zero2)["peak"] <= z1.inspect.memory(stage1)["peak"]
  hooks, every = made_in_the_backward(zero2_accumulating)
  assert hooks == every > 4


def test_plain_jit_gathers_what_each_reduce_scatter_brought(compiled):
  """z1.value_and_grad + tx.update: the new weights are gathered in the
  groups the backward reduce-scattered (core/plan.py backward_buckets), so
  each gather waits for one reduce-scatter (and the ones that one waits
  for: on GPUs each combiner group's starts after the group before it),
  a different one for each gather, and XLA can run it beside the rest of
  the backward; read from the GPU program's data dependencies. (Gathered in
  tree-order buckets instead, a gather waits for two groups' results, or
  two gathers for the same group's.) The token ids' gather (the lookups')
  waits for none."""
  c, _ = compiled["jit_vg", "fp32"]
  module = hlo_graph.parse(c.as_text())
  instrs = module.computations[module.entry]
  deps = hlo_graph.dependencies(instrs)
  rs = [deps.node_of[k] for k in collective_starts(instrs, "reduce-scatter")]
  waits_for = lambda node: frozenset(r for r in rs
                                     if deps.ancestors[node] >> r & 1)
  closure = {waits_for(r) | {r}: r for r in rs}
  mine, ids = [], 0
  for k in collective_starts(instrs, "all-gather"):
    waited = waits_for(deps.node_of[k])
    if not waited:
      assert "s32[" in instrs[k].shape, instrs[k].shape
      ids += 1
      continue
    assert waited in closure, instrs[k].name
    mine.append(closure[waited])
  assert len(rs) > 4 and len(mine) > 4 and ids == 1
  assert len(set(mine)) == len(mine)


def test_plain_jit_reduce_scatters_run_group_after_group(compiled):
  """z1.value_and_grad on GPUs: each combiner group's reduce-scatter waits
  for the group before it in the backward (zero2.reduced_grad_fn's chain),
  so XLA starts them as the backward goes instead of queueing them at its
  end: the reduce-scatters wait for ever more of the others (at least four
  groups deep here; without the chain, none waits for another). jax 0.12's
  XLA drops the barriers after scheduling by them: read from its dump of
  the scheduled program (helpers.text_with_barriers)."""
  c, _ = compiled["jit_vg", "fp32"]
  module = hlo_graph.parse(text_with_barriers(c, DUMPS["jit_vg", "fp32"]))
  instrs = module.computations[module.entry]
  deps = hlo_graph.dependencies(instrs)
  rs = [deps.node_of[k] for k in collective_starts(instrs, "reduce-scatter")]
  before = sorted(sum(deps.ancestors[r] >> q & 1 for q in rs) for r in rs)
  assert len(set(before)) >= 4, before


def table_windows(c, schedule, kind):
  """The async windows of ``kind`` that move the word embedding (2050 x 256;
  zero2 reduces it rank-major, 8 x 65600)."""
  lines = {l.split("=")[0].strip().lstrip("%"): l for l in c.as_text().splitlines()
           if f"{kind}-start" in l and "=" in l}
  return [w for w in sc.summary(schedule).collectives
          if w.kind == kind and any(t in lines.get(w.name, "")
                                    for t in ("f32[2050,256]", "f32[8,65600]"))]


@pytest.mark.parametrize("form", ["train_step", "zero2", "engine", "jit_vg"])
def test_the_embedding_is_looked_up_from_its_stored_blocks(compiled, form):
  """The tied word embedding (split on its columns) is read by rows from
  each device's block: an all-to-all of the looked-up rows (and one of
  their gradient back); the whole table, which only the tied output layer
  reads, gathered under the layers before it; its gradient (that layer's,
  at the start of the backward) reduce-scattered in the backward's first
  half, not left for its end.
  Plain jit holds the whole table: its lookups read it, and only their
  gradient travels, by one all-to-all in the backward."""
  c, schedule = compiled[form, "fp32"]
  module = hlo_graph.parse(c.as_text())
  a2a = [i.attrs for comp in module.computations.values() for i in comp
         if i.opcode in ("all-to-all", "all-to-all-start")]
  assert len(a2a) == (1 if form == "jit_vg" else 2), a2a
  if form == "jit_vg":
    assert "transpose(" in a2a[0], a2a[0]   # the backward's
  compute = [o for o in schedule.ops if sc.is_compute(o)]
  first_backward = min(o.start for o in compute if "transpose(" in o.op_name)
  (ag,) = table_windows(c, schedule, "all-gather")
  (rs,) = table_windows(c, schedule, "reduce-scatter")
  assert ag.start > min(o.end for o in compute), form   # not the first thing
  assert ag.overlapped > 0.5 * (ag.end - ag.start), form
  half = (first_backward + backward_end(schedule)) / 2
  assert rs.start < (backward_end(schedule) if form == "jit_vg" else half), form


def test_plain_jits_lookup_block_is_not_kept_for_the_update(compiled):
  """Plain jit slices this device's column block of the whole table twice:
  for the lookups at the forward's start and for tx.update at the step's
  end. XLA merged the two and kept one block live from the first lookup to
  the update (BERT-base fp32 on 8 H100s: 11.2 MiB at the peak); the
  lookups read theirs through a barrier. No value of the block's shape is
  read both by the forward and by the update (``jit(call)``)."""
  c, _ = compiled["jit_vg", "fp32"]
  module = hlo_graph.parse(c.as_text())
  instrs = module.computations[module.entry]
  users: dict[str, list] = {}
  for i in instrs:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  op = lambda i: (re.search(r'op_name="([^"]*)"', i.attrs) or ["", ""])[1]
  blocks = [i for i in instrs if i.opcode != "parameter"
            and any(d in ((2050, 32), (32, 2050))
                    for _, d in hlo_graph.shape_dims(i.shape))]
  assert blocks
  for b in blocks:
    names = [op(u) for u in users.get(b.name, [])]
    forward = [n for n in names if "jvp(" in n and "transpose(" not in n]
    update = [n for n in names if "jit(call)" in n]
    assert not (forward and update), (b.name, forward, update)


def test_without_shard_lookups_the_table_is_gathered_first(mesh):
  """The same step with ``shard_lookups=False``: no all-to-all, and the
  whole table's gather is what the first layer waits for (the plan above
  is the option's doing)."""
  low = gpu_aot.lower("train_step", MODEL, "fp32", mesh,
                      bucket_bytes=BUCKET, shard_lookups=False)
  c, schedule = gpu.compile(low)
  assert "all-to-all" not in z1.inspect.hlo_collectives(c.as_text())
  windows = table_windows(c, schedule, "all-gather")
  if not windows:   # jax 0.12's XLA: nothing to run beside it, synchronous
    assert any(" all-gather(" in l and "f32[2050,256]" in l
               for l in c.as_text().splitlines())
  else:
    (ag,) = windows
    assert ag.overlapped < 0.5 * (ag.end - ag.start)   # mostly exposed


@pytest.mark.parametrize("form", ["train_step", "jit_vg"])
def test_lookups_from_blocks_stay_within_one_host(mesh, form):
  """``shard_lookups="auto"``: on one host's 8 GPUs, not on 2 hosts' 16,
  where the rows' all-to-all would reach every peer over the network
  (lowered only: the plan is in the program jax hands XLA). Plain jit reads
  the hosts from the concrete mesh ``jax.set_mesh`` set (under jit only the
  abstract one is at hand)."""
  two_hosts = gpu.mesh(16, ("data",), hosts=2)
  text = lambda m: gpu_aot.lower(form, MODEL, "fp32", m).as_text()
  assert "all_to_all" in text(mesh)
  assert "all_to_all" not in text(two_hosts)


def test_between_steps_a_device_holds_a_1_over_n_share(compiled):
  """train_step's arguments (donated, so also its outputs): the stored
  param shards and the state, 1/N each, against DDP's whole params and
  state; memory_analysis of the GPU program."""
  shapes = gpu_aot.model(MODEL, "fp32")[0]
  layout = lay.plan(shapes, 8)
  whole = sum(int(np.prod(s.shape)) * 4 for s in layout.leaves)
  stored = sum(s.shard_size * 4 if s.padded_shape == s.shape and s.kind == lay.SHARD
               else int(np.prod(s.shape)) * 4 for s in layout.leaves)
  batch = 2 * 32 * 128 * 4   # input ids and labels, int32, this device's rows
  ddp = z1.inspect.memory(compiled["ddp", "fp32"][0])
  z = z1.inspect.memory(compiled["train_step", "fp32"][0])
  assert ddp["argument"] == whole * 3 + batch + 4   # params, mu, nu; adam's count
  assert z["argument"] - batch == stored + layout.state_bytes_per_device() + 4 + 16
  assert z["alias"] >= stored + layout.state_bytes_per_device()


@pytest.mark.parametrize("form", ["ddp", "train_step"])
def test_the_bytes_live_at_the_peak_are_read_from_xlas_dump(compiled, form):
  """docs/gpu.md's live bytes at the peak: the temp heap's values live at
  XLA's peak instruction, each buffer once. They fit in the temp heap
  memory_analysis reports, and hold at least the loss's fp32 logits (32 x
  128 tokens x 2,050 rows a device), live from the forward into the
  backward; the rest of the heap is what its packing leaves unused. A dump
  whose temp heap is not the compile's is refused."""
  from experiments.probes import peak_breakdown
  c, _ = compiled[form, "fp32"]
  temp = z1.inspect.memory(c)["temp"]
  live = peak_breakdown.temp_live_at_peak(DUMPS[form, "fp32"], temp)
  assert 32 * 128 * 2050 * 4 <= live <= temp
  other = "ddp" if form != "ddp" else "train_step"
  with pytest.raises(ValueError, match="another compile's dump"):
    peak_breakdown.temp_live_at_peak(DUMPS[other, "fp32"], temp)
