"""Shared pieces for the tests: a tiny model with awkward leaves, batches,
meshes, and the two references (unsharded optax, plain data parallel)."""

from __future__ import annotations

import copy
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

IN, OUT = 5, 3

# The seed tutorial's DeepSpeed config, verbatim.
SEED_CONFIG = {
    "train_batch_size": 32, "gradient_accumulation_steps": 1,
    "fp16": {"enabled": True},
    "zero_optimization": {"stage": 1, "allgather_partitions": True,
                          "allgather_bucket_size": 5e8, "overlap_comm": True,
                          "contiguous_gradients": True, "reduce_scatter": False},
    "optimizer": {"type": "Adam", "params": {"lr": 2e-5, "betas": [0.9, 0.999],
                                             "eps": 1e-8, "weight_decay": 0.01}},
}


@functools.lru_cache(maxsize=None)
def mesh(n: int, axis: str = "data"):
  return jax.make_mesh((n,), (axis,), devices=jax.devices()[:n])


def odd_params(dtype=jnp.float32, seed=0):
  """Odd shapes (no dim divisible by 2, 4 or 8), a scalar, a zero-size leaf
  and an integer leaf."""
  r = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(r.normal(size=s) * 0.5, dtype)
  return {
      "dense": {"kernel": f(IN, 7), "bias": f(7)},
      "out": {"kernel": f(7, OUT), "bias": f(OUT)},
      "gain": jnp.asarray(1.25, dtype),            # scalar
      "empty": jnp.zeros((0, 3), dtype),           # zero-size
      "step_id": jnp.arange(3, dtype=jnp.int32),   # integer: untouched
  }


def float_part(params):
  return {k: v for k, v in params.items() if k not in ("empty", "step_id")}


def loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params["dense"]["kernel"] + params["dense"]["bias"])
  y = (h @ params["out"]["kernel"] + params["out"]["bias"]) * params["gain"]
  err = (y.astype(jnp.float32) - batch["y"])
  if "empty" in params:   # touch the zero-size leaf so it is a real input
    err = err + jnp.sum(params["empty"]).astype(jnp.float32)
  return jnp.mean(jnp.square(err))


def exact_loss(params, b):
  """Linear in params: d/dp = batch mean of b['c'] (dyadic: exact sums)."""
  total = jnp.float32(0)
  for i, leaf in enumerate(jax.tree.leaves(float_part(params))):
    coef = b["c"].mean(0)[i * 8: i * 8 + 8]
    total = total + jnp.sum(leaf * jnp.resize(coef, leaf.shape))
  return total


def exact_batches(steps: int, size: int = 16, seed: int = 0):
  """Batches for exact_loss: multiples of 1/8 in [-1, 1). Every mean over a
  power-of-two number of rows, scaled by a power of two up to 2^10, is exact
  in fp16, so gradients are bitwise equal in any summation order (and loss
  scaling divides out exactly)."""
  r = np.random.default_rng(seed)
  return [{"c": (r.integers(-8, 8, size=(size, 64)) / 8).astype(np.float32)}
          for _ in range(steps)]


