"""Why plain jit's reduce-scatters stay at the backward's end on one host.

With ``z1.value_and_grad`` in plain jit (BERT-base fp32, 8 H100s, XLA's cost
model) the backward runs from 2.5 ms, yet its first reduce-scatter starts
at 6.9 ms: XLA's latency-hiding scheduler, which schedules from the
program's end, runs every input-gradient gemm of the backward first and
the weight-gradient gemms after them (6.9-9.6 ms), each just before the
reduce-scatter it feeds, so the
collectives, one at a time, and the gathers queued behind them fill the
step's last 3.5 ms. Each collective starts when its operands are ready:
nothing in the program holds them back, the scheduler places their
producers late. Two ways a program could move them, neither taken:

1. **Each weight gradient tied to its input gradient.** The loss
   re-evaluated with every ``dot_general`` that reads a param given a
   backward that passes both cotangents through one
   ``jax.lax.optimization_barrier``, so that the layers below wait for the
   weight gradient (re-evaluated without the barriers, the step is the
   same 10,354 µs). The weight gemms then run beside the input gradients
   (3.5-8.5 ms), but the scheduler still places the collectives at the
   end, later than before: 11,799 µs a step against 10,354, 2,663 µs
   exposed against 1,414, collectives from 8.4 ms (jax 0.12: 11,520
   against 10,127).
2. **XLA's scheduling groups** (``_scheduling_group_id`` through
   ``jax.experimental.xla_metadata.set_xla_metadata``), which on GPUs pair
   an async collective with cuBLAS gemms to run beside it. The dot's
   annotation does not reach the cuBLAS custom call XLA rewrites it into
   (jax 0.10.2 and 0.12): on a chain of eight 4096 x 4096 gemms beside four
   reduce-scatters each collective is left alone in its group and runs
   after every gemm (9,763 µs against 6,774 unannotated; jax 0.12 converts
   them to synchronous collectives).

Run: ``python -m experiments.probes.late_weight_grads`` (needs the gpu-aot
extra; about a minute on 2 cores). Measured 2026-12-07, 2-core x86_64 VM
without a GPU, jax 0.10.2.
"""
from __future__ import annotations

import tempfile
from unittest import mock

from experiments.gpu import aot   # first: it keeps jax off the GPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.xla_metadata import set_xla_metadata  # noqa: E402
from jax.extend import core as jex_core  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from experiments.probes.untagged_reduce_scatter import weight_gemms  # noqa: E402
from zero1_jax.inspect import gpu, schedule as sched  # noqa: E402

# what a param passes through before a dot reads it
_VIEWS = {"convert_element_type", "reshape", "transpose", "copy"}
_CALLS = {"pjit", "jit", "closed_call"}


def _tied_dot(prim, params):
  """``prim.bind(x, w, **params)`` whose backward returns both cotangents
  through one optimization_barrier."""
  def dot(x, w):
    return prim.bind(x, w, **params)

  @jax.custom_vjp
  def f(x, w):
    return dot(x, w)

  def bwd(res, g):
    return tuple(jax.lax.optimization_barrier(jax.vjp(dot, *res)[1](g)))
  f.defvjp(lambda x, w: (dot(x, w), (x, w)), bwd)
  return f


