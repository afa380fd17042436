"""Stored shards the loss reads only cast to a narrower dtype are gathered
in it (zero1_jax/core/narrow.py).

fp32 params computing in bf16 (flax's ``Dense(dtype=bf16)``, lm1b, nanodo):
``z1.train_step(shard_params=True)`` gathers such a leaf in bf16 and widens
it back, which hands the loss the values its own cast makes (bf16 -> fp32 ->
bf16 is exact): half the gather's bytes, and every weight, moment and
metric bitwise those of the same step gathering every leaf as it is. A
leaf also read in fp32 is gathered in fp32; the test shows that gathering
it in bf16 would change the step, so the comparison can fail.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero1_jax as z1
from helpers import assert_equal, mesh
from zero1_jax.core import narrow

BF16, F32 = jnp.bfloat16, jnp.float32


@jax.jit
def _dense(x, w):   # a jitted layer: its cast is inside a call
  return jnp.tanh(x @ w.astype(BF16))


def mixed_loss(p, b):
  """w1, w2 and emb are read only cast to bf16 (emb's row lookup aside:
  split on its columns, the step serves it from the shard); scale only in
  fp32; mix both ways."""
  h = jnp.tanh(b["x"].astype(BF16) @ p["w1"].astype(BF16))
  h = _dense(h + p["emb"][b["ids"]].astype(BF16), p["w2"])
  h = h + jax.checkpoint(lambda e: (h @ e.astype(BF16).T) @ e.astype(BF16))(
      p["emb"][:, :8]) * 0.01
  y = h.astype(F32) * p["scale"]
  y = y + p["mix"] + p["mix"].astype(BF16).astype(F32)
  return jnp.mean((y - b["y"]) ** 2)


def mixed_params():
  r = np.random.default_rng(3)
  f = lambda *s: jnp.asarray(r.normal(size=s) * 0.5, F32)
  return {"emb": f(9, 32), "mix": f(8), "scale": f(8), "w1": f(16, 32),
          "w2": f(32, 8)}


def batches(k=3, rows=32):
  r = np.random.default_rng(4)
  return [{"x": r.normal(size=(rows, 16)).astype(np.float32),
           "ids": r.integers(0, 9, size=(rows,)).astype(np.int32),
           "y": r.normal(size=(rows, 8)).astype(np.float32)} for _ in range(k)]


def run(make, n, sharded, loss=mixed_loss, accum=1, lookups="auto", **kw):
  tx = make(optax.adam(1e-2), axis_name="data", **kw)
  p, s = z1.init(tx, mixed_params(), mesh(n))
  step = z1.train_step(loss, tx, mesh(n), shard_params=sharded,
                       grad_accum_steps=accum, shard_lookups=lookups)
  ms = []
  for b in batches():
    p, s, m = step(p, s, b)
    ms.append(m)
  return p, s, ms, step


def test_a_leaf_is_narrow_when_every_read_is_one_narrower_cast():
  p = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4)), "c": jnp.ones((4, 4)),
       "d": jnp.ones((4, 4)), "e": jnp.ones((4, 4)),
       "f": jnp.ones((4, 4), BF16), "g": jnp.ones((4, 4))}
  x = jnp.ones((2, 4))

  @jax.custom_vjp
  def custom(w):
    return w.astype(BF16)

  custom.defvjp(lambda w: (custom(w), w), lambda w, g: (g.astype(F32) * w,))

  def loss(p, x):
    # Every leaf but f is also cast to bf16 once: only its other read decides.
    cast = sum(jnp.sum(p[k].astype(BF16)) for k in "cdeg")
    out = x.astype(BF16) @ jax.jit(lambda w: w.astype(BF16))(p["a"].T)  # moved, jitted
    out = out @ p["b"].astype(jnp.float16).astype(BF16)              # f16: one dtype
    out = out @ p["c"].astype(jnp.float16).astype(BF16)              # two dtypes
    out = out @ custom(p["d"])                                       # custom rule
    out = out @ jax.lax.scan(lambda c, w: (c, w.astype(BF16)), 0.0,
                             p["e"])[1]                              # loop body
    out = out @ p["f"].astype(jnp.float16)                           # not narrower
    return jnp.sum(out.astype(F32)) + jnp.sum(p["g"]) + cast         # fp32
  assert narrow.narrow_reads(loss, p, x) == {0: jnp.dtype(BF16),
                                             1: jnp.dtype(jnp.float16)}
  assert narrow.narrow_reads(loss, p, x, candidates={1}) == {
      1: jnp.dtype(jnp.float16)}


def test_a_row_lookup_of_a_table_read_from_its_shard_is_no_read():
  p = {"emb": jnp.ones((8, 4))}
  loss = lambda p, ids: jnp.sum((p["emb"][ids] @ p["emb"].astype(BF16).T))
  ids = jnp.zeros((2,), jnp.int32)
  assert narrow.narrow_reads(loss, p, ids) == {}
  assert narrow.narrow_reads(loss, p, ids, lookups={0}) == {0: jnp.dtype(BF16)}
  # Rows looked up from the whole leaf, then cast: the cast's values.
  cast_rows = lambda p, ids: jnp.sum(p["emb"][ids].astype(BF16) @ p["emb"].astype(BF16).T)
  assert narrow.narrow_reads(cast_rows, p, ids) == {0: jnp.dtype(BF16)}
  jitted = lambda p, ids: loss({"emb": p["emb"]}, ids) + jnp.sum(
      jax.jit(lambda e: e[ids])(p["emb"]))
  assert narrow.narrow_reads(jitted, p, ids, lookups={0}) == {0: jnp.dtype(BF16)}
  # The rewrite does not serve a lookup inside jax.checkpoint: it reads the
  # whole leaf in fp32.
  remat = lambda p, ids: loss(p, ids) + jnp.sum(
      jax.checkpoint(lambda e: e[ids])(p["emb"]))
  assert narrow.narrow_reads(remat, p, ids, lookups={0}) == {}


def test_returned_or_unread_leaves_are_not_narrow():
  p = {"a": jnp.ones(4), "b": jnp.ones(4)}
  assert narrow.narrow_reads(lambda p: (jnp.sum(p["a"].astype(BF16)), p["a"]),
                             p) == {}


def _gathered(step, p, s, b) -> dict:
  """Elements all-gathered by dtype in the lowered step."""
  out: dict = {}
  text = step.lower(p, s, b).as_text()
  for line in text.splitlines():
    if "all_gather" not in line:
      continue
    m = re.search(r"->\s*tensor<([0-9x]+)x(\w+)>", line)
    if m:
      out[m[2]] = out.get(m[2], 0) + int(np.prod([int(d) for d in m[1].split("x")]))
  return out


def _narrowing(monkeypatch, rule):
  """The step's choice of narrow leaves replaced by ``rule(candidates)``."""
  monkeypatch.setattr(narrow, "narrow_reads",
                      lambda *a, candidates, **k: rule(candidates))


