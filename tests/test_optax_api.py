"""zero1 where optax's own tests go: complex params, Python scalar leaves,
float64 masters, fp16 in plain jit, wrappers around refused optimizers, and
optax's API (extra update arguments, updates in the param dtype).

Plain ``jax.jit`` under an 8-device mesh (tx.init / tx.update outside
shard_map, core/jit_mode.py), gradients handed whole, as optax's tests do.

Tolerance for "exactly as optax": zero1 runs the inner optimizer's
elementwise arithmetic on each device's shard of the same gradients (mode
REDUCED: no sum, the divisor is exactly 1.0), so only two XLA programs'
rounding differs (fusion of the same ops): at most ~1 ulp of the parameter
per step when the update is added back. We allow 2 ulps of max|param| per
step (ATOL_ULPS_PER_STEP), twice that.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from zero1_jax.core import elementwise as ew
from helpers import mesh

N = 8
STEPS = 3
ATOL_ULPS_PER_STEP = 2


def _complex_params():
  r = np.random.default_rng(0)
  c = lambda *s: jnp.asarray(r.normal(size=s) + 1j * r.normal(size=s),
                             jnp.complex64)
  return {"w": c(5, 3), "b": c(7), "s": c()}   # odd shapes, a scalar


def _grads(params, i):
  """A fixed, different gradient per step (complex where the param is)."""
  r = np.random.default_rng(100 + i)
  def g(p):
    x = r.normal(size=np.shape(p)) + 1j * r.normal(size=np.shape(p))
    return jnp.asarray(x if jnp.iscomplexobj(p) else x.real, jnp.result_type(p))
  return jax.tree.map(g, params)


def _run_both(opt, params, steps=STEPS, **zkw):
  """(zero1 params, optax params, zero1 updates of the last step) after
  ``steps`` updates on the same gradients, zero1 in plain jit at N=8."""
  tx = z1.zero1(opt, axis_name="data", **zkw)
  m = mesh(N)
  with jax.set_mesh(m):
    p = jax.device_put(params, NamedSharding(m, P()))
    s = tx.init(p)
    upd = jax.jit(tx.update)
    for i in range(steps):
      u, s = upd(_grads(params, i), s, p)
      p = optax.apply_updates(p, u)
  q, t = params, opt.init(params)
  for i in range(steps):
    v, t = opt.update(_grads(params, i), t, q)
    q = optax.apply_updates(q, v)
  return p, q, u


def _assert_as_optax(got, want, steps=STEPS):
  for k in want:
    g, w = np.asarray(got[k]), np.asarray(want[k])
    assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
    eps = np.finfo(w.dtype).eps
    atol = ATOL_ULPS_PER_STEP * steps * eps * max(np.max(np.abs(w)), 1.0)
    np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=k)


# --- complex parameters ------------------------------------------------------

@pytest.mark.parametrize("name, opt", [
    ("adam", lambda: optax.adam(0.1)),
    ("adamw", lambda: optax.adamw(0.1, weight_decay=0.1)),
    ("sgd_momentum", lambda: optax.sgd(0.1, momentum=0.9)),
    ("rmsprop", lambda: optax.rmsprop(0.1)),
])
def test_complex_params_train_as_optax(name, opt):
  """Real and imaginary parts are elementwise data: trained (they used to
  stay at their initial values, layout.py treating complex as static)."""
  params = _complex_params()
  got, want, u = _run_both(opt(), params)
  assert all(x.dtype == jnp.complex64 for x in jax.tree.leaves(u))
  moved = max(float(jnp.max(jnp.abs(want[k] - params[k]))) for k in params)
  assert moved > 0.1, moved
  _assert_as_optax(got, want)


def test_complex_master_dtype_is_complex():
  """The master is never narrower than the param: complex64 params are
  their own master (no copy), as float32 ones are; their moments complex."""
  from zero1_jax.core import layout as lay
  assert lay.master_dtype(jnp.complex64) == np.complex64
  assert lay.master_dtype(jnp.complex128) == np.complex128
  assert lay.master_dtype(jnp.bfloat16) == np.float32
  assert lay.master_dtype(jnp.float64) == np.float64
  tx = z1.zero1(optax.adam(0.1), axis_name="data")
  with jax.set_mesh(mesh(N)):
    s = tx.init(_complex_params())
  assert all(m is None for m in jax.tree.leaves(s.master,
                                                is_leaf=lambda x: x is None))
  assert s.inner[0].mu["w"].dtype == jnp.complex64


REFUSED_ON_REAL = {
    "novograd": lambda: optax.novograd(0.1),
    "lamb": lambda: optax.lamb(0.1),
    "lars": lambda: optax.lars(0.1),
    "fromage": lambda: optax.fromage(0.1),
    "lbfgs": lambda: optax.lbfgs(),
    "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                               optax.adam(0.1)),
    "adafactor": lambda: optax.adafactor(0.1),
}


@pytest.mark.parametrize("name", sorted(REFUSED_ON_REAL))
def test_refused_on_real_params_is_refused_on_complex_for_the_same_reason(name):
  """Every optimizer refused on real params is refused on complex ones (with
  complex leaves static, novograd was accepted and lbfgs said IndexError)."""
  shape = {"w": jnp.zeros((5, 16)), "b": jnp.zeros((16,))}
  real = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), shape)
  cplx = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.complex64), shape)
  whys = []
  for params in (real, cplx):
    with pytest.raises(ew.Refused) as e:
      ew.check_elementwise(REFUSED_ON_REAL[name](), params, N)
    whys.append(e.value.why)
  assert "IndexError" not in whys[1] and "None at the" not in whys[1], whys
  # The same reason, up to the dtype named in it.
  assert whys[1].replace("complex64", "float32") == whys[0], whys


@pytest.mark.parametrize("opt", [optax.adamw, optax.adamaxw, optax.nadamw])
def test_decoupled_weight_decay_on_complex_is_not_refused(opt):
  """adamw & co read params: they were refused on complex params with
  'requires the current value of parameters' (zero1 handed them None)."""
  params = {"w": jax.ShapeDtypeStruct((5, 16), jnp.complex64)}
  ew.check_elementwise(opt(0.1), params, N)


# --- wrappers around a refused optimizer --------------------------------------

@pytest.mark.parametrize("shape", [(2,), (3,), (8,), (8, 1), (16,)])
def test_multisteps_around_noisy_sgd_refused_at_any_shard_size(shape):
  """noisy_sgd draws its noise with the shard's shape: per device, not per
  element of the whole leaf. With one element per shard ((8,) at N=8) the
  draw has shape (1,) and was let through (then 3.4% off optax after 12
  steps); inside MultiSteps the 2-step probe never reaches the inner update."""
  inner = optax.noisy_sgd(0.1, key=0)
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  for opt in (inner, optax.MultiSteps(inner, 4)):
    with pytest.raises(ew.Refused, match="random numbers drawn with a shape"):
      ew.check_elementwise(opt, params, N)


def test_noisy_sgd_on_a_scalar_param_is_accepted_under_jit_init():
  """A scalar param draws a scalar: elementwise, accepted. Under
  jax.jit(tx.init) the probe compares the state's PRNG key bits; they used
  to be read from a tracer (TracerArrayConversionError)."""
  tx = z1.zero1(optax.noisy_sgd(0.1, key=0), axis_name="data")
  with jax.set_mesh(mesh(N)):
    s = jax.jit(tx.init)({"s": jnp.ones(())})
  assert jax.tree.leaves(s.inner)


# --- Python scalars, float64, fp16 -------------------------------------------

def test_python_scalar_leaves_as_optax():
  """A Python float leaf is a float32 scalar to optax (jnp.zeros_like(1.0));
  a Python int is an integer leaf, which no gradient reaches (zero update)."""
  params = {"w": jnp.arange(5.0), "f": 1.5}
  got, want, u = _run_both(optax.adam(0.1), params)
  assert u["f"].dtype == jnp.float32
  _assert_as_optax(got, want)
  tx = z1.zero1(optax.adam(0.1), axis_name="data")
  with jax.set_mesh(mesh(N)):
    p = {"w": jnp.arange(5.0), "i": 3}
    s = tx.init(p)
    u, _ = jax.jit(tx.update)({"w": jnp.ones(5), "i": jnp.zeros((), jnp.int32)},
                              s, p)
  assert u["i"].dtype == jnp.int32 and int(u["i"]) == 0


def test_float64_params_keep_a_float64_master():
  """Under jax_enable_x64, float64 params get a float64 master (a float32
  one rounded each update: 2.9e-7 relative from optax). Elementwise adam on
  the same gradients: 2 ulps of float64 per step (module docstring)."""
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np, optax, zero1_jax as z1
      assert jax.config.jax_enable_x64
      mesh = jax.make_mesh((8,), ("data",))
      r = np.random.default_rng(0)
      p0 = {"w": jnp.asarray(r.normal(size=(5, 3))), "b": jnp.asarray(r.normal(size=7))}
      assert p0["w"].dtype == jnp.float64
      g = [jax.tree.map(lambda x: jnp.asarray(r.normal(size=x.shape)), p0) for _ in range(3)]
      opt = optax.adam(0.1)
      tx = z1.zero1(opt, axis_name="data")
      with jax.set_mesh(mesh):
        p, s = p0, tx.init(p0)
        for gi in g:
          u, s = jax.jit(tx.update)(gi, s, p)
          p = optax.apply_updates(p, u)
      q, t = p0, opt.init(p0)
      for gi in g:
        v, t = opt.update(gi, t, q)
        q = optax.apply_updates(q, v)
      assert all(x is None for x in jax.tree.leaves(s.master, is_leaf=lambda x: x is None))
      assert s.inner[0].mu["w"].dtype == jnp.float64, s.inner[0].mu["w"].dtype
      err = max(float(jnp.max(jnp.abs(p[k] - q[k]))) for k in q)
      scale = max(float(jnp.max(jnp.abs(q[k]))) for k in q)
      print("ERR", err, scale)
      assert err <= 2 * 3 * np.finfo(np.float64).eps * max(scale, 1.0), err
  """)
  env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout + out.stderr[-3000:]


