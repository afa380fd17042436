"""z1.train_step(shard_params=True): params kept as each device's shard
between steps and gathered at the start of the next step (the GPU default:
the gathers run under the forward; tests/test_gpu_aot.py reads that plan).

On CPU devices the default is False, so these tests ask for it. The values
are the same program's: the gathered shards are the params bitwise, and the
update reads the same master shard, so every weight, moment and metric is
bitwise that of shard_params=False, for both stages, accumulation, clipping,
bf16 params (a stored fp32 master) and fp16 with overflow skips.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero1_jax as z1
from helpers import assert_equal, exact_batches, exact_loss, mesh, odd_params


def kept_params(dtype=jnp.float32):
  """odd_params (no dim divisible by 2: kept whole) and two leaves that
  split over 2, 4 and 8 without padding: kept sharded (exact_loss reads
  every float leaf)."""
  r = np.random.default_rng(1)
  f = lambda *s: jnp.asarray(r.normal(size=s) * 0.5, dtype)
  return {**odd_params(dtype), "wide": f(3, 16), "row": f(24)}


def boom_loss(params, b):
  return exact_loss(params, b) * jnp.where(jnp.any(b["boom"] > 0), jnp.inf, 1.0)


def run(sharded, make, params, batches, n, accum=1, loss=exact_loss, **kw):
  tx = make(optax.adam(1e-2), axis_name="data", **kw)
  p, s = z1.init(tx, params, mesh(n))
  step = z1.train_step(loss, tx, mesh(n), grad_accum_steps=accum,
                       shard_params=sharded)
  ms = []
  for b in batches:
    p, s, m = step(p, s, b)
    ms.append(m)
  return p, s, ms, step


CASES = [  # (make, n, accum, dtype, kw)
    (z1.zero1, 8, 1, jnp.float32, {}),
    (z1.zero1, 4, 2, jnp.float32, {"max_grad_norm": 0.5}),
    (z1.zero2, 8, 2, jnp.float32, {"max_grad_norm": 0.5}),
    (z1.zero1, 2, 1, jnp.bfloat16, {}),
    (z1.zero2, 1, 1, jnp.float32, {}),
    (z1.zero1, 8, 1, jnp.float16, {"loss_scale": z1.DynamicLossScale(
        initial_scale_power=8, loss_scale_window=2, hysteresis=1)}),
]


@pytest.mark.parametrize("make,n,accum,dtype,kw", CASES,
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_bitwise_the_weights_state_and_metrics_of_whole_params(make, n, accum, dtype, kw):
  params = kept_params(dtype)
  bs = exact_batches(3, size=32)
  loss = exact_loss
  if dtype == jnp.float16:
    loss = boom_loss
    bs = [dict(b, boom=np.full((32,), float(i == 1), np.float32))
          for i, b in enumerate(bs)]
  got = run(True, make, params, bs, n, accum, loss, **kw)
  want = run(False, make, params, bs, n, accum, loss, **kw)
  assert_equal(got[0], want[0], "params ")
  assert_equal(got[1], want[1], "state ")
  assert_equal(got[2], want[2], "metrics ")
  if dtype == jnp.float16:
    assert [bool(m["skipped"]) for m in got[2]] == [False, True, False]


def test_params_come_back_one_nth_per_device_and_one_program_serves_every_step():
  """What is kept: each leaf that splits over N without padding as 1/N
  per device (the same global values); the others (scalars, integers, a
  leaf padded to split) whole. The first step's replicated params are moved
  there before the call, so one compiled program serves every step."""
  params = kept_params()
  p, s, _, step = run(True, z1.zero1, params, exact_batches(3, size=32), 8)
  layout = z1.plan(params, 8)
  dev = jax.devices()[0]
  for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(p)[0],
                             layout.leaves):
    kept = spec.kind == "shard" and spec.padded_shape == spec.shape
    want = spec.shard_size if kept else int(np.prod(spec.shape))
    assert z1.inspect.device_bytes(x, dev) == want * x.dtype.itemsize, path
  assert any(spec.kind == "shard" and spec.padded_shape == spec.shape
             for spec in layout.leaves)
  assert step._jitted._cache_size() == 1


@pytest.mark.parametrize("sharded", [True, False])
def test_one_program_for_every_step_from_z1_init(sharded):
  """z1.init's replicated params are typed P() on an Explicit mesh, the
  step returns P(None, ...): jit compiled the step twice, the second time
  at step 2 (a second BERT-base compile). The wrapper hands the first step
  its params as the step returns them."""
  *_, step = run(sharded, z1.zero1, kept_params(), exact_batches(3, size=32), 4)
  assert step._jitted._cache_size() == 1


def test_what_reads_params_reads_them_whole():
  """Outside the step the kept params are ordinary global arrays: a jitted
  loss, numpy, z1.inner_state and a checkpoint read the same values as
  whole ones; a checkpoint of them restores and trains on."""
  import tempfile
  from zero1_jax import checkpoint as zc
  params = kept_params()
  bs = exact_batches(4, size=32)
  p, s, _, step = run(True, z1.zero1, params, bs[:2], 4)
  q, r, _, _ = run(False, z1.zero1, params, bs[:2], 4)
  assert float(jax.jit(exact_loss)(p, bs[2])) == float(jax.jit(exact_loss)(q, bs[2]))
  assert_equal(jax.tree.map(np.asarray, p), jax.tree.map(np.asarray, q), "numpy ")
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  assert_equal(z1.inner_state(tx, s, p), z1.inner_state(tx, r, q), "inner ")
  with tempfile.TemporaryDirectory() as d:
    ck = zc.Checkpointer(d)
    ck.save(2, p, s)
    ck.wait()
    p2, s2, _ = zc.Checkpointer(d).restore(2, tx, params, mesh(4))
  for x in bs[2:]:
    p2, s2, _ = step(p2, s2, x)
    q, r, _ = z1.train_step(exact_loss, tx, mesh(4), shard_params=False)(q, r, x)
  assert_equal(p2, q, "restored and continued ")


def test_shard_params_takes_true_false_or_auto():
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  with pytest.raises(ValueError, match="shard_params must be True, False or 'auto'"):
    z1.train_step(exact_loss, tx, mesh(2), shard_params="yes")