@pytest.mark.parametrize("make,n,accum,kw", [
    (z1.zero1, 8, 1, {}), (z1.zero2, 4, 1, {}),
    (z1.zero1, 4, 2, {"max_grad_norm": 0.5}),
    (z1.zero1, 8, 1, {"lookups": False})],   # emb's rows read from the whole leaf
    ids=["zero1-8", "zero2-4", "zero1-4-accum2-clip", "zero1-8-no-lookups"])
def test_bitwise_the_step_of_fp32_gathers_with_half_their_bytes(make, n, accum, kw,
                                                               monkeypatch):
  run_ = lambda: run(make, n, True, accum=accum, **kw)
  got = run_()
  g = _gathered(got[3], got[0], got[1], batches(1)[0])
  # w1, w2, emb in bf16; mix and scale in fp32 (a bucket padded to N).
  assert g.get("bf16", 0) >= (16 + 8 + 9) * 32
  assert 16 <= g.get("f32", 0) < 16 + 8 * n
  with monkeypatch.context() as m:   # every stored leaf gathered as it is
    _narrowing(m, lambda candidates: {})
    want = run_()
  assert_equal(got[0], want[0], "params ")
  assert_equal(got[1], want[1], "state ")
  assert_equal(got[2], want[2], "metrics ")
  # Planted: every stored leaf gathered in bf16, mix and scale rounded.
  _narrowing(monkeypatch, lambda candidates: {i: jnp.dtype(BF16)
                                              for i in candidates})
  bad = run_()
  with pytest.raises(AssertionError):
    assert_equal(bad[0], want[0], "params ")