def test_fp16_params_in_plain_jit_need_an_explicit_loss_scale():
  """Without loss_scale=, fp16 params defaulted to a dynamic scale that only
  z1.train_step multiplies into the loss: plain-jit updates were the
  gradients / 65536 (sgd gave [0, 0, 0]). Now tx.init says to choose."""
  p = {"w": jnp.asarray([1.0, 2.0, -1.0], jnp.float16)}
  with jax.set_mesh(mesh(N)):
    with pytest.raises(ValueError, match=r"z1\.loss_scale\(opt_state\).*"
                       r"z1\.NoLossScale\(\)"):
      z1.zero1(optax.sgd(0.1), axis_name="data").init(p)
    tx = z1.zero1(optax.sgd(0.1), axis_name="data",
                  loss_scale=z1.NoLossScale())
    s = tx.init(p)
    g = {"w": jnp.asarray([2.0, 4.0, -2.0], jnp.float16)}
    u, _ = jax.jit(tx.update)(g, s, p)
  assert u["w"].dtype == jnp.float16
  # optax: -0.1 * g, from the fp32 master cast to fp16.
  want = (np.float32([1, 2, -1]) - np.float32(0.1) * np.float32([2, 4, -2]))
  np.testing.assert_array_equal(
      np.asarray(optax.apply_updates(p, u)["w"]), want.astype(np.float16))


