"""ZeRO-1/ZeRO-2 against unsharded optax on whatever devices jax sees: the
numerical checks of tests/test_equivalence.py and tests/test_precision.py,
for a backend the test suite never runs on (a GPU, N = 1 there).

  python -m experiments.gpu.exact          # run by experiments/gpu/check.sh

Each row: the largest |zero - reference| over all leaves, divided by that
leaf's largest |reference|, after a few steps on the same global batches. The
reference is jitted optax on the whole batch (for bf16/fp16 params, optax on
an fp32 master whose cast drives the forward, as zero1 does). Exit status 1
when a row exceeds its limit. Limits: fp32 1e-5 (measured on 1 and 8 CPU
devices: 2e-6 and 6e-7 at most; only the order of gradient sums differs, and
Adam's normalisation amplifies it for near-zero gradients). bf16/fp16: one
ulp of the weights (2^-8, 2^-11 relative) at N = 1, where the low-precision
gradients are the reference's bit for bit and the master is fp32 on both
sides; at N > 1 those gradients are summed in another order in bf16/fp16
(measured on 8 CPU devices: 2e-2 for Adam after 6 steps), so the row is shown
without a limit: tests/test_precision.py compares them with data-parallel
training instead.
"""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zero1_jax as z1
from zero1_jax.core.one_device import OneDeviceWarning

# A GPU lent alone is N = 1 by design here: the warning that nothing is
# sharded would only print its source line into check.sh's log.
warnings.filterwarnings("ignore", category=OneDeviceWarning)

D_IN, HIDDEN, D_OUT, STEPS = 37, 129, 11, 6   # no dim divisible by 2, 4 or 8


def params(dtype):
  r = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(r.normal(size=s) / np.sqrt(s[0] if s else 1), dtype)
  return {"w1": f(D_IN, HIDDEN), "b1": f(HIDDEN), "w2": f(HIDDEN, D_OUT),
          "b2": f(D_OUT), "gain": jnp.asarray(1.1, dtype)}


def batches(n_rows):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(n_rows, D_IN)).astype(np.float32),
           "y": r.normal(size=(n_rows, D_OUT)).astype(np.float32)}
          for _ in range(STEPS)]


def loss_fn(p, b):
  x = b["x"].astype(p["w1"].dtype)
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  y = (h @ p["w2"] + p["b2"]) * p["gain"]
  return jnp.mean(jnp.square(y.astype(jnp.float32) - b["y"]))


def reference(inner, p0, bs, *, clip=None, scale=1.0):
  """Unsharded optax on an fp32 master; the forward sees the master cast to
  the params' dtype. ``clip``: exact global-norm clip; ``scale``: a static
  loss scale divided back out of the gradients."""
  dtypes = jax.tree.map(lambda x: x.dtype, p0)
  master = jax.tree.map(lambda x: x.astype(jnp.float32), p0)
  tx = optax.chain(optax.clip_by_global_norm(clip), inner) if clip else inner
  s = tx.init(master)

  @jax.jit
  def one(m, s, b):
    low = jax.tree.map(lambda x, d: x.astype(d), m, dtypes)
    g = jax.grad(lambda q: loss_fn(q, b) * scale)(low)
    g = jax.tree.map(lambda x: x.astype(jnp.float32) / scale, g)
    u, s = tx.update(g, s, m)
    return optax.apply_updates(m, u), s

  for b in bs:
    master, s = one(master, s, b)
  return jax.tree.map(lambda x, d: x.astype(d), master, dtypes)


def sharded(make, inner, p0, bs, mesh, accum=1, **kw):
  tx = make(inner, axis_name="data", **kw)
  p, s = z1.init(tx, p0, mesh)
  step = z1.train_step(loss_fn, tx, mesh, grad_accum_steps=accum)
  for b in bs:
    p, s, metrics = step(p, s, b)
  assert not bool(metrics["skipped"]), "the last step was skipped"
  return p


def rel_err(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want), (
      jax.tree.structure(got), jax.tree.structure(want))
  return max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
             / max(float(np.max(np.abs(np.asarray(w, np.float64)))), 1e-30)
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def main() -> int:
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",))
  bs = batches(16 * n)
  adamw = optax.adamw(3e-3, weight_decay=0.01)
  sgd = optax.sgd(0.05, momentum=0.9)
  rows = [
      # name, stage, inner, dtype, limit, zero1 keywords, reference keywords, accum
      ("fp32 adamw", z1.zero1, adamw, jnp.float32, 1e-5, {}, {}, 1),
      ("fp32 adamw, all_reduce", z1.zero1, adamw, jnp.float32, 1e-5,
       {"reduce": "all_reduce"}, {}, 1),
      ("fp32 adamw, clip 0.5, accum 2", z1.zero1, adamw, jnp.float32, 1e-5,
       {"max_grad_norm": 0.5}, {"clip": 0.5}, 2),
      ("fp32 adamw, ZeRO-2, accum 2", z1.zero2, adamw, jnp.float32, 1e-5, {}, {}, 2),
      ("bf16 adamw (fp32 master)", z1.zero1, adamw, jnp.bfloat16, 2.0 ** -8, {}, {}, 1),
      ("fp16 sgd, static loss scale 1024", z1.zero1, sgd, jnp.float16, 2.0 ** -11,
       {"loss_scale": z1.StaticLossScale(1024.0)}, {"scale": 1024.0}, 1),
  ]
  print(f"ZeRO vs unsharded optax: {STEPS} steps, N={n} ({jax.default_backend()}: "
        f"{jax.devices()[0].device_kind}), jax {jax.__version__}")
  print(f"{'case':36s} {'max rel err':>12s} {'limit':>10s}  ok")
  bad = 0
  for name, make, inner, dtype, limit, kw, ref_kw, accum in rows:
    p0 = params(dtype)
    got = sharded(make, inner, p0, bs, mesh, accum, **kw)
    want = reference(inner, p0, bs, **ref_kw)
    err = rel_err(got, want)
    if n > 1 and dtype != jnp.float32:
      print(f"{name:36s} {err:12.3e} {'-':>10s}  - (N > 1: summation order)")
      continue
    ok = err <= limit
    bad += not ok
    print(f"{name:36s} {err:12.3e} {limit:10.3e}  {'yes' if ok else 'NO'}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
