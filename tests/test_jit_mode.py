"""The same zero1 tx in plain jax.jit code under a mesh (core/jit_mode.py):
flax TrainState, nnx.Optimizer, optax, and reduced-typed params.

Tolerances: the runs differ from unsharded optax / z1.train_step only in the
order the fp32 gradient is summed (XLA's all-reduce or reduce-scatter tree vs
one device's sum vs per-device means then psum): about 1e-7 relative per
step. Adam divides by sqrt(v), so a relative gradient error stays a relative
update error; after 4 steps the measured errors are <= 1e-7 (ZERO1_TOL_LOG=<file>
prints them: 2.5e-8 for the TrainState runs, 9.9e-8 for nnx), so 1e-6 (ten
times tighter than the issue's 1e-5) holds with 10x margin on jax 0.10 and
0.12.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from helpers import (assert_close, assert_equal, float_part, loss_fn, mesh,
                     odd_params, optax_run, stored_master)

RTOL = 1e-6
STEPS = 4


def batches(n=STEPS, size=16):
  r = np.random.default_rng(3)
  return [{"x": r.normal(size=(size, 5)).astype(np.float32),
           "y": r.normal(size=(size, 3)).astype(np.float32)}
          for _ in range(n)]


def loss(params, x, y):   # the signature
  return loss_fn(params, {"x": x, "y": y})


def like(v, h):
  """``v`` broadcast to ``h``'s shape and sharding: how a reduced-typed bias
  or scale meets activations sharded over "data" (a plain ``h + b`` is a
  ShardingTypeError in JAX for reduced ``b``)."""
  dims = tuple(range(h.ndim - v.ndim, h.ndim))
  return jax.lax.broadcast_in_dim(v, h.shape, dims,
                                  out_sharding=jax.typeof(h).sharding)


def reduced_loss(params, x, y):
  """loss_fn's model, written so reduced-typed params are accepted."""
  h = x @ params["dense"]["kernel"]
  h = jnp.tanh(h + like(params["dense"]["bias"], h))
  o = h @ params["out"]["kernel"]
  o = (o + like(params["out"]["bias"], o)) * like(params["gain"], o)
  return jnp.mean(jnp.square(o - y))


def adamw():
  return optax.adamw(1e-2)


def sgdm():   # not scale-invariant like Adam: a gradient off by N shows
  return optax.sgd(0.05, momentum=0.9)


def train_state_loop(n, params, loss_f=loss, place=None, dtype_batches=None,
                     check=True, opt=adamw):
  """The issue's loop, verbatim apart from the data placement. Returns the
  final state, the compiled step's collectives and its lowered StableHLO."""
  m = mesh(n)
  # check=False skips the elementwise proof (5 s; tested in test_elementwise).
  tx = z1.zero1(opt(), axis_name="data", check_elementwise=check)
  with jax.set_mesh(m):
    if place is not None:
      params = place(params, m)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

    @jax.jit
    def step(state, x, y):
      return state.apply_gradients(grads=jax.grad(loss_f)(state.params, x, y))

    data = NamedSharding(m, P("data"))
    compiled = lowered = None
    for b in dtype_batches or batches():
      x, y = jax.device_put((b["x"], b["y"]), data)
      if compiled is None:   # compile once, read its HLO
        lowered = step.lower(state, x, y)
        compiled = lowered.compile()
      state = compiled(state, x, y)
  return state, z1.inspect.collectives(compiled), lowered.as_text()


@pytest.fixture(scope="module")
def plain4():
  return train_state_loop(4, float_part(odd_params()))


@pytest.fixture(scope="module")
def reduced4():
  return train_state_loop(4, float_part(odd_params()), reduced_loss,
                          lambda p, m: z1.reduced_params(p, m), check=False,
                          opt=sgdm)


def reference(opt=adamw, loss_f=None):
  return optax_run(opt(), odd_params(), batches(), loss=loss_f)


def test_train_state_loop_matches_optax_and_train_step(plain4):
  state, _, _ = plain4
  assert_close(state.params, reference(), RTOL, "vs optax ")
  tx = z1.zero1(optax.adamw(1e-2), axis_name="data", check_elementwise=False)
  params, opt_state = z1.init(tx, float_part(odd_params()), mesh(4))
  step = z1.train_step(loss_fn, tx, mesh(4))
  for b in batches():
    params, opt_state, _ = step(params, opt_state, b)
  assert_close(state.params, params, RTOL, "vs train_step ")
  assert int(state.step) == STEPS