def batch(size: int, seed: int = 1, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  return {"x": np.asarray(r.normal(size=(size, IN)), dtype),
          "y": np.asarray(r.normal(size=(size, OUT)), np.float32)}


def optax_run(tx, params, batches, steps=None, loss=None, return_state=False):
  """Unsharded optax on the global batch; float leaves only. The params, or
  ``(params, state)`` with ``return_state``."""
  p = float_part(params)
  s = tx.init(p)
  loss = loss or loss_fn

  @jax.jit
  def one(p, s, b):
    g = jax.grad(loss)(p, b)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for b in batches:
    p, s = one(p, s, b)
  return (p, s) if return_state else p


def master_run(tx, params, batches, return_master=False, loss=None):
  """Unsharded optax on an fp32 master copy of low-precision params: the
  forward uses the master cast to the param dtype (mixed precision). Returns
  the params (the master cast), or with ``return_master`` the fp32 master."""
  dtypes = jax.tree.map(lambda x: x.dtype, float_part(params))
  m = jax.tree.map(lambda x: x.astype(jnp.float32), float_part(params))
  s = tx.init(m)
  loss = loss or loss_fn

  @jax.jit
  def one(m, s, b):
    low = jax.tree.map(lambda x, d: x.astype(d), m, dtypes)
    g = jax.grad(loss)(low, b)
    g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
    u, s = tx.update(g, s, m)
    return optax.apply_updates(m, u), s

  for b in batches:
    m, s = one(m, s, b)
  if return_master:
    return m
  return jax.tree.map(lambda x, d: x.astype(d), m, dtypes)


def stored_master(params, state):
  """zero1's fp32 master weights (numpy, float leaves): each stored master
  leaf cut to its parameter's shape, the parameter itself where it is its
  own master (fp32 params store none)."""
  return jax.tree.map(
      lambda p, m: np.asarray(p) if m is None
      else np.asarray(m)[tuple(map(slice, p.shape))],
      float_part(params), float_part(state.master))


def ddp_run(tx, params, batches, n):
  """Plain data parallel: replicated optax state, pmean'd gradients."""
  msh = mesh(n)
  p = jax.device_put(float_part(params), NamedSharding(msh, P()))
  s = jax.jit(tx.init, out_shardings=NamedSharding(msh, P()))(p)

  def per_device(p, s, b):
    local = jax.lax.pcast(p, "data", to="varying")
    g = jax.lax.pmean(jax.grad(loss_fn)(local, b), "data")
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(jax.shard_map(per_device, mesh=msh,
                               in_specs=(P(), P(), P("data")),
                               out_specs=(P(), P())))
  for b in batches:
    b = jax.device_put(b, NamedSharding(msh, P("data")))
    p, s = step(p, s, b)
  return p


def optax_and_zero1_steps(make, loss, params, steps: int = 3, n: int = 8):
  """``(zero1's params, optax's)`` after ``steps`` full-gradient steps of
  ``make()``'s optimizer on ``loss(params)``: optax unsharded, and zero1
  (``z1.zero1(make())``) in plain jit on ``n`` devices."""
  import zero1_jax as z1
  want, s = params, make().init(params)
  for _ in range(steps):
    u, s = make().update(jax.grad(loss)(want), s, want)
    want = optax.apply_updates(want, u)
  tx = z1.zero1(make(), axis_name="data")
  with jax.set_mesh(mesh(n)):
    got, st = params, tx.init(params)
    step = jax.jit(lambda p, s: tx.update(jax.grad(loss)(p), s, p))
    for _ in range(steps):
      u, st = step(got, st)
      got = optax.apply_updates(got, u)
  return got, want


def deepspeed_clip(c: float) -> optax.GradientTransformation:
  """DeepSpeed ZeRO-1/2's clip (runtime/zero/stage_1_and_2.py), unsharded."""
  def update(g, state, params=None):
    del params
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g)))
    coef = jnp.maximum(1.0, (norm + 1e-6) / c)
    return jax.tree.map(lambda x: x / coef, g), state
  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def assert_same_structure(got, want, what=""):
  """The two trees have the same structure (a missing or extra leaf fails)."""
  gs, ws = jax.tree.structure(got), jax.tree.structure(want)
  assert gs == ws, f"{what}tree structures differ:\n  got  {gs}\n  want {ws}"


def _pairs(got, want, what):
  assert_same_structure(got, want, what)
  return zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want))


def rel_err(got, want, what=""):
  """max over leaves of max|got - want| / max|want| (floor 1e-3): the number
  assert_close bounds. Structures must match."""
  out = 0.0
  for (_, g), w in _pairs(got, want, what):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert g.shape == w.shape, (what, g.shape, w.shape)
    scale = max(np.max(np.abs(w), initial=0.0), 1e-3)
    out = max(out, np.max(np.abs(g - w), initial=0.0) / scale)
  return out


def _log_measured(what, rtol, err):
  """ZERO1_TOL_LOG=<file>: append each bound and the error it saw (how the
  measured numbers beside the tolerances in the tests were taken)."""
  path = os.environ.get("ZERO1_TOL_LOG")
  if path:
    with open(path, "a") as f:
      f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\t"
              f"{what}\t{rtol:g}\t{err:.3g}\n")


def assert_close(got, want, rtol, what=""):
  """Same structure, and per leaf: max |got - want| <= rtol * max|want|
  (floor 1e-3)."""
  rows = []
  for (path, g), w in _pairs(got, want, what):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    where = f"{what}{jax.tree_util.keystr(path)}"
    assert g.shape == w.shape, f"{where}: shape {g.shape} != {w.shape}"
    scale = max(np.max(np.abs(w), initial=0.0), 1e-3)
    rows.append((where, np.max(np.abs(g - w), initial=0.0), scale))
  _log_measured(what, rtol, max((e / s for _, e, s in rows), default=0.0))
  for where, err, scale in rows:
    assert err <= rtol * scale, (
        f"{where}: max error {err:.3g} > {rtol:g} x {scale:.3g}")


def assert_equal(got, want, what=""):
  """Same structure, and every leaf bitwise equal (shape and values)."""
  for (path, g), w in _pairs(got, want, what):
    g, w = np.asarray(g), np.asarray(w)
    where = f"{what}{jax.tree_util.keystr(path)}"
    assert g.shape == w.shape, f"{where}: shape {g.shape} != {w.shape}"
    np.testing.assert_array_equal(g, w, err_msg=where)


