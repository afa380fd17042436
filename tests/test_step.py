"""train_step: accumulation, clipping, memory and communication (bad input:
tests/test_step_errors.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from helpers import (assert_close, assert_equal, batch, deepspeed_clip,
                     float_part, loss_fn, mesh, odd_params, optax_run, rel_err)
from tolerances import FP32_REORDER, FP32_SCALAR_REORDER


def test_four_micro_batches_equal_one_big_batch():
  params = odd_params()
  bs = [batch(32, seed=s) for s in range(5)]
  out = {}
  for accum in (1, 4):
    tx = z1.zero1(optax.sgd(0.05, momentum=0.9), axis_name="data")
    p, s = z1.init(tx, params, mesh(2))
    step = z1.train_step(loss_fn, tx, mesh(2), grad_accum_steps=accum)
    for b in bs:
      p, s, m = step(p, s, b)
    out[accum] = (float_part(p), m)
  # fp32 rounding (summing 4 micro-batch gradients vs one), 5 SGD steps with
  # momentum: measured 6.4e-8 between the two, 1.3e-7 against optax.
  assert_close(out[4][0], out[1][0], FP32_REORDER, "accum ")
  np.testing.assert_allclose(out[4][1]["loss"], out[1][1]["loss"], rtol=FP32_SCALAR_REORDER)
  assert_close(out[1][0], optax_run(optax.sgd(0.05, momentum=0.9), params, bs),
               FP32_REORDER, "big batch vs optax ")


def test_micro_batches_are_consecutive_and_split_in_device_order():
  """With rows x[r] = r, B=8, A=2 micro-batches, N=2 devices, each device's
  micro-batch must be two consecutive rows: {0,1} {2,3} | {4,5} {6,7}. A loss
  that squares each (device, micro-batch) mean tells the grouping apart from a
  strided one ({0,2} {1,3} ...)."""
  n, accum = 2, 2
  tx = z1.zero1(optax.sgd(1.0), axis_name="data")
  p, s = z1.init(tx, {"w": jnp.zeros(())}, mesh(n))
  shapes = set()

  def probe(p, b):
    shapes.add(b["x"].shape)
    return p["w"] * jnp.mean(b["x"]) ** 2

  step = z1.train_step(probe, tx, mesh(n), grad_accum_steps=accum)
  p, s, m = step(p, s, {"x": np.arange(8, dtype=np.float32)})
  assert shapes == {(2,)}            # 8 rows / 2 micro / 2 devices
  want = np.mean([0.5 ** 2, 2.5 ** 2, 4.5 ** 2, 6.5 ** 2])   # 17.25
  np.testing.assert_allclose(p["w"], -want)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_clipping_equals_unsharded_clip_by_global_norm(opt):
  """SGD's update is proportional to the clipped gradient, so a wrong clip
  coefficient shows one for one; Adam hides a constant factor."""
  make = {"adam": lambda: optax.adam(1e-2),
          "sgd": lambda: optax.sgd(0.1, momentum=0.9)}[opt]
  params = odd_params()
  bs = [batch(16, seed=s) for s in range(10)]
  ref = optax_run(optax.chain(optax.clip_by_global_norm(2.0), make()), params, bs)
  tx = z1.zero1(make(), axis_name="data", max_grad_norm=2.0)
  p, s = z1.init(tx, params, mesh(4))
  step = z1.train_step(loss_fn, tx, mesh(4))
  norms = []
  for b in bs:
    p, s, m = step(p, s, b)
    norms.append(float(m["grad_norm"]))
  assert max(norms) > 2.0 and min(norms) < 2.0   # clipped and unclipped steps
  # fp32 rounding over 10 steps, as in test_equivalence: measured 6.7e-8
  # (adam), 3.4e-7 (sgd).
  assert_close(float_part(p), ref, FP32_REORDER, f"clipped {opt} ")


def test_deepspeed_clip_rule_equals_its_unsharded_formula():
  """SGD makes the update proportional to the clip coefficient (Adam would
  hide it). The two rules differ by the 1e-6 DeepSpeed adds to the norm, so
  the loss is scaled to give norms of ~1e-6 with a clip of 1e-7: there the
  coefficients differ by ~2x and a swapped rule cannot pass."""
  params = odd_params()
  bs = [batch(16, seed=s) for s in range(6)]
  tiny = lambda p, b: 1e-6 * loss_fn(p, b)
  c, lr = 1e-7, 1e5
  run = lambda clip: optax_run(optax.chain(clip, optax.sgd(lr)), params, bs,
                               loss=tiny)
  ref, other = run(deepspeed_clip(c)), run(optax.clip_by_global_norm(c))
  tx = z1.zero1(optax.sgd(lr), axis_name="data", max_grad_norm=c,
                clip_rule="deepspeed")
  p, s = z1.init(tx, params, mesh(4))
  step = z1.train_step(tiny, tx, mesh(4))
  for b in bs:
    p, s, m = step(p, s, b)
    assert float(m["grad_norm"]) > c          # clipping active every step
  # Each step moves a weight by at most lr * c = 1e-2 of its ~1 size, so the
  # two programs' updates differ by ~1e-9 of the weights, and that can flip
  # the rounding of a weight plus its update by one ulp. A leaf's largest
  # weight w is ~1, and one ulp of any weight up to w is at most 2^-23 w.
  # Measured: 1.6e-9 (jax 0.10.2), 1.5e-8 (jax 0.12: one weight of ~0.2 one
  # ulp off). The other rule is 1e-3 away (below).
  assert_close(float_part(p), ref, 2 ** -23, "deepspeed clip ")
  assert rel_err(other, ref) > 1e-3   # the optax rule is far off here
  with pytest.raises(ValueError, match="clip_rule"):
    z1.zero1(optax.sgd(1.0), axis_name="data", clip_rule="torch")


def test_grad_norm_metric_is_the_global_norm():
  params = odd_params()
  b = batch(16)
  want = optax.tree.norm(jax.grad(loss_fn)(float_part(params), b))
  tx = z1.zero1(optax.sgd(0.0), axis_name="data")
  p, s = z1.init(tx, params, mesh(8))
  _, _, m = z1.train_step(loss_fn, tx, mesh(8))(p, s, b)
  np.testing.assert_allclose(m["grad_norm"], want, rtol=FP32_SCALAR_REORDER)
  np.testing.assert_allclose(m["loss"], loss_fn(float_part(params), b), rtol=FP32_SCALAR_REORDER)


def test_has_aux_is_averaged_over_devices():
  def lf(p, b):
    return loss_fn(p, b), {"mean_x": jnp.mean(b["x"])}
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  p, s = z1.init(tx, odd_params(), mesh(4))
  b = batch(16)
  _, _, m = z1.train_step(lf, tx, mesh(4), has_aux=True)(p, s, b)
  np.testing.assert_allclose(m["aux"]["mean_x"], b["x"].mean(), rtol=1e-5)


@pytest.mark.parametrize("accum", [1, 2])
def test_accepts_a_batch_already_sharded_over_data(accum):
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  p, s = z1.init(tx, odd_params(), mesh(4))
  host = batch(16)
  b = jax.device_put(host, NamedSharding(mesh(4), P("data")))
  step = z1.train_step(loss_fn, tx, mesh(4), grad_accum_steps=accum, donate=False)
  p_sharded, _, m_sharded = step(p, s, b)
  p_host, _, m_host = step(p, s, host)
  # The same rows on the same devices: the same per-device programs, so the
  # new weights are bitwise those of the host batch (measured: equal), and
  # within fp32 rounding of unsharded optax (measured: 0 after one step).
  assert_equal(p_sharded, p_host, f"sharded accum={accum} ")
  assert_close(float_part(p_sharded),
               optax_run(optax.adam(1e-3), odd_params(), [host]), FP32_REORDER,
               f"sharded accum={accum} vs optax ")
  np.testing.assert_allclose(m_sharded["loss"], m_host["loss"], rtol=FP32_SCALAR_REORDER)
  np.testing.assert_allclose(m_sharded["grad_norm"], m_host["grad_norm"], rtol=FP32_SCALAR_REORDER)


@pytest.mark.parametrize("explicit", [False, True])
def test_micro_batches_move_no_row_between_devices(explicit):
  """A batch sharded over data, split into 2 micro-batches: each device's
  rows are its micro-batches' (the documented order, below), so the step
  moves none of them. Micro-batch a as the a-th block of all rows made XLA
  move (N - 1) / N of the batch every step: an all-to-all (and a
  collective-permute) in the program."""
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto,)
  m = jax.make_mesh((4,), ("data",), axis_types=types)
  p, s = z1.init(tx, odd_params(), m)
  b = jax.device_put(batch(16), NamedSharding(m, P("data")))
  step = z1.train_step(loss_fn, tx, m, grad_accum_steps=2, donate=False)
  kinds = z1.inspect.hlo_collectives(step.lower(p, s, b).compile().as_text())
  assert "reduce-scatter" in kinds and "all-gather" in kinds, kinds
  assert not {"all-to-all", "collective-permute"} & set(kinds), kinds


def placement_probe(p, b):
  """Weighs each device's rows by its index, nonlinearly in their mean: the
  gradient says which rows each device (and micro-batch) held. A mean loss
  cannot: rows on the wrong device give the same mean."""
  d = jax.lax.axis_index("data").astype(jnp.float32)
  return p["w"] * (d + 1) * jnp.mean(b["x"]) ** 2


def probe_update(rows, accum, n):
  """-grad of placement_probe when micro-batch a of device d holds the a-th
  of the accum blocks of device d's rows (the d-th block of rows // n: the
  documented order)."""
  x = np.arange(rows, dtype=np.float64).reshape(n, accum, rows // (accum * n))
  x = x.swapaxes(0, 1)
  return -np.mean((np.arange(n) + 1) * x.mean(-1) ** 2)


PLACEMENTS = {
    "host": lambda x, n: x,
    "one_device": lambda x, n: jax.device_put(x, jax.devices()[0]),
    "another_device": lambda x, n: jax.device_put(x, jax.devices()[7]),
    "sharded": lambda x, n: jax.device_put(x, NamedSharding(mesh(n), P("data"))),
    "replicated": lambda x, n: jax.device_put(x, NamedSharding(mesh(n), P())),
    "other_mesh": lambda x, n: jax.device_put(x, NamedSharding(
        jax.make_mesh((n,), ("data",), devices=jax.devices()[-n:]), P("data"))),
}


@pytest.fixture(scope="module")
def probe_steps():
  n = 4
  tx = z1.zero1(optax.sgd(1.0), axis_name="data")
  p, s = z1.init(tx, {"w": jnp.zeros(())}, mesh(n))
  return n, p, s, {a: z1.train_step(placement_probe, tx, mesh(n),
                                    grad_accum_steps=a, donate=False)
                   for a in (1, 2)}


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("where", sorted(PLACEMENTS))
def test_each_device_gets_its_rows_wherever_the_batch_lives(where, accum,
                                                            probe_steps):
  n, p, s, steps = probe_steps
  x = PLACEMENTS[where](np.arange(16, dtype=np.float32), n)
  new, _, _ = steps[accum](p, s, {"x": x})
  # Dyadic values throughout (row means k + 1/2, weights 1..4, divisions by
  # 2 and 4): exact in fp32.
  assert float(new["w"]) == probe_update(16, accum, n), where
def test_models_with_exact_gelu_train():
  """erf (exact GELU) traces inside the step on every supported jax."""
  def gelu_loss(p, b):
    h = jax.nn.gelu(b["x"] @ p["dense"]["kernel"], approximate=False)
    return jnp.mean((h @ p["out"]["kernel"] - b["y"]) ** 2)
  params = float_part(odd_params())
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  p, s = z1.init(tx, params, mesh(2))
  step = z1.train_step(gelu_loss, tx, mesh(2), grad_accum_steps=2)
  for i in range(3):
    p, s, m = step(p, s, batch(8, seed=i))
  assert np.isfinite(m["loss"])
  ref = params
  tx0 = optax.adam(1e-2)
  s0 = tx0.init(ref)
  for i in range(3):
    u, s0 = tx0.update(jax.grad(gelu_loss)(ref, batch(8, seed=i)), s0, ref)
    ref = optax.apply_updates(ref, u)
  assert_close(float_part(p), ref, FP32_REORDER, "gelu ")


def test_accepts_a_batch_committed_to_one_device():
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  p, s = z1.init(tx, odd_params(), mesh(4))
  step = z1.train_step(loss_fn, tx, mesh(4), donate=False)
  host = batch(16)
  one = jax.device_put(host, jax.devices()[0])
  p_one, _, m_one = step(p, s, one)
  p_host, _, m_host = step(p, s, host)
  # Moved onto the mesh in row order: bitwise the host batch's step
  # (measured: equal). Which device gets which rows: the placement probe above.
  assert_equal(p_one, p_host, "one device ")
  np.testing.assert_allclose(m_one["loss"], m_host["loss"], rtol=FP32_SCALAR_REORDER)
  with pytest.raises(ValueError, match="batch size 6 is not divisible"):
    step(p, s, jax.device_put(batch(6), jax.devices()[0]))


def test_accumulation_keeps_one_micro_batch_of_activations():
  """Accumulation exists to hold one micro-batch's activations at a time.
  At grad_accum_steps=2 the step held two (XLA inlined a loop of one and ran
  both forwards first): temporaries 1.68x those of one micro-batch. Two
  micro-batches in one loop hold what four do (the same loop body, the same
  accumulator): measured 0.99x here, and 1.25x with the first micro-batch
  planted back outside the loop. (Against one micro-batch the ratio also
  moves with how the step without a loop is laid out, 1.14x to 1.46x.)"""
  m = mesh(2)
  k = jax.random.split(jax.random.key(0), 2)
  params = {"w1": jax.random.normal(k[0], (8, 256)) * 0.1,
            "w2": jax.random.normal(k[1], (256, 256)) * 0.1,
            "w3": jnp.zeros((256, 1))}

  def mlp_loss(p, b):
    h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"])
    return jnp.mean((h @ p["w3"] - b["y"]) ** 2)

  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  p, s = z1.init(tx, params, m)
  temp = {}
  for accum in (1, 2, 4):
    rows = 2 * 512 * accum          # 512 rows a micro-batch on each device
    b = {"x": np.ones((rows, 8), np.float32), "y": np.ones((rows, 1), np.float32)}
    step = z1.train_step(mlp_loss, tx, m, grad_accum_steps=accum)
    temp[accum] = z1.inspect.memory(step, p, s, b)["temp"]
  assert temp[2] <= 1.1 * temp[4], temp


def test_no_zero_size_array_enters_a_shard_map():
  """jaxlib 0.11.2 (the GPU machine's) segfaults compiling a shard_map that
  takes a zero-size array beside other inputs (odd_params' "empty" leaf
  crashed 146 tests there); zero1's shard_maps get None in its place and
  rebuild it inside with its per-device shape."""
  from zero1_jax.core import empty_leaves

  msh = mesh(4)
  seen = {}

  def f(e, rows, cols, x):
    seen.update(e=e.shape, rows=rows.shape, cols=cols.shape)
    return e, rows, cols, x * 2

  g = empty_leaves.shard_map(
      f, mesh=msh, in_specs=(P(), P("data"), P(None, "data"), P()),
      out_specs=(P(), P("data"), P(None, "data"), P()), check_vma=False)
  # (specs of the arguments, placed as shard_map wants them)
  specs = (P(), P("data"), P(None, "data"), P())
  args = [jax.device_put(a, NamedSharding(msh, sp)) for a, sp in zip(
      (jnp.zeros((0, 3)), jnp.zeros((0, 8)), jnp.zeros((0, 8)), jnp.ones(4)),
      specs)]
  jaxpr = jax.make_jaxpr(g)(*args)
  (sm,) = [e for e in jaxpr.eqns if "shard_map" in str(e.primitive)]
  assert all(np.prod(v.aval.shape) > 0 for v in sm.invars), sm.invars
  out = g(*args)
  assert seen == {"e": (0, 3), "rows": (0, 8), "cols": (0, 2)}
  assert [o.shape for o in out] == [(0, 3), (0, 8), (0, 8), (4,)]
  # z1.train_step on odd_params (an empty leaf, None in the inner state)
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  p, s = z1.init(tx, odd_params(), msh)
  p, s, _ = z1.train_step(loss_fn, tx, msh)(p, s, batch(8))
  assert p["empty"].shape == (0, 3)