def test_state_has_the_layout_and_bytes_of_z1_init(plain4):
  state, _, _ = plain4
  params = float_part(odd_params())
  want = z1.state_shardings(state.tx, params, mesh(4))
  got = jax.tree.map(lambda a: a.sharding, state.opt_state)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.spec == w.spec, (g.spec, w.spec)
  _, ref_state = z1.init(state.tx, params, mesh(4))
  assert z1.inspect.device_bytes(state.opt_state) == \
      z1.inspect.device_bytes(ref_state)
  # fp32 params are their own master: Adam's mu + nu only, 8 bytes / N.
  layout = z1.plan(params, 4)
  sharded = sum(l.shard_size for l in layout.leaves if l.kind == "shard")
  mu = state.opt_state.inner[0].mu
  assert sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(mu)
             if x.ndim) == sharded
  assert all(m is None for m in jax.tree.leaves(
      state.opt_state.master, is_leaf=lambda x: x is None))


def test_plain_params_cost_a_full_all_reduce(plain4):
  """What the README states: jit reduces the gradient before the update sees
  it (XLA:CPU: one full-size all-reduce), then each device slices its shard;
  the all-gather moves the params."""
  _, hlo, _ = plain4
  grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(float_part(odd_params())))
  assert hlo["all-reduce"].bytes >= grad_bytes
  assert "reduce-scatter" not in hlo
  assert hlo["all-gather"].count == 1


@pytest.mark.parametrize("n", [8])
def test_train_state_loop_at_n8(n):
  state, _, _ = train_state_loop(n, float_part(odd_params()), check=False,
                                 opt=sgdm)
  assert_close(state.params, reference(sgdm), RTOL, f"N={n} ")


def test_reduced_params_one_reduce_scatter_no_all_reduce(reduced4, plain4):
  state, hlo, _ = reduced4
  want = reference(sgdm, lambda p, b: reduced_loss(p, b["x"], b["y"]))
  assert_close(state.params, want, RTOL, "reduced vs optax ")
  assert hlo["reduce-scatter"].count == 1     # one bucket
  # Only scalars are all-reduced: the scalar leaf's gradient and the norm.
  assert hlo.get("all-reduce", z1.inspect.Collective(0, 0, 0)).bytes <= 8
  assert hlo["all-gather"] == plain4[1]["all-gather"]
  for p in jax.tree.leaves(state.params):   # still reduced after the updates
    assert jax.typeof(p).sharding.spec.reduced == {"data"}, jax.typeof(p)
  # The README's way back to plain params for use outside the step (eval,
  # metrics): reshard to P(), the values unchanged (no N x sum), and a
  # reduced leaf plus a plain array, refused before, now works.
  with jax.set_mesh(mesh(4)):
    plain = jax.sharding.reshard(state.params, P())
    for p, q in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain)):
      assert not jax.typeof(q).sharding.spec.reduced, jax.typeof(q)
      np.testing.assert_array_equal(np.asarray(q), np.asarray(p))
      if jnp.issubdtype(q.dtype, jnp.floating):
        np.testing.assert_array_equal(np.asarray(q + jnp.ones(q.shape, q.dtype)),
                                      np.asarray(p) + 1)


def test_bf16_params_are_the_master_cast_and_gather_bf16():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                        float_part(odd_params()))
  state, _, lowered = train_state_loop(4, params, dtype_batches=batches(2),
                                     check=False)
  assert_equal(state.params, jax.tree.map(
      lambda m, p: m.astype(p.dtype), stored_master(state.params,
                                                    state.opt_state),
      state.params))
  layout = z1.plan(params, 4)
  padded = sum(np.prod(l.padded_shape) for l in layout.leaves if l.kind == "shard")
  # The program gathers bf16 (XLA:CPU then widens every bf16 collective to
  # f32 in its own passes, z1.train_step's too; GPU backends keep bf16).
  gathers = re.findall(r'"stablehlo.all_gather".*-> tensor<(\d+)x(\w+)>', lowered)
  assert {t for _, t in gathers} == {"bf16"}, gathers
  assert sum(int(k) for k, _ in gathers) == padded
  # bf16 params keep an fp32 master: 12 bytes / N with Adam.
  ref = z1.init(state.tx, params, mesh(4))[1]
  assert z1.inspect.device_bytes(state.opt_state) == z1.inspect.device_bytes(ref)