# --- optax's API ---------------------------------------------------------------

def _scale_by_kwarg():
  """An elementwise inner transformation that takes an extra update
  argument (as optax.GradientTransformationExtraArgs ones do)."""
  def update(u, s, params=None, *, factor=1.0, **extra):
    del params, extra
    return jax.tree.map(lambda x: x * factor, u), s
  return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(),
                                               update)


def test_extra_update_arguments_are_forwarded():
  tx = z1.zero1(optax.chain(_scale_by_kwarg(), optax.sgd(1.0)),
                axis_name="data")
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  p = {"w": jnp.arange(16.0)}
  g = {"w": jnp.ones(16)}
  with jax.set_mesh(mesh(N)):
    s = tx.init(p)
    u_eager, _ = tx.update(g, s, p, factor=3.0)
    u_jit, _ = jax.jit(lambda g, s, p, f: tx.update(g, s, p, factor=f))(
        g, s, p, jnp.float32(0.5))
    # adam takes no extra arguments: they are dropped, as optax.chain does.
    adam = z1.zero1(optax.adam(0.1), axis_name="data")
    u_adam, _ = adam.update(g, adam.init(p), p, value=jnp.float32(1.0))
  np.testing.assert_array_equal(np.asarray(u_eager["w"]), -3.0)
  np.testing.assert_array_equal(np.asarray(u_jit["w"]), -0.5)
  # Applied back: optax's step, up to the two programs' rounding (module
  # docstring; eager optax and zero1's program differ by 1 ulp at w=1).
  a = optax.adam(0.1)
  want = optax.apply_updates(p, a.update(g, a.init(p), p)[0])
  _assert_as_optax(optax.apply_updates(p, u_adam), want, steps=1)


