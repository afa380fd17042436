"""nnx programs on a 2-D ("data", "model") mesh: zero1 reads the params'
sharding over "model" from their ``nnx.with_partitioning`` metadata or from
the placed arrays, and shards the state over "data" within it."""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from test_mesh2d import batches, close, mesh2, place


@pytest.mark.parametrize("form", ["names", "spec", "named_sharding"])
def test_nnx_optimizer_on_auto_axes_needs_no_specs(form):
  """nnx.Optimizer inits eagerly on the placed arrays: tx.init records their
  sharding, and the jitted update (whose Auto-axis tracers carry none) uses
  it. Same weights as plain optax; the params keep "model". The annotation
  in each form flax takes: names, a PartitionSpec, a NamedSharding (JAX's
  LLM-pretraining tutorial; before: TypeError, 'NamedSharding' object is
  not iterable)."""
  from flax import nnx
  msh = mesh2(4, 2)
  as_form = {"names": tuple, "spec": lambda n: P(*n),
             "named_sharding": lambda n: NamedSharding(msh, P(*n))}[form]

  class MLP(nnx.Module):
    def __init__(self, rngs):
      part = lambda names: nnx.with_partitioning(
          nnx.initializers.lecun_normal(), as_form(names))
      self.l1 = nnx.Linear(5, 8, kernel_init=part((None, "model")), rngs=rngs)
      self.l2 = nnx.Linear(8, 3, kernel_init=part(("model", None)), rngs=rngs)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.l1(x)))

  data = batches(3)
  mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  # flax asserts a NamedSharding's mesh is jax.set_mesh's (an abstract one
  # under it): the tutorial sets none, and neither does this case.
  with (contextlib.nullcontext() if form == "named_sharding"
        else jax.set_mesh(msh)):
    model, ref_model = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, z1.zero1(optax.adam(1e-2), axis_name="data"),
                        wrt=nnx.Param)
    # Sharded over "data" from the start: state leaves wrapped like the params
    # took their (None, "model") metadata, which nnx.Optimizer applied (every
    # moment replicated over "data", 4x the bytes, until the first update).
    created = [x for x in jax.tree.leaves(nnx.state(opt, nnx.OptState)) if x.ndim]
    assert created and all("data" in str(x.sharding.spec) for x in created), [
        (x.shape, x.sharding.spec) for x in created]

    @nnx.jit
    def step(model, opt, b):
      opt.update(model, nnx.grad(mse)(model, b))

    with warnings.catch_warnings():
      warnings.simplefilter("error", UserWarning)   # no "cannot be read"
      for b in data:
        step(model, opt, place(msh, b, {"x": P("data"), "y": P("data")}))
    ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)
    for b in data:   # unsharded optax on the same model (the partitioner's TP)
      ref_opt.update(ref_model, nnx.grad(mse)(ref_model, b))
  got = jax.tree.leaves(nnx.state(model, nnx.Param))
  want = jax.tree.leaves(nnx.state(ref_model, nnx.Param))
  kernel = next(x for x in got if x.shape == (5, 8))
  assert kernel.sharding.spec == P(None, "model")
  jax.tree.map(close, got, want)


def test_tx_update_on_nnx_state_trees_matches_optax():
  """tx.init / tx.update called on ``nnx.state`` trees directly: the state
  is sharded over "data" (its Variables say so), the updates come back in the
  params' Variables, and optax.apply_updates gives plain optax's weights."""
  from flax import nnx
  msh = mesh2(4, 2)
  with jax.set_mesh(msh):
    m = nnx.Linear(5, 4, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), (None, "model")))
    params = nnx.state(m, nnx.Param)
    tx = z1.zero1(optax.adam(1e-2), axis_name="data")
    state = tx.init(params)
    # Sharded state leaves come back as Variables whose out_sharding is
    # zero1's spec (data axis on the shard dim), not the param's.
    wrapped = [x for x in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        if isinstance(x, nnx.Variable)]
    assert wrapped and all("data" in jax.tree.leaves(tuple(x.out_sharding))
                           for x in wrapped), wrapped
    ref = optax.adam(1e-2)
    ref_params, ref_state = params, ref.init(params)
    for k in range(3):
      grads = jax.tree.map(lambda p: jnp.cos(p + k), params)
      updates, state = jax.jit(tx.update)(grads, state, params)
      assert jax.tree.structure(updates) == jax.tree.structure(params)
      params = optax.apply_updates(params, updates)
      ref_updates, ref_state = ref.update(grads, ref_state, ref_params)
      ref_params = optax.apply_updates(ref_params, ref_updates)
  jax.tree.map(close, jax.tree.leaves(params), jax.tree.leaves(ref_params))


