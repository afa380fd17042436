"""``z1.value_and_grad``'s aux holds what ``jax.value_and_grad``'s holds.

The loss runs on each device's piece of the batch: a per-example leaf comes
back as the whole batch's rows (split over the data axis), the other leaves
reduced over the devices by ``aux_reduce`` ("mean", "sum" or a function),
an integer averaged says so, and a leaf whose shape depends on the batch in
another way is refused (zero1_jax/core/aux.py).

Tolerances: a per-example row is a 5-term fp32 dot product, the same rows
on a piece as on the whole batch; XLA:CPU may block the two matmuls
differently, which reorders each row's 5 products: |difference| <=
2 * gamma_5 * (|x| @ |w|), gamma_5 = 5u / (1 - 5u), u = 2^-24. Counts and
sums of small integers in fp32 are exact (every partial sum is an integer
below 2^24). A mean of the 48 entries, as the devices' means averaged or as
one mean: each a sum of 48 rounded terms, |difference| <= 2 * 48u *
mean(|rows|) (gamma_48 ~ 48u; the division by a power of two is exact).
z1.train_step's mean of 80 entries over 2 micro-batches x 4 devices: the
same bound with 80 terms.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1

from helpers import mesh

N = 8
U = 2.0 ** -24
GAMMA5 = 5 * U / (1 - 5 * U)


def fun(p, x):
  rows = x @ p["w"]
  return jnp.mean(rows ** 2), {
      "rows": rows,                                   # per example
      "first": rows[:, 0],                            # per example, 1-D
      "mean": jnp.mean(rows),                         # a mean over the batch
      "count": jnp.sum(x[:, 0] > 0),                  # an integer count
      "total": jnp.sum((x[:, 0] > 0).astype(jnp.float32)),   # a float sum
  }


def _run(n=N, **kw):
  """(jax.value_and_grad's aux, z1.value_and_grad's aux, x, w)."""
  with jax.set_mesh(mesh(n)):
    tx = z1.zero1(optax.adam(1e-3), axis_name="data")
    p = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(5, 3)), jnp.float32)}
    x = jax.device_put(
        jnp.asarray(np.random.default_rng(0).normal(size=(16, 5)), jnp.float32),
        NamedSharding(mesh(n), P("data")))
    (_, want), _ = jax.jit(jax.value_and_grad(fun, has_aux=True))(p, x)
    (_, got), _ = jax.jit(z1.value_and_grad(fun, tx, has_aux=True, **kw))(p, x)
  return want, got, np.asarray(x), np.asarray(p["w"])


@pytest.mark.filterwarnings("ignore:zero1. aux leaves")
@pytest.mark.parametrize("n", [1, 2, N])
def test_per_example_leaves_come_back_for_the_whole_batch(n):
  want, got, x, w = _run(n)
  bound = 2 * GAMMA5 * (np.abs(x) @ np.abs(w))
  for k in ("rows", "first"):
    assert got[k].shape == want[k].shape, k
    b = bound if k == "rows" else bound[:, 0]
    assert np.all(np.abs(np.asarray(got[k]) - np.asarray(want[k])) <= b), k
  if n > 1:   # the rows stay on the devices that made them
    assert got["rows"].sharding.spec[0] == "data"
  # a mean of 48 values: the devices' means averaged, against one mean
  mean_bound = 2 * 48 * U * np.mean(np.abs(np.asarray(want["rows"])))
  assert abs(float(got["mean"]) - float(want["mean"])) <= mean_bound


def test_the_default_averages_and_says_so_for_integers():
  with pytest.warns(UserWarning, match=r"aux leaves \['count'\] are integers, "
                    r"averaged over the 8 pieces.*aux_reduce='sum'"):
    want, got, _, _ = _run()
  assert float(got["count"]) == float(want["count"]) / N
  assert float(got["total"]) == float(want["total"]) / N


def test_sum_gives_counts_exactly():
  want, got, _, _ = _run(aux_reduce="sum")
  assert got["count"].dtype == want["count"].dtype
  assert int(got["count"]) == int(want["count"])
  assert float(got["total"]) == float(want["total"])


def test_a_function_reduces_each_leaf_its_own_way():
  def reduce(aux, axis):
    out = jax.lax.pmean(aux, axis)
    return {**out, "count": jax.lax.psum(aux["count"], axis),
            "total": jax.lax.psum(aux["total"], axis)}
  want, got, _, _ = _run(aux_reduce=reduce)
  assert int(got["count"]) == int(want["count"])
  assert float(got["total"]) == float(want["total"])
  assert abs(float(got["mean"]) - float(want["mean"])) <= (
      2 * 48 * U * np.mean(np.abs(np.asarray(want["rows"]))))
  assert got["rows"].shape == want["rows"].shape


def test_a_leaf_shaped_by_the_batch_off_its_leading_dim_is_refused():
  with jax.set_mesh(mesh(N)):
    tx = z1.zero1(optax.sgd(0.1), axis_name="data")
    p = {"w": jnp.ones((5, 3))}
    f = lambda p, x: (jnp.mean(x @ p["w"]), (x @ p["w"]).T)
    with pytest.raises(ValueError, match=r"aux leaf  is \(3, 2\) on a device's "
                       r"piece of the batch and \(3, 16\) on the whole batch"):
      jax.jit(z1.value_and_grad(f, tx, has_aux=True))(p, jnp.ones((16, 5)))
    with pytest.raises(ValueError, match="aux_reduce must be"):
      z1.value_and_grad(f, tx, has_aux=True, aux_reduce="max")


# z1.train_step (and the DeepSpeed engine, which runs it) returns aux reduced
# over its micro-batches and devices: "mean" or "sum", no per-example leaves.

def _step_aux(lf, accum=2, **kw):
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  p, s = z1.init(tx, {"w": jnp.ones((5, 3))}, mesh(4))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 5)), jnp.float32)
  step = z1.train_step(lf, tx, mesh(4), grad_accum_steps=accum, has_aux=True,
                       donate=False, **kw)
  return step(p, s, {"x": x})[2]["aux"], x


def _step_loss(p, b, aux):
  return jnp.mean((b["x"] @ p["w"]) ** 2), aux(p, b)


def test_train_step_sums_counts_with_aux_reduce_sum():
  aux, x = _step_aux(lambda p, b: _step_loss(p, b, lambda p, b: {
      "count": jnp.sum(b["x"][:, 0] > 0)}), aux_reduce="sum")
  assert int(aux["count"]) == int(np.sum(x[:, 0] > 0))


def test_train_step_averages_and_says_so_for_integers():
  with pytest.warns(UserWarning, match=r"\['count'\] are integers, averaged "
                    r"over the 8 pieces"):
    aux, x = _step_aux(lambda p, b: _step_loss(p, b, lambda p, b: {
        "count": jnp.sum(b["x"][:, 0] > 0), "mean": jnp.mean(b["x"])}))
  assert float(aux["count"]) == np.sum(x[:, 0] > 0) / 8   # 8 pieces: 2 x 4
  assert abs(float(aux["mean"]) - float(np.mean(x))) <= 2 * 80 * U * np.mean(np.abs(x))


def test_an_integer_computed_from_no_row_is_averaged_silently():
  """An integer the batch does not reach (a call counter in an nnx model's
  state) is the same on every device, so its mean is it: not warned; a
  count of rows beside it still is."""
  with pytest.warns(UserWarning, match=r"aux leaves \['count'\] are integers"):
    aux, _ = _step_aux(lambda p, b: _step_loss(p, b, lambda p, b: {
        "count": jnp.sum(b["x"][:, 0] > 0), "calls": jnp.int32(3) + 1}))
  assert float(aux["calls"]) == 4.0
  tx = z1.zero1(optax.sgd(0.1), axis_name="data")
  loss = lambda p, x, calls: (jnp.mean((x @ p["w"]) ** 2), {"calls": calls + 1})
  with jax.set_mesh(mesh(4)), warnings.catch_warnings():
    warnings.simplefilter("error")
    p = jax.device_put({"w": jnp.ones((5, 3))}, NamedSharding(mesh(4), P()))
    x = jax.device_put(np.ones((8, 5), np.float32), NamedSharding(mesh(4), P("data")))
    (_, aux), _ = jax.jit(z1.value_and_grad(loss, tx, has_aux=True))(
        p, x, jnp.int32(7))
  assert float(aux["calls"]) == 8.0


def test_train_step_refuses_per_example_aux():
  with pytest.raises(ValueError, match=r"aux leaves \['rows'\] hold one row per "
                     r"example; z1.train_step returns aux reduced"):
    _step_aux(lambda p, b: _step_loss(p, b, lambda p, b: {"rows": b["x"] @ p["w"]}))
  with pytest.raises(ValueError, match="aux_reduce must be 'mean', 'sum', got"):
    _step_aux(lambda p, b: _step_loss(p, b, lambda p, b: {}), aux_reduce=len)
