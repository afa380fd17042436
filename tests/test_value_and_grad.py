"""``z1.value_and_grad`` / ``z1.grad`` in plain ``jax.jit``: stock Flax
layers, gradients reduce-scattered in the backward, DDP's traffic.

Tolerances: FP32_REORDER (tests/tolerances.py) against jax.value_and_grad
through the same zero1 and against unsharded optax: the reduce-scatter
sums the 8 devices' gradients in another order than jit's all-reduce does
(measured: <= 3e-8 absolute after 4 steps). A missing or doubled 1/N, a
shard taken from the wrong device or a gradient reduced twice moves a
weight by >= lr = 1e-2 x a gradient's share: orders above it.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from zero1_jax import inspect as zinspect
from zero1_jax.core import layout as lay

from helpers import assert_close, mesh
from tolerances import FP32_REORDER, FP32_SCALAR_REORDER


class MLP(nn.Module):
  """Stock layers: Dense with biases added to activations sharded over the
  data axis (what z1.reduced_params cannot take)."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(jnp.tanh(nn.Dense(17)(x)))


MODEL = MLP()
N = 8


def _batches(steps=4):
  r = np.random.default_rng(0)
  return [jax.device_put(
      (r.normal(size=(16, 5)).astype(np.float32),
       r.normal(size=(16, 3)).astype(np.float32)),
      NamedSharding(mesh(N), P("data"))) for _ in range(steps)]


def loss(params, x, y):
  return jnp.mean((MODEL.apply({"params": params}, x) - y) ** 2)


def _train(form, make=z1.zero1, steps=4):
  """A TrainState loop as flax writes it; only the gradient call differs.
  Returns (params, last loss, compiled step)."""
  with jax.set_mesh(mesh(N)):
    params = MODEL.init(jax.random.key(0), jnp.ones((1, 5)))["params"]
    tx = make(optax.adam(1e-2), axis_name="data")
    state = train_state.TrainState.create(apply_fn=MODEL.apply,
                                          params=params, tx=tx)

    def step(state, x, y):
      if form == "zero1":
        value, grads = z1.value_and_grad(loss, tx, batch_argnums=(1, 2))(
            state.params, x, y)
      else:
        value, grads = jax.value_and_grad(loss)(state.params, x, y)
      return state.apply_gradients(grads=grads), value

    jitted = jax.jit(step)
    bs = _batches(steps)
    compiled = jitted.lower(state, *bs[0]).compile()
    for x, y in bs:
      state, value = jitted(state, x, y)
  return state.params, float(value), compiled


@pytest.fixture(scope="module")
def runs():
  return {form: _train(form) for form in ("zero1", "jax")}


def _optax(steps=4):
  params = MODEL.init(jax.random.key(0), jnp.ones((1, 5)))["params"]
  opt = optax.adam(1e-2)
  s = opt.init(params)
  for x, y in _batches(steps):
    g = jax.grad(loss)(params, np.asarray(x), np.asarray(y))
    u, s = opt.update(g, s, params)
    params = optax.apply_updates(params, u)
  return params


def test_trains_as_jax_grad_and_as_optax(runs):
  p, value, _ = runs["zero1"]
  p_jax, value_jax, _ = runs["jax"]
  assert_close(p, p_jax, FP32_REORDER, "vs jax.value_and_grad")
  assert_close(p, _optax(), FP32_REORDER, "vs optax")
  assert abs(value - value_jax) <= FP32_SCALAR_REORDER * abs(value_jax)


def test_the_step_moves_ddp_bytes(runs):
  """Read from the compiled step: jax.grad's path all-reduces the whole
  gradient (2 Psi of traffic) before zero1 all-gathers (Psi); with
  z1.value_and_grad the gradient leaves by reduce-scatter (Psi, the padded
  shards' sum) and only scalars are all-reduced (the loss, the norm)."""
  params = runs["zero1"][0]
  padded = sum(int(np.prod(s.padded_shape)) * 4
               for s in lay.plan(params, N).leaves if s.kind == lay.SHARD)
  ours = zinspect.collectives(runs["zero1"][2])
  theirs = zinspect.collectives(runs["jax"][2])
  assert ours["reduce-scatter"].bytes == padded == ours["all-gather"].bytes
  assert ours["all-reduce"].bytes <= 16      # scalars only
  psi = sum(x.size for x in jax.tree.leaves(params)) * 4
  assert theirs["all-reduce"].bytes >= psi and "reduce-scatter" not in theirs
  traffic = lambda c: sum(v.traffic for v in c.values())
  assert traffic(ours) < traffic(theirs)


