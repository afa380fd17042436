"""z1.inspect.overlap: per collective, the compute independent of it.

A 3-layer MLP on 8 simulated devices, its gradients reduce-scattered two ways:
inside the backward pass (a custom_vjp hook per weight, as ZeRO-2 does) and as
one concatenated bucket after jax.grad (as a plain ZeRO-1 step does). The
expected independent work is counted by hand from the model's matmuls; a
hand-written HLO module pins the graph logic exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from zero1_jax.inspect import hlo_graph, hlo_overlap

from helpers import mesh

N, AXIS = 8, "data"
DIMS = (16, 24, 24, 8)   # layer l: h @ W_l, W_l is DIMS[l] x DIMS[l+1]; dim 0 % N == 0
BATCH, LR = 32, 0.25
ROWS = BATCH // N
# One (ROWS x d_in) @ (d_in x d_out) matmul's flops, per layer; the backward
# pass has dW_l and dX_l of this size each (no dX_1: x is not differentiated).
C = [2 * ROWS * DIMS[l] * DIMS[l + 1] for l in range(3)]


def _mlp(ws, x):
  h = x
  for w in ws:
    h = jnp.tanh(h @ w)
  return jnp.sum(h * h)


@jax.custom_vjp
def _scatter_in_backward(w, sink):
  """Identity on ``w``; the backward hands ``w``'s cotangent, reduce-scattered
  over dim 0, to ``sink`` (a 1/N-row buffer) the moment it is produced."""
  return w


def _hook_fwd(w, sink):
  return w, None


def _hook_bwd(_, g):
  return (jnp.zeros_like(g),
          jax.lax.psum_scatter(g, AXIS, scatter_dimension=0, tiled=True))


_scatter_in_backward.defvjp(_hook_fwd, _hook_bwd)


def _sgd(ws, shards):
  i = jax.lax.axis_index(AXIS)
  return [jax.lax.dynamic_slice_in_dim(w, i * s.shape[0], s.shape[0]) - LR * s
          for w, s in zip(ws, shards)]


def in_backward(ws, x):
  sinks = [jnp.zeros((w.shape[0] // N,) + w.shape[1:], w.dtype) for w in ws]
  loss = lambda s: _mlp([_scatter_in_backward(w, t) for w, t in zip(ws, s)], x)
  return _sgd(ws, jax.grad(loss)(sinks))


def one_bucket(ws, x):
  g = jax.grad(_mlp)(ws, x)
  flat = jnp.concatenate([a.reshape(N, -1) for a in g], axis=1)  # rank-major
  mine = jax.lax.psum_scatter(flat, AXIS, scatter_dimension=0, tiled=True)[0]
  sizes = np.cumsum([a.size // N for a in g])[:-1]
  return _sgd(ws, [p.reshape((w.shape[0] // N,) + w.shape[1:])
                   for p, w in zip(jnp.split(mine, sizes), ws)])


def _jit(per_device):
  return jax.jit(jax.shard_map(per_device, mesh=mesh(N, AXIS),
                               in_specs=(P(), P(AXIS)), out_specs=P(AXIS),
                               check_vma=False))


@pytest.fixture(scope="module")
def inputs():
  r = np.random.default_rng(0)
  ws = [jnp.asarray(r.normal(size=(a, b)) / np.sqrt(a), jnp.float32)
        for a, b in zip(DIMS[:-1], DIMS[1:])]
  x = jnp.asarray(r.normal(size=(BATCH, DIMS[0])), jnp.float32)
  m = mesh(N, AXIS)
  return (jax.device_put(ws, NamedSharding(m, P())),
          jax.device_put(x, NamedSharding(m, P(AXIS))))


@pytest.fixture(scope="module")
def compiled(inputs):
  return {name: _jit(f).lower(*inputs).compile()
          for name, f in (("in_backward", in_backward), ("one_bucket", one_bucket))}


@pytest.fixture(scope="module")
def reports(compiled):
  return {name: z1.inspect.overlap(c) for name, c in compiled.items()}


def _scatters(reports):
  return [r for r in reports if r.kind == "reduce-scatter"]


def test_both_steps_are_sgd_on_the_global_gradient(inputs, compiled):
  """The hooks really reduce-scatter each weight's gradient (else the overlap
  tests below would judge a different program)."""
  ws, x = inputs
  g = jax.grad(_mlp)([np.asarray(w) for w in ws], np.asarray(x))
  want = [np.asarray(w) - LR * np.asarray(a) for w, a in zip(ws, g)]
  for c in compiled.values():
    got = c(ws, x)
    for a, b in zip(got, want):
      # entries are O(1); fp32 sums of 8 per-device partial gradients in another
      # order differ by a few ulps (measured <= 4.8e-7 absolute)
      np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-6)


def test_in_backward_scatters_overlap_the_rest_of_the_backward(reports):
  rs = _scatters(reports["in_backward"])
  assert len(rs) == 3, [r.name for r in rs]   # one per weight, none combined
  # Program order is layer 3, 2, 1 (the backward pass). What each may hide
  # behind, counted by hand from the matmuls (no forward matmul: all feed it):
  #   layer 3 (first):  dX_3, dW_2, dX_2, dW_1     (the rest of the backward)
  #   layer 2:          dW_3, dX_2, dW_1
  #   layer 1 (last):   dW_3, dW_2  (only the other buckets' own producers)
  want = [C[2] + 2 * C[1] + C[0], C[2] + C[1] + C[0], C[2] + C[1]]
  assert [r.independent_flops for r in rs] == want
  for r in rs[:-1]:   # backward still to run: the last layer's dW is independent
    assert r.independent_flops >= C[0] + C[1], r
  assert [r.bytes for r in rs] == [4 * DIMS[l] * DIMS[l + 1] for l in (2, 1, 0)]
  for r in rs:
    assert r.feeding + r.waiting + len(r.independent) == r.total_compute
    assert r.waiting >= 1   # its own SGD update


def test_one_bucket_after_grad_has_nothing_to_hide_behind(reports):
  (rs,) = _scatters(reports["one_bucket"])
  assert rs.independent == () and rs.independent_flops == 0
  assert rs.independent_bytes == 0
  # everything but the update feeds it: 3 forward and 5 backward matmuls
  assert rs.waiting >= 1 and rs.feeding + rs.waiting == rs.total_compute
  assert rs.bytes == 4 * sum(a * b for a, b in zip(DIMS[:-1], DIMS[1:]))


def test_summary_reads(reports):
  text = z1.inspect.overlap_summary(reports["in_backward"])
  assert text.count("reduce-scatter") == 3
  assert "0 of 3 collectives have no independent compute" in text
  # the columns are explained where they are printed
  assert "bytes: the whole buffer reduced or gathered (all N pieces)" in text
  assert "feeds it / waits: compute ops it depends on / that depend on it" in text
  assert z1.inspect.overlap_summary([]) == "no collectives"


def test_a_zero1_train_step_is_accepted_as_is(inputs):
  """``overlap(step, params, opt_state, batch)`` with what z1.train_step
  returns; ZeRO-1 reduces one bucket after the whole backward pass, so no
  gradient matmul is independent of its reduce-scatter."""
  import optax
  ws, x = inputs
  params = {f"w{l}": w for l, w in enumerate(ws)}
  loss = lambda p, b: _mlp([p[f"w{l}"] for l in range(3)], b["x"]) / BATCH
  tx = z1.zero1(optax.sgd(LR), axis_name=AXIS)
  p, s = z1.init(tx, params, mesh(N, AXIS))
  step = z1.train_step(loss, tx, mesh(N, AXIS))
  reports = z1.inspect.overlap(step, p, s, {"x": x})
  kinds = [r.kind for r in reports]
  assert "reduce-scatter" in kinds and "all-gather" in kinds, kinds
  for r in _scatters(reports):
    assert r.independent_flops == 0 and r.feeding > 0, r


# -- the graph logic on a hand-written module ---------------------------------

HLO = """HloModule hand, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_dot (p0: f32[8,4], p1: f32[4,16]) -> f32[8,16] {
  %p0 = f32[8,4]{1,0} parameter(0)
  %p1 = f32[4,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[8,4], w: f32[4,16]) -> (f32[8,4], f32[8,8], f32[8,4]) {
  %x = f32[8,4]{1,0} parameter(0)
  %w = f32[4,16]{1,0} parameter(1)
  %a = f32[8,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %b = f32[8,4]{1,0} exponential(f32[8,4]{1,0} %x)
  %rs-start = ((f32[8,16]{1,0}), f32[1,16]{1,0}) reduce-scatter-start(%a), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %c = f32[8,4]{1,0} negate(f32[8,4]{1,0} %b)
  %rs-done = f32[1,16]{1,0} reduce-scatter-done(%rs-start)
  %e = f32[1,16]{1,0} multiply(%rs-done, %rs-done)
  %t = (f32[1,16]{1,0}, f32[8,4]{1,0}) tuple(%e, %c)
  %g = f32[8,4]{1,0} get-tuple-element(%t), index=1
  %k = f32[8,4]{1,0} copy(%x)
  %ar = f32[8,4]{1,0} all-reduce(%g), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %f = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %h = f32[8,4]{1,0} cosine(%x), control-predecessors={%rs-done}
  %z = f32[8,4]{1,0} add(%ar, %k)
  ROOT %out = (f32[8,4]{1,0}, f32[8,8]{1,0}, f32[8,4]{1,0}) tuple(%z, %f, %h)
}
"""


def test_hand_written_module():
  # compute: a (fusion holding a dot: 2*8*16*4 flops), b, c, e, f (dot:
  # 2*8*8*4), h, z; not compute: parameters, tuples, the GTE, the copy.
  rs, ar = hlo_overlap(HLO)
  assert (rs.name, rs.kind, rs.computation) == ("rs-start", "reduce-scatter", "main")
  assert rs.bytes == 8 * 16 * 4          # the full buffer: 8 x one device's piece
  assert rs.independent == ("b", "c", "f")   # h waits via its control edge
  assert (rs.feeding, rs.waiting, rs.total_compute) == (1, 3, 7)   # a | e, h, z
  assert rs.independent_bytes == 128 + 128 + 256
  assert rs.independent_flops == 2 * 8 * 8 * 4
  assert (ar.name, ar.kind, ar.bytes) == ("ar", "all-reduce", 128)
  # ar waits (through the tuple and GTE) for e, c, b and the reduce-scatter's a;
  # f is a sibling of its inputs, h only waits for the reduce-scatter
  assert ar.independent == ("f", "h")
  assert (ar.feeding, ar.waiting) == (4, 1)
  assert ar.independent_flops == 2 * 8 * 8 * 4


def test_unsugared_async_and_parsing_details():
  text = """HloModule m

%wrapped (p: f32[2]) -> f32[16] {
  %p = f32[2]{0} parameter(0)
  ROOT %ag = f32[16]{0} all-gather(%p), replica_groups=[1,8]<=[8], dimensions={0}
}

ENTRY %e (x: f32[2]) -> f32[16] {
  %x = f32[2]{0} parameter(0)
  %s = ((f32[2]{0}), f32[16]{0}) async-start(%x), calls=%wrapped
  %y = f32[2]{0} sine(%x)
  %d = f32[16]{0} async-done(%s)
  ROOT %r = f32[16]{0} pad(%d, %y), padding=0_0
}
"""
  m = hlo_graph.parse(text)
  assert [i.name for i in m.computations["e"]] == ["x", "s", "y", "d", "r"]
  assert m.computations["e"][1].called == ("wrapped",)
  (ag,) = hlo_overlap(text)   # the wrapped computation is not reported again
  assert (ag.name, ag.kind, ag.bytes) == ("s", "all-gather", 64)
  assert ag.independent == ("y",) and (ag.feeding, ag.waiting) == (0, 1)
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_graph.parse("%f (p: f32[]) -> f32[] {\n}\n")
  with pytest.raises(TypeError, match="jax.jit"):
    z1.inspect.overlap(lambda x: x, 1.0)


def test_collectives_in_a_loop_body_are_judged_within_one_iteration():
  text = """HloModule loop

%body (c: (s32[], f32[8], f32[8])) -> (s32[], f32[8], f32[8]) {
  %c = (s32[], f32[8]{0}, f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %u = f32[8]{0} get-tuple-element(%c), index=1
  %v = f32[8]{0} get-tuple-element(%c), index=2
  %ar = f32[8]{0} all-reduce(%u), replica_groups={{0,1}}, to_apply=%add
  %m = f32[8]{0} multiply(%v, %v)
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8]{0}, f32[8]{0}) tuple(%j, %ar, %m)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}, f32[8]{0}) tuple(%zero, %x, %x)
  %w = (s32[], f32[8]{0}, f32[8]{0}) while(%init), condition=%cond, body=%body
  %y = f32[8]{0} get-tuple-element(%w), index=1
  ROOT %ag = f32[16]{0} all-gather(%y), replica_groups={{0,1}}, dimensions={0}
}
"""
  ag, ar = hlo_overlap(text)
  assert (ag.computation, ag.kind, ag.feeding) == ("main", "all-gather", 1)
  assert ag.independent == ()   # the loop feeds it
  assert (ar.computation, ar.kind, ar.bytes) == ("body", "all-reduce", 32)
  assert ar.independent == ("m", "j") and ar.total_compute == 2


def test_every_operand_counts_past_xlas_index_comments():
  """XLA prints ``/*index=5*/`` before every 5th operand; such an operand was
  dropped from the graph, so a collective's own 6th input (here a dot, the
  packed bucket's last piece) was reported as compute it could hide behind."""
  def f(x, w):
    parts = [x[i] * 2.0 for i in range(5)] + [x[5] @ w]
    return jax.lax.psum(parts, AXIS)

  g = jax.jit(jax.shard_map(f, mesh=mesh(4), in_specs=(P(), P()), out_specs=P()))
  args = jnp.ones((6, 64, 64)), jnp.ones((64, 64))
  assert "/*index=5*/" in g.lower(*args).compile().as_text()
  for r in z1.inspect.overlap(g, *args):
    assert r.independent_flops == 0, r     # the dot feeds every collective
  m = hlo_graph.parse("""HloModule m

ENTRY %e (p: f32[6]) -> f32[6] {
  %p = f32[6]{0} parameter(0)
  %a = f32[1]{0} slice(%p), slice={[0:1]}
  ROOT %c = f32[6]{0} concatenate(%a, %a, %a, %a, %a, /*index=5*/%a), dimensions={0}
}
""")
  assert m.computations["e"][-1].operands == ("a",) * 6


def test_an_operand_naming_one_output_of_another_is_an_edge():
  """jax 0.12's XLA, in its dumps between passes, names one output of a
  multi-output instruction ``%b#0``: that operand was dropped, so a
  reduce-scatter behind an optimization barrier waited for nothing."""
  m = hlo_graph.parse("""HloModule m

ENTRY %e (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %t = (f32[4]{0}) tuple(%p)
  %b = (f32[4]{0}) opt-barrier(%t)
  ROOT %n = f32[4]{0} negate(%b#0)
}
""")
  instrs = m.computations["e"]
  assert instrs[-1].operands == ("b",)
  deps = hlo_graph.dependencies(instrs)
  assert deps.ancestors[deps.node_of[3]] >> deps.node_of[2] & 1