def ulps(got, want, what=""):
  """Largest per-element distance between two low-precision trees in units
  in the last place of ``want``'s dtype (ulp taken at the larger magnitude
  of the two elements). Structures must match."""
  worst = 0.0
  for (path, g), w in _pairs(got, want, what):
    nmant = jnp.finfo(w.dtype).nmant
    tiny = float(jnp.finfo(w.dtype).smallest_normal)
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert g.shape == w.shape, f"{what}{jax.tree_util.keystr(path)}: shape"
    mag = np.maximum(np.maximum(np.abs(g), np.abs(w)), tiny)
    ulp = np.exp2(np.floor(np.log2(mag)) - nmant)
    worst = max(worst, float(np.max(np.abs(g - w) / ulp, initial=0.0)))
  return worst


def assert_ulps(got, want, max_ulps, what=""):
  """Every element of ``got`` within ``max_ulps`` ulps of ``want``."""
  err = ulps(got, want, what)
  _log_measured(what + "(ulps)", max_ulps, err)
  assert err <= max_ulps, f"{what}{err:g} ulps > {max_ulps:g}"


@pytest.fixture(autouse=True)
def fresh_ds_notes():
  """DeepSpeed config info lines are logged once per process; each test
  starts afresh (import this into a test module to use it)."""
  from zero1_jax.deepspeed import config as _config
  _config._NOTED.clear()


def load(d, ws=1, **over):
  """``load_config`` of a copy of ``d`` with top-level keys ``over`` replaced."""
  from zero1_jax.deepspeed.config import load_config
  return load_config({**copy.deepcopy(d), **over}, world_size=ws)


def config_error(d, *needles, ws=1) -> str:
  """The ConfigError ``load(d, ws)`` raises; each of ``needles`` is in it."""
  from zero1_jax.deepspeed.schema import ConfigError
  with pytest.raises(ConfigError) as e:
    load(d, ws)
  for n in needles:
    assert n in str(e.value), (n, str(e.value))
  return str(e.value)


def train_cli(tmp_path, config: dict, *extra, num_devices: int = 2,
              max_steps: int = 2) -> int:
  """``zero1-train`` in this process on ``config`` (written to
  tmp_path/ds.json): bert-tiny, 16 tokens, no progress bar, output in
  tmp_path/out. Returns its exit status."""
  import json
  from zero1_jax.cli import train
  path = tmp_path / "ds.json"
  path.write_text(json.dumps(config))
  return train.main(["--deepspeed", str(path), "--num_devices", str(num_devices),
                     "--model_name_or_path", "bert-tiny", "--seq_len", "16",
                     "--max_steps", str(max_steps), "--no_progress",
                     "--output_dir", str(tmp_path / "out"), *extra])


# The GPU program's optimization barriers order zero1's collectives (a
# reduce-scatter chain, gathers after their group). jax 0.10.2's compiled
# text keeps them; jax 0.12's XLA schedules by them and then removes them
# (its remat pipeline's cse_barrier_expander), so the order is read from its
# dump of the module just before that pass: the same scheduled program.
BARRIER_DUMP = {"xla_dump_hlo_pass_re": "cse_barrier_expander"}


def text_with_barriers(compiled, dump_dir: str) -> str:
  """``compiled``'s optimized HLO text with its optimization barriers; on
  jax 0.11+ read from ``dump_dir``, where it was compiled with
  :data:`BARRIER_DUMP` among its options."""
  import glob
  if jax.__version_info__ < (0, 11):
    return compiled.as_text()
  found = glob.glob(os.path.join(dump_dir, "*before_cse_barrier_expander.txt"))
  assert len(found) == 1, (dump_dir, found)
  with open(found[0]) as f:
    return f.read()


def gpu_program_with_barriers(lowered, options: dict | None = None) -> str:
  """``lowered`` compiled for GPUs (zero1_jax.inspect.gpu): its optimized
  HLO text with its optimization barriers (:func:`text_with_barriers`)."""
  import tempfile
  from zero1_jax.inspect import gpu
  with tempfile.TemporaryDirectory(prefix="zero1_barriers_") as d:
    c, _ = gpu.compile(lowered, {**(options or {}), **BARRIER_DUMP}, dump_to=d)
    return text_with_barriers(c, d)


def starts(instrs, kind: str) -> list[int]:
  """Indices of ``kind``'s collectives (sync, ``-start``, or jax 0.12's
  ``async-start`` naming it) among a computation's instructions."""
  return [k for k, i in enumerate(instrs)
          if i.opcode in (kind, f"{kind}-start")
          or (i.opcode == "async-start" and kind in i.attrs)]