def test_updates_come_in_the_param_dtype_and_fit_lax_cond():
  """bf16 params get bf16 updates, as optax returns them, so a user's
  lax.cond between the update and zeros_like(params) traces."""
  tx = z1.zero1(optax.sgd(0.25), axis_name="data")
  p = {"w": jnp.asarray([1.0, 2.0, -1.0, 0.5], jnp.bfloat16)}
  g = {"w": jnp.asarray([1.0, 1.0, 1.0, 1.0], jnp.bfloat16)}
  with jax.set_mesh(mesh(N)):
    s = tx.init(p)

    @jax.jit
    def step(p, s, go):
      u, s2 = tx.update(g, s, p)
      return jax.lax.cond(go, lambda: u, lambda: jax.tree.map(jnp.zeros_like, p))

    u = step(p, s, True)
  assert u["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(u["w"], np.float32), -0.25)


def test_update_without_params_eagerly_is_the_update_with_them():
  """optax's update(grads, state), called eagerly: the same updates and
  state as with params, to the bit (tests/test_params_free.py has the jit
  programs and the refusals)."""
  tx = z1.zero1(optax.adam(0.1), axis_name="data")
  g = {"w": jnp.linspace(-1.0, 1.0, 16)}
  with jax.set_mesh(mesh(N)):
    s = tx.init({"w": jnp.ones(16)})
    got = tx.update(g, s)
    want = tx.update(g, s, {"w": jnp.ones(16)})
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_complex_params_train_in_train_step():
  """z1.train_step differentiates complex params too (it used to hand zero
  gradients for every non-float leaf). sgd on a complex least squares at
  N=8 against optax on the global batch. The two sum the batch's B=16
  gradient terms t_b = 2 r_b x_b / B in other orders: per step at most
  (B-1) eps max|t_b| apart (a sum's worst-case reordering bound; residuals
  r bounded by 2x the initial ones), times lr; a difference in the params
  then grows by at most (1 + lr ||H||) per step, ||H|| = 2 ||X||_2^2 / B.
  Plus 4 ulps of max|w| per step for the two programs' update rounding."""
  r = np.random.default_rng(3)
  c = lambda *s: (r.normal(size=s) + 1j * r.normal(size=s)).astype(np.complex64)
  params = {"w": jnp.asarray(c(5, 3))}
  b = {"x": c(16, 5), "y": c(16, 3)}
  loss = lambda p, b: jnp.mean(jnp.abs(b["x"] @ p["w"] - b["y"]) ** 2)
  opt = optax.sgd(0.1)
  tx = z1.zero1(opt, axis_name="data")
  p, s = z1.init(tx, params, mesh(N))
  step = z1.train_step(loss, tx, mesh(N))
  q, t = params, opt.init(params)
  for _ in range(STEPS):
    p, s, _ = step(p, s, b)
    v, t = opt.update(jax.grad(loss)(q, b), t, q)
    q = optax.apply_updates(q, v)
  assert float(jnp.max(jnp.abs(q["w"] - params["w"]))) > 0.1
  eps, lr, bsz = np.finfo(np.float32).eps, 0.1, 16
  res = 2 * np.abs(b["x"] @ np.asarray(params["w"]) - b["y"]).max()
  term = 2 * res * np.abs(b["x"]).max() / bsz
  grow = (1 + lr * 2 * np.linalg.norm(b["x"], 2) ** 2 / bsz) ** STEPS
  atol = (STEPS * lr * (bsz - 1) * eps * term * grow
          + 4 * STEPS * eps * float(jnp.max(jnp.abs(q["w"]))))
  np.testing.assert_allclose(np.asarray(p["w"]), np.asarray(q["w"]), rtol=0,
                             atol=atol)
