"""Parameters already in the master dtype are their own master.

* State bytes per device (``addressable_shards``): Adam keeps 8 bytes per
  padded shard element for fp32 params (mu, nu) and 12 for bf16 params
  (fp32 master, mu, nu), plus the scalars; a mixed tree is the sum of both.
* The fp32 trajectory is bitwise the one the code before this change
  (commit 0129125, which kept an fp32 master shard for fp32 params) wrote to
  ``tests/fixtures/fp32_master_v1`` (see ``make_fp32_master_v1.py``).
* A checkpoint in that older layout (an fp32 master for every floating
  param) restores, at its N and at another, continues bitwise, and exports.
* A state built for fp32 params refuses bf16 params with a clear error.
"""

import json
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero1_jax as z1
from zero1_jax import checkpoint as zc
from helpers import mesh

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "fp32_master_v1"
sys.path.insert(0, str(FIXTURE.parent))
import make_fp32_master_v1 as fx  # noqa: E402

D = 250          # odd for N = 4, 8: padding exercised
SCALARS = 4 + 16  # adam's count (i32) + the loss-scale state (4 x 4 bytes)


def tree(dtypes):
  r = np.random.default_rng(0)
  return {f"l{i}": {"w": jnp.asarray(r.normal(size=(D, 9)), dt),
                    "b": jnp.asarray(r.normal(size=(D,)), dt)}
          for i, dt in enumerate(dtypes)}


def padded_elems(params, n):
  return sum(l.shard_size for l in z1.plan(params, n).leaves)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("dtypes, per_elem", [
    ((jnp.float32, jnp.float32), 8),      # mu, nu; the params are the master
    ((jnp.bfloat16, jnp.bfloat16), 12),   # fp32 master, mu, nu
], ids=["fp32", "bf16"])
def test_state_bytes_per_device(n, dtypes, per_elem):
  params = tree(dtypes)
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  _, s = z1.init(tx, params, mesh(n))
  want = per_elem * padded_elems(params, n) + SCALARS
  got = {z1.inspect.device_bytes(s, d) for d in mesh(n).devices.flat}
  assert got == {want}, (got, want)
  stored = [x for x in jax.tree.leaves(s.master)]
  assert len(stored) == (0 if per_elem == 8 else 2 * len(dtypes))


def test_mixed_tree_keeps_a_master_for_bf16_leaves_only():
  n = 8
  params = tree((jnp.float32, jnp.bfloat16, jnp.float32))
  params["scale"] = jnp.asarray(2.0, jnp.float32)       # replicated scalar
  params["scale16"] = jnp.asarray(2.0, jnp.bfloat16)
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  _, s = z1.init(tx, params, mesh(n))
  has = {k: [x is not None for x in jax.tree.leaves(
      v, is_leaf=lambda x: x is None)] for k, v in s.master.items()}
  assert has == {"l0": [False, False], "l1": [True, True], "l2": [False, False],
                 "scale": [False], "scale16": [True]}
  lay = z1.plan(params, n)
  f32 = sum(l.shard_size for l in lay.leaves if l.dtype == np.float32)
  b16 = sum(l.shard_size for l in lay.leaves if l.dtype != np.float32)
  want = 8 * f32 + 12 * b16 + SCALARS
  assert {z1.inspect.device_bytes(s, d) for d in mesh(n).devices.flat} == {want}
  assert lay.state_bytes_per_device() == want - SCALARS
  # Sharded and specs agree: the master tree has None where nothing is stored.
  specs = z1.specs.state_specs(tx, params, n)
  assert jax.tree.structure(specs.master) == jax.tree.structure(s.master)


def run_new(steps):
  m = jax.make_mesh((fx.N,), ("data",), devices=jax.devices()[:fx.N])
  tx = fx.make_tx(z1)
  p, s = z1.init(tx, fx.params(), m)
  step = z1.train_step(fx.loss, tx, m)
  for b in fx.batches()[:steps]:
    p, s, _ = step(p, s, b)
  return p, s


def assert_matches_old(p, s, what):
  """Params, counts and moments (cut to the parameter's shape: the fixture
  is padded for N=4) bitwise equal to what the old code wrote."""
  ref = np.load(FIXTURE / "after.npz")
  got = {**fx.flat(p, "params"), **fx.flat(s.inner, "inner")}
  assert sorted(got) == sorted(ref.files)
  for k in ref.files:
    g, r = got[k], ref[k]
    if g.shape != r.shape:     # padded for another N: the rest is zero
      cut = tuple(slice(0, min(a, b)) for a, b in zip(g.shape, r.shape))
      for x in (g, r):
        rest = x.copy()
        rest[cut] = 0
        assert not rest.any(), f"{what} {k}: nonzero padding"
      g, r = g[cut], r[cut]
    np.testing.assert_array_equal(g, r, err_msg=f"{what} {k}")


def test_fp32_trajectory_is_bitwise_the_previous_code():
  """The fixture was written by commit 0129125 (fp32 master kept): params,
  moments and counts after 6 steps are bit for bit the same now. Gradients
  are exact dyadic sums, so the comparison does not hinge on reduction
  order."""
  p, s = run_new(fx.STEPS_BEFORE + fx.STEPS_AFTER)
  assert s.master["dense"]["kernel"] is None
  assert s.master["out"]["kernel"] is not None
  assert_matches_old(p, s, "from scratch")


@pytest.fixture
def old_ckpt(tmp_path):
  d = tmp_path / "old"
  shutil.copytree(FIXTURE / "ckpt", d)
  meta = json.loads((d / str(fx.STEPS_BEFORE) / "meta" / "metadata").read_text())
  # It really is the old layout: fp32 params have a master entry.
  paths = {r["path"] for r in meta["state"]}
  assert {".master['dense']['kernel']", ".master['gain']",
          ".master['out']['kernel']"} <= paths
  return d


