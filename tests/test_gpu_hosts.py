"""Plain jit with z1.value_and_grad compiled for 16 H100s on 2 hosts, without
a GPU: the reduce-scatter groups the backward's hooks make across hosts,
read from the groups and from XLA's GPU program (zero1_jax.inspect.gpu).

Structure, never time. Across hosts ``inplace_bytes="auto"`` packs every
leaf into buckets in the backward's order, filled from its end (on one
host each large leaf is reduced alone), every group's reduce-scatter waits for the one before it
all along the backward (no link of the chain left without a user for XLA
to cut), and ``tx.update`` gathers the new weights in those same groups.
The forms that own the step pack the gathers of their stored shards there
too (XLA's estimates: experiments/gpu/aot.py, docs/gpu.md).

The model is tests/test_gpu_aot.py's 4-layer BERT with 1 MiB buckets.
"""

import re

import jax
import pytest

from experiments.gpu import aot as gpu_aot
from zero1_jax.core import layout as lay
from zero1_jax.core import zero2
from zero1_jax.inspect import gpu, hlo_graph
from helpers import gpu_program_with_barriers, starts

MODEL, BUCKET = "small-bert", 1 << 20


def groups_of(across_hosts: bool, platform: str = "gpu", **kw
              ) -> list[list[int]]:
  """hook_groups of the model's params on 16 GPUs (tree order as the
  backward's reverse); ``kw``: z1.zero1's keywords (or ``stage=2``)."""
  import zero1_jax as z1
  shapes = gpu_aot.model(MODEL, "fp32")[0]
  make = z1.zero2 if kw.pop("stage", 1) == 2 else z1.zero1
  cfg = make(gpu_aot.optimizer(), axis_name="data", bucket_bytes=BUCKET,
             **kw).config
  return zero2.hook_groups(lay.plan(shapes, 16), cfg, None, platform,
                           across_hosts)


def test_across_hosts_auto_packs_plain_jits_hooks():
  """``inplace_bytes="auto"``, stage 1, data axis over several hosts: every
  leaf packed into buckets in the backward's order, as with
  ``inplace_bytes=None``; on one host each large leaf is reduced alone. A
  number the user sets, stage 2 (whose point is the memory) and TPUs (not
  measured) keep their leaves in place across hosts too."""
  packed = groups_of(False, inplace_bytes=None)
  assert sum(groups_of(True), []) == sum(packed, [])
  assert len(groups_of(True)) == len(packed)
  assert groups_of(False) != packed
  assert len(groups_of(False)) > len(packed)
  assert groups_of(True, inplace_bytes=1 << 16) == groups_of(
      False, inplace_bytes=1 << 16)
  assert groups_of(True, stage=2) == groups_of(False, stage=2) != groups_of(
      False, stage=2, inplace_bytes=None)
  assert groups_of(True, "tpu") == groups_of(False, "tpu") != packed


def test_across_hosts_the_part_full_bucket_is_the_first():
  """Packed across hosts, the buckets are filled from the backward's end:
  no group could have taken the leaf the backward completes just before
  it, so only the first can be part-full and it closes soonest, starting
  the network's work earlier (as PyTorch DDP's small first bucket does).
  One host's packing fills them from the start instead."""
  shapes = gpu_aot.model(MODEL, "fp32")[0]
  layout = lay.plan(shapes, 16)
  size = lambda i: 16 * layout.leaves[i].shard_size * 4   # fp32 comm

  def full_from(groups, end: bool) -> list[bool]:
    """Whether each group (but the first / last) is too full to take its
    neighbour's leaf: the one before it (``end``) or after it."""
    pairs = (zip(groups, groups[1:]) if end else zip(groups[1:], groups))
    return [sum(map(size, g)) + size(prev[-1] if end else prev[0])
            > BUCKET for prev, g in pairs]

  apart, packed = groups_of(True), groups_of(False, inplace_bytes=None)
  assert all(full_from(apart, end=True)), full_from(apart, True)
  assert not all(full_from(packed, end=True))
  assert all(full_from(packed, end=False))
  assert all(sum(map(size, g)) <= BUCKET or len(g) == 1 for g in apart)