class Mlp(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(5, 7, rngs=rngs)
    self.l2 = nnx.Linear(7, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def nnx_train(tx, m=None):
  model = Mlp(nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x, y):
    grads = nnx.grad(lambda md: jnp.mean((md(x) - y) ** 2))(model)
    opt.update(model, grads)

  for b in batches():
    x, y = b["x"], b["y"]
    if m is not None:
      x, y = jax.device_put((x, y), NamedSharding(m, P("data")))
    step(model, opt, x, y)
  return model, opt


def test_nnx_optimizer_unchanged():
  m = mesh(4)
  with jax.set_mesh(m):
    model, opt = nnx_train(z1.zero1(optax.adam(1e-2), axis_name="data"), m)
  ref, _ = nnx_train(optax.adam(1e-2))
  got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert_close(got, nnx.to_pure_dict(nnx.state(ref, nnx.Param)), RTOL, "nnx ")
  mu = nnx.to_pure_dict(nnx.as_pure(opt.opt_state).inner[0].mu)
  assert mu["l1"]["kernel"].sharding.spec == P(None, "data")
  assert mu["l1"]["kernel"].addressable_shards[0].data.shape == (5, 2)


def test_no_mesh_names_the_fix():
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  with pytest.raises(ValueError, match=r"jax\.set_mesh.*|shard_map") as e:
    tx.init({"w": jnp.ones(3)})
  assert "jax.set_mesh" in str(e.value) and "shard_map" in str(e.value)
  with jax.set_mesh(jax.make_mesh((1,), ("batch",))):
    with pytest.raises(ValueError, match=r"axes \('batch',\), not 'data'"):
      tx.init({"w": jnp.ones(3)})


def test_mesh_from_the_arrays_without_set_mesh():
  m = mesh(4)
  tx = z1.zero1(optax.sgd(0.5), axis_name="data")
  params = jax.device_put({"w": jnp.arange(6.0)}, NamedSharding(m, P()))
  state = tx.init(params)
  grads = jax.device_put({"w": jnp.ones(6)}, NamedSharding(m, P()))
  updates, _ = jax.jit(tx.update)(grads, state, params)
  np.testing.assert_array_equal(updates["w"], -0.5 * np.ones(6))
  # the state's mesh when nothing else has one: a TrainState created under
  # jax.set_mesh, its step jitted outside it (was "no mesh was found ... no
  # argument has a NamedSharding", though the state has one)
  with jax.set_mesh(m):
    state = tx.init({"w": jnp.arange(6.0)})
  updates, _ = jax.jit(tx.update)({"w": jnp.ones(6)}, state, {"w": jnp.arange(6.0)})
  np.testing.assert_array_equal(updates["w"], -0.5 * np.ones(6))


def test_mixed_reduced_and_plain_params_are_refused():
  m = mesh(4)
  tx = z1.zero1(optax.sgd(0.5), axis_name="data")
  with jax.set_mesh(m):
    params = {"a": z1.reduced_params(jnp.ones((4, 2)), m), "b": jnp.ones((4, 2))}
    state = tx.init(params)
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(m, P("data")))
    f = lambda p: jnp.sum(x @ p["a"]) + jnp.sum(x @ p["b"])
    with pytest.raises(ValueError, match="z1.reduced_params"):
      jax.jit(lambda p, s: tx.update(jax.grad(f)(p), s, p))(params, state)


def test_fp16_loss_scale_and_overflow_skip_under_jit():
  """fp16 params in plain jit: multiply the loss by z1.loss_scale(state); the
  update divides it out, skips an overflowing step everywhere and halves
  the scale. Dyadic gradients (helpers.exact_loss) are exact in fp16 at any
  scale and summation order, so the master must be bitwise the fp32 master
  reference that never sees the overflowing batch; SGD shows a scale left in
  the gradients as a factor >= 128. The updates are fp16, as optax returns
  them for fp16 params: bitwise the master's fp16 cast minus the params,
  rounded to fp16 (exact, and apply_updates then gives the cast master,
  wherever a step at most doubles or halves a weight; elsewhere it is
  rounded once, and the next step starts from the master again)."""
  from helpers import exact_batches, exact_loss, master_run
  params = float_part(odd_params(jnp.float16))
  bs = exact_batches(5)
  tx = z1.zero1(optax.sgd(0.1, momentum=0.9), axis_name="data",
                loss_scale=z1.DynamicLossScale(initial_scale_power=8,
                                               loss_scale_window=2,
                                               hysteresis=1))
  with jax.set_mesh(mesh(4)):
    p = jax.device_put(params, NamedSharding(mesh(4), P()))
    s = tx.init(p)

    @jax.jit
    def step(p, s, b, boom):
      def scaled(p):
        out = exact_loss(p, b) * z1.loss_scale(s).astype(jnp.float32)
        return out * jnp.where(boom, jnp.inf, 1.0)
      u, s = tx.update(jax.grad(scaled)(p), s, p)
      return optax.apply_updates(p, u), s, u

    scales = []
    for i, b in enumerate(bs):
      scales.append(float(z1.loss_scale(s)))
      old = p
      p, s, u = step(p, s, jax.device_put(b, NamedSharding(mesh(4), P("data"))),
                     i == 2)
      cast = jax.tree.map(lambda m, q: np.asarray(m).astype(np.float16),
                          stored_master(p, s), old)
      assert all(x.dtype == jnp.float16 for x in jax.tree.leaves(u))
      assert_equal(u, jax.tree.map(
          lambda c, q: (c.astype(np.float32) - np.asarray(q, np.float32))
          .astype(np.float16), cast, old), f"updates {i} ")
  assert scales == [256.0, 256.0, 256.0, 128.0, 128.0]
  clean = [b for i, b in enumerate(bs) if i != 2]
  run = lambda **kw: master_run(optax.sgd(0.1, momentum=0.9), params, clean,
                                loss=exact_loss, **kw)
  assert_equal(stored_master(p, s), run(return_master=True), "master ")


def test_params_committed_to_one_device_name_the_fix():
  """Params on one device (not the mesh): init works but warns, and an eager
  update says how to place them, instead of jit's device mismatch."""
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  p = jax.device_put({"w": jnp.ones((5, 3))}, jax.devices()[0])
  with jax.set_mesh(mesh(4)):
    with pytest.warns(UserWarning, match=r"params\['w'\] \(devices \[0\]\)"):
      s = tx.init(p)
    with pytest.raises(ValueError, match=r"jax.device_put\(params, "
                       r"NamedSharding\(mesh, P\(\)\)\)"):
      tx.update({"w": jnp.ones((5, 3))}, s, p)
    placed = jax.device_put(p, NamedSharding(mesh(4), P()))
    u, _ = tx.update(jax.device_put({"w": jnp.ones((5, 3))},
                                    NamedSharding(mesh(4), P())), s, placed)
  # Adam's first step is -lr; the update is new - old in fp32 (1 - 0.99).
  np.testing.assert_allclose(np.asarray(u["w"]), -1e-2, atol=1e-7)


def test_init_traced_under_jit_equals_eager():
  """jax.jit(TrainState.create)-style code traces tx.init: the elementwise
  probe still runs on concrete numbers, and the state equals eager init."""
  tx = z1.zero1(optax.adamw(1e-2), axis_name="data")
  with jax.set_mesh(mesh(4)):
    params = jax.device_put(float_part(odd_params()), NamedSharding(mesh(4), P()))
    traced = jax.jit(tx.init)(params)
    eager = tx.init(params)
    assert_equal(traced, eager)
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(eager)):
      assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    with pytest.raises(ValueError, match="not elementwise"):
      jax.jit(z1.zero1(optax.lamb(1e-2), axis_name="data").init)(params)


@pytest.mark.parametrize("inner", [optax.adamw(1e-2), optax.sgd(1e-2)])
def test_init_traced_under_jit_without_set_mesh_equals_eager(inner):
  """jax.jit(tx.init) on params placed on a mesh, with no jax.set_mesh (a
  JAX-tutorial init): tx.init sees the arguments' abstract mesh, and its
  state (which reads the params' shapes, not their values) comes out as
  eager init makes it. (Untied from the params, that shard_map did not
  compile on XLA:CPU: "xla.sdy.LocalToGlobalShape".)"""
  tx = z1.zero1(inner, axis_name="data")
  params = jax.device_put(float_part(odd_params()), NamedSharding(mesh(4), P()))
  traced = jax.jit(tx.init)(params)
  assert_equal(traced, tx.init(params))