def test_zero2_in_plain_jit_trains_as_its_train_step():
  """With z1.zero2 each leaf is reduce-scattered alone in the backward, as
  z1.train_step's stage 2 does: the same hooks on the same local gradients.
  The two programs around them differ (the user's jit with a shard_map over
  the data axis inside, against train_step's), so XLA may fuse the backward
  differently: FP32_REORDER. Measured: bitwise on jax 0.10.2, 1 ulp in 1 of
  85 weights on jax 0.12."""
  p_jit, _, _ = _train("zero1", make=lambda o, **k: z1.zero2(
      o, inplace_bytes=0, **k), steps=3)
  tx = z1.zero2(optax.adam(1e-2), axis_name="data", inplace_bytes=0)
  params = MODEL.init(jax.random.key(0), jnp.ones((1, 5)))["params"]
  p, s = z1.init(tx, params, mesh(N))
  step = z1.train_step(lambda q, b: loss(q, *b), tx, mesh(N))
  for b in _batches(3):
    p, s, _ = step(p, s, b)
  assert_close(p_jit, p, FP32_REORDER, "zero2 plain jit vs train_step")


def test_compiled_for_gpus_the_update_gathers_in_the_backwards_groups(
    monkeypatch):
  """On GPUs, z1.value_and_grad hands tx.update how its backward grouped
  the reduce-scatters, and the new weights are gathered in the same groups
  (core/plan.py backward_buckets: each gather waits for one reduce-scatter;
  tests/test_gpu_aot.py reads that from the GPU program). Run here with the
  mesh's platform said to be 'gpu' and 512-byte buckets (MLP's 4 leaves in
  2 groups, one of 3 leaves packed): the same weights as optax within
  FP32_REORDER (the sums' order, as above), one gather per group. Which
  leaves share a gather cannot change the numbers (a bucket is packed and
  unpacked by the same segments); a leaf left out of the groups fails the
  trace (planted: the last bucket dropped)."""
  from zero1_jax.core import plan, platform
  monkeypatch.setattr(platform, "resolve", lambda mesh=None: "gpu")
  made = []
  real = plan.backward_buckets
  monkeypatch.setattr(plan, "backward_buckets",
                      lambda *a, **k: made.append(real(*a, **k)) or made[-1])
  p, _, compiled = _train("zero1", make=lambda o, **k: z1.zero1(
      o, bucket_bytes=512, inplace_bytes=None, **k), steps=3)
  assert made and all(b is not None for b in made)
  groups = {b.group for b in made[-1]}
  assert sorted(len(b.segments) for b in made[-1]) == [1, 3]   # 1 packed
  assert zinspect.collectives(compiled)["all-gather"].count == len(groups)
  assert_close(p, _optax(steps=3), FP32_REORDER, "vs optax")


def test_grad_has_aux_and_argument_checks():
  with jax.set_mesh(mesh(N)):
    tx = z1.zero1(optax.sgd(0.1), axis_name="data")
    params = {"w": jnp.ones((5, 3))}
    state = tx.init(params)
    x = jnp.ones((16, 5))
    f = lambda p, x, scale: (jnp.mean(x @ p["w"]) * scale, {"n": jnp.sum(x)})
    grads, aux = jax.jit(z1.grad(f, tx, has_aux=True))(params, x, 2.0)
    assert float(aux["n"]) == 16 * 5 / N   # the devices' mean of local sums
    updates, _ = tx.update(grads, state, params)
    # d/dw mean(x @ w) * 2 = 2 * mean row of x = 2 / 3 per output column
    np.testing.assert_allclose(np.asarray(updates["w"]),
                               -0.1 * 2 / 3 * np.ones((5, 3)), rtol=1e-6)
  with pytest.raises(TypeError, match="must be the transformation z1.zero1"):
    z1.value_and_grad(f, optax.sgd(0.1))
  with pytest.raises(ValueError, match="position 0 is the params"):
    z1.value_and_grad(f, tx, batch_argnums=(0,))


def test_python_numbers_in_other_arguments_reach_fun_as_numbers():
  """As jax.value_and_grad hands its non-differentiated arguments: an int
  that ``fun`` loops over (``range(n)``) stays an int, not a tracer."""
  def f(p, x, n):
    h = x
    for _ in range(n):
      h = jnp.tanh(h @ p["w"])
    return jnp.mean(h ** 2)
  with jax.set_mesh(mesh(N)):
    tx = z1.zero1(optax.sgd(0.1), axis_name="data")
    params = {"w": jnp.eye(4) * 0.5}
    x = jnp.linspace(-1, 1, 64).reshape(16, 4)
    got = jax.jit(lambda p, x: z1.value_and_grad(f, tx)(p, x, 2)[0])(params, x)
    want = jax.jit(lambda p, x: jax.value_and_grad(f)(p, x, 2)[0])(params, x)
  np.testing.assert_allclose(float(got), float(want), rtol=FP32_SCALAR_REORDER)