def test_across_hosts_a_group_counts_the_bytes_it_gathers():
  """Across hosts tx.update gathers the hooks' groups as they were reduced
  (core/plan.py backward_buckets). fp32 params reduced in bf16 gather fp32
  updates: a group is cut at ``bucket_bytes`` of the larger, the fp32
  gather, so the groups (and their combiner keys) are those of an fp32
  reduce, not twice as large. zero2's train_step, whose hooks' groups
  nothing gathers, counts the reduce's bytes."""
  import jax.numpy as jnp
  import zero1_jax as z1
  layout = lay.plan(gpu_aot.model(MODEL, "fp32")[0], 16)
  fp32 = lambda g: sum(16 * layout.leaves[i].shard_size * 4 for i in g)
  narrow = groups_of(True, reduce_dtype=jnp.bfloat16)
  assert narrow == groups_of(True)
  assert all(fp32(g) <= BUCKET or len(g) == 1 for g in narrow)
  assert len(narrow) > 10
  cfg = lambda **kw: z1.zero1(gpu_aot.optimizer(), axis_name="data",
                              bucket_bytes=BUCKET, **kw).config
  tags = [t for _, t in zero2.backward_groups(
      layout, cfg(reduce_dtype=jnp.bfloat16), None, "gpu", True)]
  assert tags == [t for _, t in zero2.backward_groups(layout, cfg(), None, "gpu", True)]
  packed = {"stage": 2, "inplace_bytes": None}
  assert len(groups_of(False, reduce_dtype=jnp.bfloat16, **packed)) < len(
      groups_of(False, **packed))


def gathers(form: str, mesh, **kw) -> int:
  """All-gathers in the form's step as jax lowers it (before XLA)."""
  return gpu_aot.lower(form, MODEL, "fp32", mesh, bucket_bytes=BUCKET,
                       **kw).as_text().count("stablehlo.all_gather")


@pytest.mark.parametrize("form", ["train_step", "zero2"])
def test_across_hosts_auto_packs_the_stored_shards_gathers(form):
  """The forms that own the step gather the stored shards at its start.
  Across hosts ``"auto"`` packs them into buckets: fewer, larger
  collectives over the network than each large leaf alone, which a number
  the user sets still asks for, as one host's ``"auto"`` does."""
  two, one = gpu.mesh(16, hosts=2), gpu.mesh(8)
  in_place = gathers(form, two, inplace_bytes=1 << 16)
  assert gathers(form, two) < in_place, (gathers(form, two), in_place)
  assert gathers(form, one) == gathers(form, one, inplace_bytes=1 << 16)


def test_packed_gathers_across_hosts_are_no_larger_than_a_group(monkeypatch):
  """DeepSpeed's allgather_bucket_size (5e8 elements) made one gather of
  every stored shard once packed across hosts: the buckets "auto" packs
  there are cut at layout.GROUP_BYTES (1 MiB here), the size the groups
  in place have; ``inplace_bytes=None``, set by the user, keeps the
  bucket asked for."""
  monkeypatch.setattr(lay, "GROUP_BYTES", 1 << 20)
  two = gpu.mesh(16, hosts=2)
  huge = {"gather_bucket_bytes": 1 << 31}
  assert gathers("train_step", two, **huge) >= 10
  assert gathers("train_step", two, inplace_bytes=None, **huge) <= 3


def readers(instrs, name: str) -> list:
  """The instructions that read ``name``'s value, through bitcasts and
  tuples (which only pass it on)."""
  users: dict[str, list] = {}
  for i in instrs:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  out, todo, seen = [], [name], {name}
  while todo:
    for u in users.get(todo.pop(), []):
      if u.name in seen:
        continue
      seen.add(u.name)
      if u.opcode in ("bitcast", "get-tuple-element", "tuple"):
        todo.append(u.name)
      else:
        out.append(u)
  return out


@pytest.mark.parametrize("form", ["train_step", "engine"])
def test_packed_buckets_are_read_only_by_the_copies_out(form):
  """Across hosts each leaf of a packed step-start gather is copied out of
  its bucket before anything reads it. Without that, XLA fused the slices
  into the layers reading them (layer norms, the attention's reshapes) and
  two 64 MiB buckets of BERT-base fp32 stayed live into the backward, at
  the peak (1,932 MiB on 16 H100s, 1,806 with the copies, as in
  place). Every reader of a bucket is slicing or concatenating it, none is
  the model's forward or backward (``jvp(`` in its op name)."""
  low = gpu_aot.lower(form, MODEL, "fp32", gpu.mesh(16, hosts=2),
                      bucket_bytes=BUCKET)
  c, _ = gpu.compile(low)
  module = hlo_graph.parse(c.as_text())
  instrs = module.computations[module.entry]
  buckets = [i for i in instrs if i.opcode == "all-gather-done"
             and len(hlo_graph.shape_dims(i.shape)) == 1
             and len(hlo_graph.shape_dims(i.shape)[0][1]) == 1]
  assert len(buckets) >= 3, [i.shape for i in buckets]
  for b in buckets:
    names = [re.search(r'op_name="([^"]*)"', r.attrs) for r in readers(instrs, b.name)]
    model = [m.group(1) for m in names if m and "jvp(" in m.group(1)]
    assert not model, (b.shape, model)


