"""ZeRO-1 on 2-D meshes ("data", "model"): tensor-parallel params keep their
sharding, each device's state is 1/N_data of its own block, and training is
the same as on a 1-D mesh and as unsharded optax.

Tolerances: 1e-6 relative + 1e-7 absolute. The tensor-parallel matmuls sum
over the model axis in another order than one device does (measured: at
most 3e-8 absolute after 3 steps); a wrong shard, a block counted twice in
the norm or a lost update is off by 1e-3 or more.
"""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zero1_jax as z1

AUTO = AxisType.Auto
RTOL, ATOL = 1e-6, 1e-7
CLIP = 0.05   # below the gradient norm (~0.3): every step clips


def params0():
  r = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(r.normal(size=s) * 0.3, jnp.float32)
  return {"w1": f(5, 8), "b1": f(8), "w2": f(8, 3), "b2": f(3),
          "g": f(6), "s": jnp.float32(0.5), "count": jnp.int32(7)}


# w1: column-parallel, its free dim 5 is split over data (padded);
# b1: only dim taken, 8/2 = 4 rows per block split over data;
# w2: row-parallel, free dim 3 split over data (padded);
# g: only dim taken, 3 rows per block: not split over data (replicated).
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None),
         "b2": P(), "g": P("model"), "s": P(), "count": P()}


def loss(p, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  y = (h @ p["w2"] + p["b2"]) * p["s"]
  return jnp.mean((y - b["y"]) ** 2) + 0.1 * jnp.sum(p["g"] ** 2)


def batches(n=3):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(16, 5)).astype(np.float32),
           "y": r.normal(size=(16, 3)).astype(np.float32)} for _ in range(n)]


def tx():
  return z1.zero1(optax.adamw(1e-2, weight_decay=0.1), axis_name="data",
                  max_grad_norm=CLIP)


def mesh2(d, m):
  return jax.make_mesh((d, m), ("data", "model"), axis_types=(AUTO, AUTO),
                       devices=jax.devices()[:d * m])


def place(mesh, tree, specs=SPECS):
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                      tree, specs)


def train(mesh, params, steps=3):
  t = tx()
  p, s = z1.init(t, params, mesh)
  step = z1.train_step(loss, t, mesh)
  norms = []
  for b in batches(steps):
    p, s, m = step(p, s, b)
    norms.append(float(m["grad_norm"]))
  return p, s, norms, step


def optax_ref(steps=3):
  opt = optax.chain(optax.clip_by_global_norm(CLIP),
                    optax.adamw(1e-2, weight_decay=0.1))
  p = {k: v for k, v in params0().items() if k != "count"}
  s = opt.init(p)
  for b in batches(steps):
    g = jax.grad(loss)(p, b)
    u, s = opt.update(g, s, p)
    p = optax.apply_updates(p, u)
  return p


def close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module", params=[(4, 2), (2, 2)], ids=["4x2", "2x2"])
def runs(request):
  d, m = request.param
  msh = mesh2(d, m)
  two = train(msh, place(msh, params0()))
  one = train(jax.make_mesh((d,), ("data",), axis_types=(AUTO,),
                            devices=jax.devices()[:d]), params0())
  return msh, two, one


def test_same_as_1d_mesh_and_optax(runs):
  _, (p2, _, norms2, _), (p1, _, norms1, _) = runs
  ref = optax_ref()
  for k in ref:
    close(p2[k], p1[k])
    close(p2[k], ref[k])
  assert int(p2["count"]) == 7
  # The norm is global: every block of every axis once (clipping uses it).
  np.testing.assert_allclose(norms2, norms1, rtol=RTOL)
  assert min(norms2) > CLIP


def test_params_keep_their_sharding(runs):
  msh, (p2, _, _, _), _ = runs
  for k, spec in SPECS.items():
    assert p2[k].sharding.is_equivalent_to(NamedSharding(msh, spec),
                                           p2[k].ndim), k