def _eval(jaxpr, consts, args, from_params: set, barrier: bool) -> list:
  env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    hit = [not isinstance(v, jex_core.Literal) and v in from_params
           for v in eqn.invars]
    name = eqn.primitive.name
    if name in _CALLS:
      sub = eqn.params["jaxpr"]
      outs = _eval(sub.jaxpr, sub.consts, ins,
                   {iv for iv, h in zip(sub.jaxpr.invars, hit) if h}, barrier)
    elif name == "dot_general" and any(hit) and barrier:
      outs = [_tied_dot(eqn.primitive, eqn.params)(*ins)]
    else:
      bound = eqn.primitive.get_bind_params(eqn.params)
      subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
      out = eqn.primitive.bind(*subfuns, *ins, **params)
      outs = out if eqn.primitive.multiple_results else [out]
      if name in _VIEWS and any(hit):
        from_params = from_params | set(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def tied(loss_fn, barrier: bool = True):
  """``loss_fn(params, *args)`` evaluated from its jaxpr, each param dot's
  backward tied (``barrier``) or as it was."""
  def f(params, *args):
    p, p_tree = jax.tree.flatten(params)
    a, a_tree = jax.tree.flatten(args)
    closed, shape = jax.make_jaxpr(
        lambda p, a: loss_fn(p_tree.unflatten(p), *a_tree.unflatten(a)),
        return_shape=True)(p, a)
    outs = _eval(closed.jaxpr, closed.consts, p + a,
                 set(closed.jaxpr.invars[:len(p)]), barrier)
    return jax.tree.structure(shape).unflatten(outs)
  return f


def jit_vg(how: str) -> dict:
  """BERT-base fp32's plain-jit step with ``z1.value_and_grad`` on 8 H100s,
  its loss ``how``: "as is", "re-evaluated" (from its jaxpr), "tied"."""
  model = aot.model
  patched = lambda *a: (lambda s, f, d, q: (s, tied(f, how == "tied"), d, q))(
      *model(*a))
  with mock.patch.object(aot, "model", model if how == "as is" else patched), \
      tempfile.TemporaryDirectory() as d:
    _, schedule = gpu.compile(aot.lower("jit_vg", "bert-base", "fp32", gpu.mesh(8)),
                              dict(aot.OPTIONS), dump_to=d)
  s = sched.summary(schedule)
  backward = min(o.start for o in schedule.ops if sched.is_compute(o)
                 and "transpose(jvp" in o.op_name)
  return {"step": s.step_us, "exposed": s.exposed_us, "backward from": backward,
          "first collective after it": min(w.start for w in s.collectives
                                           if w.start > backward),
          "weight gemms": weight_gemms(schedule)}


def annotated_gemms(annotate: bool) -> tuple[int, float]:
  """(cuBLAS gemms carrying a scheduling group, step µs) of eight chained
  4096 x 4096 gemms beside four reduce-scatters, the first four gemms in
  the groups of the four reduce-scatters."""
  mesh = gpu.mesh(8)

  def group(i):
    return set_xla_metadata(_scheduling_group_id=i) if annotate else _Null()

  def body(x, ws, g):
    out = []
    for i, w in enumerate(ws):
      if i < 4:
        with group(i + 1):
          out.append(jax.lax.psum_scatter(g * (i + 1.0), "data", tiled=True))
      with group(i + 1) if i < 4 else _Null():
        x = jnp.tanh(x @ w)
    return x, out
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P()),
                            out_specs=(P("data"), P("data"))))
  sd = lambda s, sp: jax.ShapeDtypeStruct(s, jnp.float32,
                                          sharding=NamedSharding(mesh, sp))
  with tempfile.TemporaryDirectory() as d:
    compiled, schedule = gpu.compile(
        f.lower(sd((8 * 4096, 4096), P("data")), [sd((4096, 4096), P())] * 8,
                sd((8 * 4096, 4096), P())), dict(aot.OPTIONS), dump_to=d)
  kept = sum("__cublas$gemm" in ln and "_scheduling_group_id" in ln
             for ln in compiled.as_text().splitlines())
  return kept, sched.summary(schedule).step_us


class _Null:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def main() -> None:
  for how in ("as is", "re-evaluated", "tied"):
    r = jit_vg(how)
    print(f"jit_vg BERT-base fp32, 8 H100s, {how}: "
          + ", ".join(f"{k} {v[0]:,.0f}-{v[1]:,.0f}" if isinstance(v, tuple)
                      else f"{k} {v:,.0f}" for k, v in r.items()) + " µs")
  for annotate in (False, True):
    kept, step = annotated_gemms(annotate)
    print(f"gemm chain, {'annotated' if annotate else 'plain'}: "
          f"{kept} gemms keep a scheduling group, step {step:,.0f} µs")


if __name__ == "__main__":
  main()