def test_old_checkpoint_restores_and_continues_bitwise(old_ckpt):
  m = jax.make_mesh((fx.N,), ("data",), devices=jax.devices()[:fx.N])
  tx = fx.make_tx(z1)
  with zc.Checkpointer(old_ckpt, create=False) as c:
    p, s, extra = c.restore(None, tx, fx.params(), m)
  assert extra == {"step": fx.STEPS_BEFORE}
  assert s.master["dense"]["kernel"] is None and s.master["gain"] is None
  step = z1.train_step(fx.loss, tx, m)
  for b in fx.batches()[fx.STEPS_BEFORE:]:
    p, s, _ = step(p, s, b)
  assert_matches_old(p, s, "old checkpoint")


@pytest.mark.parametrize("n", [2, 8])
def test_old_checkpoint_reshards(old_ckpt, n):
  tx = fx.make_tx(z1)
  with zc.Checkpointer(old_ckpt, create=False) as c:
    p, s, _ = c.restore(None, tx, fx.params(), mesh(n))
  step = z1.train_step(fx.loss, tx, mesh(n))
  for b in fx.batches()[fx.STEPS_BEFORE:]:
    p, s, _ = step(p, s, b)
  # Exact dyadic gradients: N only changes the summation order, which is exact.
  assert_matches_old(p, s, f"old checkpoint at N={n}")


def test_export_of_old_and_new_checkpoints(old_ckpt, tmp_path):
  """Export writes every floating leaf in fp32: the master of bf16 leaves,
  the params themselves for fp32 leaves (old checkpoint: its fp32 master,
  which is equal)."""
  zc.export_params(old_ckpt, tmp_path / "old_export")
  old = zc.load_params(tmp_path / "old_export")
  tx = fx.make_tx(z1)
  with zc.Checkpointer(old_ckpt, create=False) as c:
    p, s, _ = c.restore(None, tx, fx.params(), mesh(fx.N))
  with zc.Checkpointer(tmp_path / "new", async_save=False) as c:
    c.save(fx.STEPS_BEFORE, p, s)
    meta = c.metadata()
  paths = {r["path"] for r in meta["state"]}
  assert ".master['dense']['kernel']" not in paths and ".master['gain']" not in paths
  assert ".master['out']['kernel']" in paths
  zc.export_params(tmp_path / "new", tmp_path / "new_export")
  new = zc.load_params(tmp_path / "new_export")
  for got in (old, new):
    np.testing.assert_array_equal(got["dense"]["kernel"], np.asarray(p["dense"]["kernel"]))
    np.testing.assert_array_equal(got["gain"], np.asarray(p["gain"]))
    master = np.asarray(s.master["out"]["kernel"])[:7]
    np.testing.assert_array_equal(got["out"]["kernel"], master)
    assert got["out"]["kernel"].dtype == np.float32
    assert all(x.dtype == np.float32 for k, x in
               jax.tree_util.tree_flatten_with_path(got)[0]
               if "step_id" not in jax.tree_util.keystr(k))


def test_state_for_other_dtypes_is_refused_with_a_clear_error():
  n = 4
  params = tree((jnp.float32,))
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  p, s = z1.init(tx, params, mesh(n))
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
  step = z1.train_step(lambda p, b: jnp.sum(p["l0"]["w"].astype(jnp.float32))
                       * b["x"].mean(), tx, mesh(n))
  with pytest.raises(ValueError, match=r"master\['l0'\]\['b'\] has no master "
                     r"copy, but the parameter is bfloat16.*param_dtype"):
    step(p16, s, {"x": np.ones((n, 1), np.float32)})


def test_init_param_dtype_takes_the_master_before_the_cast():
  n = 4
  params = tree((jnp.float32,))
  tx = z1.zero1(optax.adam(1e-3), axis_name="data")
  p, s = z1.init(tx, params, mesh(n), param_dtype=jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p))
  w = np.asarray(s.master["l0"]["w"])[:D]
  np.testing.assert_array_equal(w, np.asarray(params["l0"]["w"]))  # not rounded
  np.testing.assert_array_equal(np.asarray(p["l0"]["w"]),
                                np.asarray(params["l0"]["w"].astype(jnp.bfloat16)))


def test_overflow_with_fp32_params_keeps_params_and_state():
  """No stored master: a skipped step must still leave the params (the
  master) and the moments exactly as they were."""
  n = 4
  params = tree((jnp.float32,))
  tx = z1.zero1(optax.adam(1e-2), axis_name="data",
                loss_scale=z1.DynamicLossScale(initial_scale_power=8))

  def loss(p, b):
    y = jnp.sum(jnp.tanh(b["x"] @ p["l0"]["w"]) * p["l0"]["b"][:9])
    return y * jnp.where(jnp.any(b["boom"] > 0), jnp.inf, 1.0)

  p, s = z1.init(tx, params, mesh(n))
  step = z1.train_step(loss, tx, mesh(n))
  x = np.random.default_rng(2).normal(size=(8, D)).astype(np.float32)
  ok = {"x": x, "boom": np.zeros(8, np.float32)}
  boom = {"x": x, "boom": np.zeros(8, np.float32)}
  boom["boom"][2:4] = 1                          # device 1 only
  p, s, m = step(p, s, ok)
  assert not bool(m["skipped"])
  before = jax.tree.map(np.asarray, (p, s.inner))
  p, s, m = step(p, s, boom)
  assert bool(m["skipped"])
  for a, b in zip(jax.tree.leaves((p, s.inner)), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(a), b)
  p2, _, m = step(p, s, ok)
  assert not bool(m["skipped"])
  assert not np.array_equal(np.asarray(p2["l0"]["w"]), before[0]["l0"]["w"])