def _rows(n, d):
  return -(-d // n)


def test_state_is_one_over_data_times_model(runs):
  msh, (_, s2, _, _), _ = runs
  n, m = msh.shape["data"], msh.shape["model"]
  # Per device, per moment: each block's 1/N (padded) split, from the shapes.
  want = {"w1": _rows(n, 5) * (8 // m), "b1": (8 // m) // n,
          "w2": (8 // m) * _rows(n, 3), "b2": _rows(n, 3), "g": 6 // m}
  adam = s2.inner[0]   # adamw: (ScaleByAdamState, ...)
  for moment in (adam.mu, adam.nu):
    for k, elems in want.items():
      shard = moment[k].addressable_shards[0].data
      assert shard.size == elems, (k, shard.shape)
  # fp32 params are their own master: no copy is stored.
  assert all(x is None for x in jax.tree.leaves(
      s2.master, is_leaf=lambda x: x is None))
  per_device = sum(x.addressable_shards[0].data.nbytes
                   for x in jax.tree.leaves((adam.mu, adam.nu)))
  assert per_device == 2 * 4 * (sum(want.values()) + 1)   # + the scalar s


def test_update_moves_blocks_over_the_data_axis_only(runs):
  msh, (p2, s2, _, step), _ = runs
  n, m = msh.shape["data"], msh.shape["model"]
  comm = z1.inspect.collectives(step.lower(p2, s2, batches(1)[0]).compile())
  # The gathered weights: each device's padded block pieces, N of them.
  blocks = (_rows(n, 5) * n * (8 // m) + 8 // m + (8 // m) * _rows(n, 3) * n
            + _rows(n, 3) * n)
  assert comm["all-gather"].bytes == 4 * blocks
  assert comm["reduce-scatter"].bytes == 4 * blocks


def test_checkpoint_moves_between_mesh_shapes(tmp_path):
  """4x2 -> 8x1 -> 2x2, two steps on each, equals six steps on one mesh."""
  data = batches(6)
  t = tx()
  p, s = z1.init(t, params0(), jax.make_mesh((4,), ("data",), axis_types=(AUTO,),
                                             devices=jax.devices()[:4]))
  step = z1.train_step(loss, t, p["w1"].sharding.mesh)
  for b in data:
    p, s, _ = step(p, s, b)
  ref = p
  p = s = None
  for i, (d, m) in enumerate([(4, 2), (8, 1), (2, 2)]):
    msh = mesh2(d, m)
    if i == 0:
      p, s = z1.init(t, place(msh, params0()), msh)
    else:
      with z1.checkpoint.Checkpointer(tmp_path) as ck:
        p, s, _ = ck.restore(None, t, place(msh, params0()), msh)
    step = z1.train_step(loss, t, msh)
    for b in data[2 * i: 2 * i + 2]:
      p, s, _ = step(p, s, b)
    with z1.checkpoint.Checkpointer(tmp_path) as ck:
      ck.save(2 * i + 2, p, s)
  for k in SPECS:
    close(p[k], ref[k])
  assert p["w1"].sharding.spec == P(None, "model")


class TPMLP(nn.Module):
  """A tensor-parallel MLP written with Flax partitioning metadata."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, kernel_init=nn.with_partitioning(
        nn.initializers.lecun_normal(), (None, "model")),
        bias_init=nn.with_partitioning(nn.initializers.zeros, ("model",)))(x)
    return nn.Dense(3, kernel_init=nn.with_partitioning(
        nn.initializers.lecun_normal(), ("model", None)))(jnp.tanh(h))


def test_flax_partitioning_metadata():
  msh = mesh2(4, 2)
  model = TPMLP()
  boxed = model.init(jax.random.key(0), jnp.ones((1, 5)))["params"]
  mse = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)
  t = z1.zero1(optax.adam(1e-2), axis_name="data")
  p, s = z1.init(t, boxed, msh)                  # specs from nn.Partitioned
  assert p["Dense_0"]["kernel"].sharding.spec == P(None, "model")
  step = z1.train_step(mse, t, msh)
  plain = nn.unbox(boxed)
  opt = optax.adam(1e-2)
  ref, os_ = plain, opt.init(plain)
  for b in batches(2):
    p, s, _ = step(p, s, b)
    u, os_ = opt.update(jax.grad(mse)(ref, b), os_, ref)
    ref = optax.apply_updates(ref, u)
  jax.tree.map(close, p, ref)
  assert p["Dense_1"]["kernel"].sharding.spec[0] == "model"


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_plain_jit_on_a_2d_mesh(kind):
  """tx.init / tx.update in plain jax.jit: Auto axes take param_specs (jit
  cannot read the sharding of Auto-typed tracers), Explicit ones need none."""
  t_ = AUTO if kind == "auto" else AxisType.Explicit
  msh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(t_, t_))
  specs = {k: v for k, v in SPECS.items() if k != "count"}
  t = z1.zero1(optax.adamw(1e-2, weight_decay=0.1), axis_name="data",
               max_grad_norm=CLIP, param_specs=specs if kind == "auto" else None)

  def tp_loss(p, b):   # Explicit axes: the row-parallel matmul names its output
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    y = (jnp.matmul(h, p["w2"], out_sharding=P("data")) if kind == "explicit"
         else h @ p["w2"])
    y = (y + p["b2"]) * p["s"]
    return jnp.mean((y - b["y"]) ** 2) + 0.1 * jnp.sum(p["g"] ** 2)

  with jax.set_mesh(msh):
    p = place(msh, {k: v for k, v in params0().items() if k != "count"}, specs)
    s = t.init(p)

    @jax.jit
    def step(p, s, b):
      u, s = t.update(jax.grad(tp_loss)(p, b), s, p)
      return optax.apply_updates(p, u), s

    for b in batches():
      p, s = step(p, s, place(msh, b, {"x": P("data"), "y": P("data")}))
  ref = optax_ref()
  for k in ref:
    close(p[k], ref[k])
    assert p[k].sharding.is_equivalent_to(NamedSharding(msh, specs[k]),
                                          p[k].ndim), k


def test_jit_on_auto_axes_without_specs_warns():
  """Init traced too (nothing concrete to read the sharding from) and no
  param_specs: the update says it treats the params as replicated."""
  msh = mesh2(4, 2)
  t = z1.zero1(optax.sgd(0.1), axis_name="data")
  with jax.set_mesh(msh):
    p = place(msh, {"w": jnp.ones((4, 2))}, {"w": P(None, "model")})
    g = {"w": jnp.ones((4, 2))}
    with pytest.warns(UserWarning, match="param_specs"):
      jax.jit(lambda p, g: t.update(g, t.init(p), p))(p, g)


def test_bad_sharding_is_refused_with_the_fix():
  msh = mesh2(4, 2)
  t = z1.zero1(optax.adam(1e-2), axis_name="data")
  with pytest.raises(ValueError, match="replicated over 'data'"):
    z1.init(t, place(msh, {"w": jnp.ones((4, 2))}, {"w": P("data")}), msh)
  with pytest.raises(ValueError, match=r"not divisible .*: pad that dim to a "
                     r"multiple of 2, or shard another dim or none \(P\(\)"):
    z1.init(z1.zero1(optax.adam(1e-2), axis_name="data",
                     param_specs={"w": P("model")}), {"w": jnp.ones(5)}, msh)
  with pytest.raises(ValueError, match="lacks"):
    z1.init(z1.zero1(optax.adam(1e-2), axis_name="data",
                     param_specs={"w": P("tensor")}), {"w": jnp.ones(4)}, msh)
  t2 = z1.zero2(optax.adam(1e-2), axis_name="data")
  p, s = z1.init(t, place(msh, {"w": jnp.ones((4, 2))},
                          {"w": P(None, "model")}), msh)
  step = z1.train_step(lambda p, b: jnp.sum(p["w"] * b["x"].mean()), t2, msh)
  with pytest.raises(ValueError, match="ZeRO-2"):
    step(p, s, {"x": np.ones((8, 1), np.float32)})
  with pytest.raises(ValueError, match="ZeRO-2"):   # at init, before any state
    z1.init(t2, place(msh, {"w": jnp.ones((4, 2))}, {"w": P(None, "model")}), msh)


def test_bf16_params_keep_a_master_split_like_the_moments():
  """12 bytes per parameter / (N_data x N_model): the fp32 master of a bf16
  block is split over "data" as the moments are, and restores the fp32
  weights the 1-D run keeps (bf16 forward: within one bf16 ulp of them)."""
  msh = mesh2(4, 2)
  t = tx()
  p, s = z1.init(t, place(msh, params0()), msh, param_dtype=jnp.bfloat16)
  step = z1.train_step(loss, t, msh)
  one = jax.make_mesh((4,), ("data",), axis_types=(AUTO,),
                      devices=jax.devices()[:4])
  p1, s1 = z1.init(t, params0(), one, param_dtype=jnp.bfloat16)
  step1 = z1.train_step(loss, t, one)
  for b in batches(2):
    p, s, _ = step(p, s, b)
    p1, s1, _ = step1(p1, s1, b)
  assert p["w1"].dtype == jnp.bfloat16
  assert s.master["w1"].sharding.spec == s.inner[0].mu["w1"].sharding.spec
  assert s.master["w1"].addressable_shards[0].data.size == 2 * 4   # (8/4) x (8/2)
  for k in ("w1", "b1", "w2", "b2", "g"):
    m2 = np.asarray(s.master[k])[tuple(map(slice, np.shape(params0()[k])))]
    m1 = np.asarray(s1.master[k])[tuple(map(slice, np.shape(params0()[k])))]
    np.testing.assert_allclose(m2, m1, rtol=2 ** -8, atol=1e-6)


def test_three_axes():
  """Params sharded over two non-data axes at once (and one of them alone)."""
  msh = jax.make_mesh((2, 2, 2), ("data", "x", "y"), axis_types=(AUTO,) * 3)
  specs = {"w1": P(None, ("x", "y")), "b1": P(("x", "y")), "w2": P(("x", "y")),
           "b2": P(), "g": P("y"), "s": P(), "count": P()}
  p, _, norms, _ = train(msh, place(msh, params0(), specs))
  one = jax.make_mesh((2,), ("data",), axis_types=(AUTO,),
                      devices=jax.devices()[:2])
  p1, _, norms1, _ = train(one, params0())
  ref = optax_ref()
  for k in ref:
    close(p[k], p1[k])
    close(p[k], ref[k])
    assert p[k].sharding.is_equivalent_to(NamedSharding(msh, specs[k]),
                                          p[k].ndim), k
  np.testing.assert_allclose(norms, norms1, rtol=RTOL)