@pytest.fixture(scope="module")
def program():
  """jit_vg's GPU program for 16 GPUs on 2 hosts: its entry computation's
  instructions and their data dependencies."""
  low = gpu_aot.lower("jit_vg", MODEL, "fp32", gpu.mesh(16, hosts=2),
                      bucket_bytes=BUCKET)
  module = hlo_graph.parse(gpu_program_with_barriers(low))
  instrs = module.computations[module.entry]
  return instrs, hlo_graph.dependencies(instrs)


def test_every_reduce_scatter_waits_for_all_before_it_across_hosts(program):
  """The chain holds over every group: the reduce-scatters are totally
  ordered, the k-th waiting for the k before it (with the token's last
  link unused, XLA kept 4-5 groups of it and the rest waited for none).
  (jax 0.12's XLA drops the barriers after scheduling by them: read from
  its dump of the scheduled program, helpers.text_with_barriers.)"""
  instrs, deps = program
  rs = [deps.node_of[k] for k in starts(instrs, "reduce-scatter")]
  before = sorted(sum(deps.ancestors[r] >> q & 1 for q in rs) for r in rs)
  assert len(rs) > 4 and before == list(range(len(rs))), before


def test_each_gather_follows_one_reduce_scatter_group_across_hosts(program):
  """tx.update gathers in the groups the backward reduce-scattered (the
  same across-hosts groups): each gather of new weights waits for a
  different reduce-scatter and those before it, none for two groups'
  results that no single one's wait covers."""
  instrs, deps = program
  rs = [deps.node_of[k] for k in starts(instrs, "reduce-scatter")]
  waits_for = lambda node: frozenset(r for r in rs
                                     if deps.ancestors[node] >> r & 1)
  closure = {waits_for(r) | {r}: r for r in rs}
  mine = [closure.get(waits_for(deps.node_of[k]))
          for k in starts(instrs, "all-gather")
          if waits_for(deps.node_of[k])]
  assert len(mine) > 4 and None not in mine, mine
  assert len(set(mine)) == len(mine)


def test_across_hosts_the_loss_is_summed_as_the_backward_starts(program):
  """Across hosts the loss's all-reduce (z1.value_and_grad's value) rides
  the chain from its start (core/chain.py): it waits for no reduce-scatter,
  and every group's after the first waits for it, so XLA cannot leave it
  for the step's end, a lone scalar over the network after the last
  gather (with the token tied to the loss, it waited for every one)."""
  instrs, deps = program
  rs = [deps.node_of[k] for k in starts(instrs, "reduce-scatter")]
  # jax 0.12's XLA starts it as an async fusion around the all-reduce,
  # named by the psum it came from
  found = [k for k, i in enumerate(instrs)
           if (i.opcode in ("all-reduce", "all-reduce-start")
               or (i.opcode == "async-start" and "psum" in i.attrs))
           and re.match(r"\(*f32\[\]", i.shape)]
  ar = [deps.node_of[k] for k in found]
  assert len(ar) == 1, [(instrs[k].opcode, instrs[k].shape) for k in found]
  assert not [r for r in rs if deps.ancestors[ar[0]] >> r & 1]
  assert sum(deps.ancestors[r] >> ar[0] & 1 for r in rs) >= len(rs) - 1 > 3


