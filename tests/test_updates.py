"""What ``tx.update`` returns as ``updates`` (core/updates.py; issue #38
item 2): optax's ``u`` where a param is its own master, ``new - params``
for bf16/fp16 params, with one param-dtype all-gather either way.

It returned ``fl(p + u) - p`` everywhere: adamw(1e-5) on |p| ~ 3 gave
updates 2e-3 relative off optax's elementwise (2.4e-2 of max|u|) and
``optax.global_norm(updates)`` 4.5316e-4 against optax's 4.5255e-4; loops log
update norms and update/param ratios, and some reuse the updates.

Plain jit under a mesh, gradients handed whole (as optax's tests do), so
zero1 runs the inner optimizer's arithmetic on slices of the same inputs.
Tolerance for ``u``: two XLA programs compute the same elementwise ops; each
may contract a multiply-add into a fused multiply-add where the other does
not, one rounding each, a few per element (adam: the two moment updates, the
bias corrections, the step): 8 ulps of the leaf's max|u|. Measured here:
bitwise (jax 0.10.2, XLA:CPU). The old ``fl(p + u) - p`` is off by up to an
ulp of p, 2^-22 x 3 / 1e-5 ~ 7e4 ulps of u: far outside.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from helpers import mesh

ULPS_OF_U = 8


def _params(seed=0):
  r = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(r.normal(size=s) * 3, jnp.float32)
  return {"k": f(13, 5), "b": f(7), "s": f()}   # odd shapes, a scalar


def _grads(params, i):
  r = np.random.default_rng(100 + i)
  return jax.tree.map(lambda p: jnp.asarray(r.normal(size=np.shape(p)), p.dtype)
                      if jnp.issubdtype(p.dtype, jnp.floating)
                      else jnp.zeros_like(p), params)


def _close_in_ulps_of_u(got, want, what):
  for k in want:
    g, w = np.asarray(got[k]), np.asarray(want[k])
    assert g.dtype == w.dtype, (what, k, g.dtype, w.dtype)
    if not jnp.issubdtype(w.dtype, jnp.floating):
      np.testing.assert_array_equal(g, w)
      continue
    atol = ULPS_OF_U * np.finfo(w.dtype).eps * np.max(np.abs(w))
    np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=f"{what} {k}")


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("name,make", [
    ("adamw(1e-5)", lambda: optax.adamw(1e-5)),
    ("sgd momentum", lambda: optax.sgd(0.1, momentum=0.9)),
    ("lion", lambda: optax.lion(1e-3)),
])
def test_updates_are_optaxs_u_for_fp32_params(n, name, make):
  params = _params()
  opt = make()
  tx = z1.zero1(make(), axis_name="data")
  ref_update = jax.jit(opt.update)
  q, t = params, opt.init(params)
  with jax.set_mesh(mesh(n)):
    p = jax.device_put(params, NamedSharding(mesh(n), P()))
    s = tx.init(p)
    step = jax.jit(tx.update)
    for i in range(3):
      u, s = step(_grads(params, i), s, p)
      v, t = ref_update(_grads(params, i), t, q)
      _close_in_ulps_of_u(u, v, f"{name} N={n} step {i}")
      # The loop's own numbers: the norm and the update/param ratio.
      assert float(optax.tree.norm(u)) == pytest.approx(
          float(optax.tree.norm(v)), rel=ULPS_OF_U * 2 ** -23)
      p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
  # The weights: p + u rounded once on each side, from equal u.
  _close_in_ulps_of_u(p, q, f"{name} N={n} params")


def test_bf16_params_get_the_cast_master_as_new_minus_params():
  """A mixed tree: the fp32 leaf gets u; the bf16 leaf (fp32 master stored)
  gets new - params, and apply_updates gives the master cast exactly (each
  step moves a weight by far less than a factor 2: Sterbenz). A step of
  0.01 is 0.6 to 1.3 bf16 ulps here: a bf16 u added to bf16 params would
  round each step and drift from the master."""
  params = {"f": jnp.linspace(1.0, 3.0, 11, dtype=jnp.float32),
            "h": jnp.linspace(1.0, 3.0, 11, dtype=jnp.bfloat16)}
  grads = {"f": jnp.full(11, 0.5, jnp.float32), "h": jnp.full(11, 0.5, jnp.bfloat16)}
  tx = z1.zero1(optax.sgd(0.02), axis_name="data")
  with jax.set_mesh(mesh(8)):
    s = tx.init(params)
    p = params
    for _ in range(3):
      u, s = jax.jit(tx.update)(grads, s, p)
      p = optax.apply_updates(p, u)
    np.testing.assert_array_equal(np.asarray(u["f"]),
                                  -np.float32(0.02) * np.float32(0.5))
    master = np.asarray(s.master["h"])[:11]
  assert u["h"].dtype == jnp.bfloat16
  assert np.any(np.asarray(p["h"]) != np.asarray(params["h"]))
  np.testing.assert_array_equal(np.asarray(p["h"]),
                                np.asarray(jnp.asarray(master).astype(jnp.bfloat16)))


def test_the_gather_moves_each_param_once():
  """One param-dtype array per leaf crosses the all-gather (u or the new
  weights), not both: the same collectives and bytes as z1.train_step's
  gather of the new weights (fp32 and bf16 buckets)."""
  params = {**_params(), "h": jnp.ones((9, 3), jnp.bfloat16)}
  n = 8
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  loss = lambda p, b: sum(jnp.sum(x.astype(jnp.float32)) * jnp.mean(b)
                          for x in jax.tree.leaves(p))
  p, s = z1.init(tx, params, mesh(n))
  want = z1.inspect.collectives(z1.train_step(loss, tx, mesh(n)), p, s,
                                jnp.ones(8))["all-gather"]
  with jax.set_mesh(mesh(n)):
    s = tx.init(params)
    got = z1.inspect.collectives(jax.jit(tx.update), _grads(params, 0), s,
                                 params)["all-gather"]
  assert got == want, (got, want)
  assert got.count == 2 and got.bytes >= 4 * (65 + 7) + 2 * 27, got
