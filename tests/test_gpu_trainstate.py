"""A flax TrainState loop as flax users write it, compiled for 8 H100s
without a GPU (docs/gpu.md's recipe): with ``z1.value_and_grad`` and with
``jax.value_and_grad``, the plan read from XLA's GPU program. Structure,
never time (tests/test_gpu_aot.py has the project's own forms)."""

import re

import jax
import numpy as np
import pytest

import zero1_jax as z1
from zero1_jax.core import layout as lay
from zero1_jax.inspect import gpu


@pytest.fixture(scope="module")
def mesh():
  return gpu.mesh(8)


def trainstate_program(mesh, value_and_grad):
  """A flax TrainState step as flax users write it, compiled for ``mesh``:
  the TrainState made by ``jax.eval_shape`` under ``jax.set_mesh`` of the
  compile-only mesh (zero1's init probes the optimizer on concrete numbers:
  not on those devices, which run nothing), then a plain-jit step taking
  its gradients from ``value_and_grad(loss, tx)`` and ``apply_gradients``
  (zero1's check of a restored state runs at trace time, on the host: no
  concrete owner here, nothing checked). Returns the compiled program and
  the params' shapes."""
  import flax.linen as nn
  import jax.numpy as jnp
  import optax
  from flax.training import train_state
  from jax.sharding import NamedSharding, PartitionSpec as P

  model = nn.Sequential([nn.Dense(256), nn.relu, nn.Dense(256), nn.relu,
                         nn.Dense(10)])
  tx = z1.zero1(optax.adamw(1e-3), axis_name="data", bucket_bytes=1 << 18)
  loss = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)

  def step(state, x):
    _, g = value_and_grad(loss, tx)(state.params, x)
    return state.apply_gradients(grads=g)

  placed = lambda t, spec: jax.tree.map(lambda s: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=NamedSharding(mesh, spec)), t)
  with jax.set_mesh(mesh):
    st = jax.eval_shape(lambda: train_state.TrainState.create(
        apply_fn=model.apply, tx=tx,
        params=model.init(jax.random.key(0), jnp.ones((1, 128)))["params"]))
    opt = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        st.opt_state, z1.state_shardings(tx, st.params, mesh))
    st = st.replace(params=placed(st.params, P()), step=placed(st.step, P()),
                    opt_state=opt)
    low = jax.jit(step).lower(st, placed(jax.ShapeDtypeStruct(
        (64, 128), jnp.float32), P("data")))
  c, _ = gpu.compile(low)
  return c, st.params


def test_a_flax_trainstate_loop_compiles_for_gpus(mesh):
  """docs/gpu.md's recipe on a program as flax users write it, with
  ``z1.value_and_grad``: one gather per reduce-scatter group."""
  c, _ = trainstate_program(mesh, z1.value_and_grad)
  coll = z1.inspect.hlo_collectives(c.as_text())
  assert 1 < coll["all-gather"].count <= coll["reduce-scatter"].count


def test_jax_grads_reach_the_update_by_reduce_scatter(mesh):
  """The same loop with ``jax.value_and_grad`` (most flax programs' line):
  ``tx.update`` takes each sharded leaf that needs no padding as this
  device's block, so XLA sums its gradient straight into the blocks (a
  reduce-scatter of its bytes) instead of all-reducing it whole for each
  device to slice. Only the leaves padded to a multiple of 8 (here the
  last layer's 10 biases) and scalars are all-reduced. The new weights'
  gathers are packed (flat buckets, ``inplace_bytes="auto"`` on GPU after
  jit's reduce): each waits for XLA's combined reduce-scatters, not
  for its own leaf's gradient."""
  c, params = trainstate_program(
      mesh, lambda f, tx: jax.value_and_grad(f))
  text = c.as_text()
  gathered = [re.findall(r"f32\[([\d,]*)\]", l.split("all-gather-start(")[0])
              for l in text.splitlines() if "all-gather-start(" in l]
  assert gathered and all(d.count(",") == 0 for g in gathered for d in g), gathered
  coll = z1.inspect.hlo_collectives(text)
  layout = lay.plan(params, 8)
  blocks = sum(4 * s.shard_size * 8 for s in layout.leaves
               if s.kind == lay.SHARD and s.padded_shape == s.shape)
  whole = sum(4 * int(np.prod(s.shape)) for s in layout.leaves
              if s.kind != lay.SHARD or s.padded_shape != s.shape)
  assert blocks > 100 * whole
  assert coll["reduce-scatter"].bytes == blocks, coll
  assert coll["all-reduce"].bytes <= 2 * whole + 16, coll   # and the loss