def test_across_hosts_groups_and_chain_leave_the_values_bitwise():
  """The across-hosts groups and the chain's tie change which collective
  carries a leaf and what waits for what, not a value: on 8 CPU devices
  each device's gradient shards and the loss are bitwise those of the
  one-host groups (a reduce-scatter sums each element over the same
  devices, whatever it is packed with; the tie adds 0 times the token).
  The loss's sum the chain carries across hosts (``total``, core/chain.py)
  is bitwise ``jax.lax.psum``'s, on every device."""
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import PartitionSpec as P
  import zero1_jax as z1

  rng = np.random.default_rng(0)
  shapes = {"w1": (24, 16), "b1": (16,), "w2": (16, 8), "b2": (8,),
            "ln": (8,), "w3": (8, 2560)}
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32)
            for k, s in shapes.items()}
  x = jnp.asarray(rng.normal(size=(8 * 4, 24)), jnp.float32)

  def loss_fn(p, xb):
    h = jnp.tanh(xb @ p["w1"] + p["b1"])
    h = jnp.tanh(h @ p["w2"] + p["b2"]) * p["ln"]
    loss = jnp.mean((h @ p["w3"]) ** 2)
    return loss, (loss, None)

  cfg = z1.zero1(optax.adam(1e-3), axis_name="data").config
  mesh = jax.make_mesh((8,), ("data",))
  layout = lay.plan(params, 8)
  apart, packed = (zero2.hook_groups(layout, cfg, None, "gpu", a)
                   for a in (True, False))
  assert apart != packed, packed

  def run(across, total=False):
    def per_device(p, xb):
      g, (loss, _), *summed = zero2.reduced_grad_fn(
          loss_fn, p, cfg, 8, None, "gpu", chain=True,
          across_hosts=across, total=total)(xb)
      out = (jax.tree.map(lambda a: a[None], g), loss[None])
      return out + tuple(t[None] for t in summed)
    shard_map = getattr(jax, "shard_map", None) or __import__(
        "jax.experimental.shard_map", fromlist=["shard_map"]).shard_map
    f = shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")),
                  out_specs=P("data"), check_vma=False)
    put = lambda t, spec: jax.device_put(
        t, jax.sharding.NamedSharding(mesh, spec))
    return jax.jit(f)(put(params, P()), put(x, P("data")))

  (g1, l1), (g0, l0) = run(True), run(False)
  assert np.array_equal(np.asarray(l1), np.asarray(l0))
  for k in shapes:
    assert np.array_equal(np.asarray(g1[k]), np.asarray(g0[k])), k
  (g2, l2, s2), (_, _, s0) = run(True, True), run(False, True)
  s2, s0 = np.asarray(s2), np.asarray(s0)
  assert np.array_equal(s2, s0) and np.all(s2 == s2[0]), (s2, s0)
  assert abs(s2[0] - np.asarray(l0).sum()) <= 1e-5 * np.abs(np.asarray(l0)).sum()
  assert np.array_equal(np.asarray(l2), np.asarray(l0))
  for k in shapes:
    assert np.array_equal(np.asarray(g2[k]), np.asarray(g0[k])), k


def test_plain_jit_without_set_mesh_reads_its_hosts_from_zero1s_mesh():
  """Programs that jit without ``jax.set_mesh`` (nanodo, ``TrainState``
  steps) show tx.update an abstract mesh, which has no devices to say which
  host each is on: the concrete mesh of ``zero1(mesh=)`` says it. After
  ``jax.grad``'s reduce across hosts the gathers go in buckets of up to
  256 MiB (core/plan.py ``gather_bytes``): the small model's one gather,
  as under ``jax.set_mesh``; on one host its 1 MiB buckets, several."""
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  import zero1_jax as z1
  from zero1_jax.core import platform as platforms

  two, one = gpu.mesh(16, hosts=2), gpu.mesh(8)
  assert not platforms.one_host(two.abstract_mesh, two)
  assert platforms.one_host(one.abstract_mesh, one)
  assert platforms.one_host(two.abstract_mesh)     # nothing says: one host
  shapes, loss_fn, per_device, seq = gpu_aot.model(MODEL, "fp32")

  def gathers(mesh, set_mesh: bool) -> int:
    tx = z1.zero1(gpu_aot.optimizer(), axis_name="data", mesh=mesh,
                  bucket_bytes=BUCKET)
    ids = jax.ShapeDtypeStruct((mesh.shape["data"] * per_device, seq), jnp.int32,
                               sharding=NamedSharding(mesh, P("data")))
    state = gpu_aot.with_shardings(
        jax.eval_shape(lambda p: z1.init(tx, p, mesh)[1], shapes),
        z1.state_shardings(tx, shapes, mesh))

    def step(p, s, bt):
      loss, g = jax.value_and_grad(loss_fn)(p, bt)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, loss
    args = (gpu_aot.placed(shapes, mesh), state,
            {"input_ids": ids, "labels": ids})
    if set_mesh:
      with jax.set_mesh(mesh):
        text = jax.jit(step).lower(*args).as_text()
    else:
      text = jax.jit(step).lower(*args).as_text()
    return text.count("stablehlo.all_gather")

  apart = gathers(two, set_mesh=False)
  assert apart == gathers(two, set_mesh=True)
  assert apart < gathers(one, set_mesh=False), apart