def _mlp():
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.lecun_normal()
      self.l1 = nnx.Linear(16, 64, rngs=rngs, kernel_init=nnx.with_partitioning(
          init, (None, "model")), bias_init=nnx.with_partitioning(
              nnx.initializers.zeros, ("model",)))
      self.l2 = nnx.Linear(64, 16, rngs=rngs, use_bias=False,
                           kernel_init=nnx.with_partitioning(init, ("model", None)))

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.l1(x)))
  return MLP


def _created_in_jit(msh, make_tx):
  """flax's nnx sharding guide: model and optimizer built inside one jitted
  create, the state constrained to ``nnx.get_partition_spec`` of itself,
  then 3 ``@nnx.jit`` steps. Returns the params and the optimizer state."""
  from flax import nnx
  MLP = _mlp()

  @nnx.jit
  def create():
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    state = nnx.state(opt)
    nnx.update(opt, jax.lax.with_sharding_constraint(
        state, nnx.get_partition_spec(state)))
    return model, opt

  @nnx.jit
  def step(model, opt, x, y):
    opt.update(model, nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model))

  x = np.random.default_rng(0).normal(size=(32, 16)).astype(np.float32)
  x, y = jax.device_put((x, np.sin(x)), NamedSharding(msh, P("data")))
  with jax.set_mesh(msh):
    model, opt = create()
    for _ in range(3):
      step(model, opt, x, y)
  return (jax.tree.leaves(nnx.state(model, nnx.Param)),
          jax.tree.leaves(nnx.state(opt, nnx.optimizer.OptState)))


def test_nnx_optimizer_created_inside_jit_reads_with_partitioning():
  """tx.init traced inside the jitted create gets bare tracers on Auto axes,
  which carry no sharding: the params' ``with_partitioning`` names (the nnx
  Variables' ``out_sharding``) say it. The moments are split over "data"
  within each "model" block (1/8 of optax's on device 0, not 1/4), with no
  warning, and the weights are optax's."""
  msh = mesh2(4, 2)
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)   # no "cannot be read"
    got, state = _created_in_jit(msh, lambda: z1.zero1(
        optax.adamw(1e-2), axis_name="data", mesh=msh))
  want, ref_state = _created_in_jit(msh, lambda: optax.adamw(1e-2))
  jax.tree.map(close, got, want)
  d0 = jax.devices()[0]
  on_d0 = lambda xs: sum(s.data.nbytes for x in xs if x.ndim
                         for s in x.addressable_shards if s.device == d0)
  # Moments of the 2,112 params (kernels 16x64 and 64x16 over "model", the
  # bias (64,) over "model"): optax holds each param's "model" block, 1/2
  # of it; zero1 1/8 (split over "data" too). mu and nu, 4 B each.
  assert on_d0(ref_state) == 2 * 4 * 2112 // 2, on_d0(ref_state)
  assert on_d0(state) == 2 * 4 * 2112 // 8, on_d0(state)


def test_nnx_logical_names_map_through_their_sharding_rules():
  """Logical ``with_partitioning`` names carrying their ``sharding_rules``
  ("mlp" -> "model"), optimizer built inside the jitted create: the state
  follows the kernel's "model" dim and is split over "data" on the other."""
  from flax import nnx
  msh = mesh2(4, 2)
  rules = (("embed", None), ("mlp", "model"))

  @nnx.jit
  def create():
    m = nnx.Linear(16, 64, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), ("embed", "mlp"), sharding_rules=rules))
    return m, nnx.Optimizer(m, z1.zero1(optax.adam(1e-3), axis_name="data",
                                        mesh=msh), wrt=nnx.Param)

  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    with jax.set_mesh(msh):
      m, opt = create()
  assert m.kernel[...].sharding.spec == P(None, "model")
  specs = {x.shape: x.sharding.spec for x in jax.tree.leaves(
      nnx.state(opt, nnx.optimizer.OptState)) if x.ndim}
  assert specs[(16, 64)] == P("data", "model"), specs
