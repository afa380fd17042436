"""Flax: linen TrainState and nnx models train exactly as with plain optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
import zero1_jax.flax as z1flax
from helpers import assert_close, mesh
from tolerances import FP32_REORDER

N = 4


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(7)(x))
    return nn.Dense(3)(x)


def batches(k=6):
  r = np.random.default_rng(0)
  return [{"x": r.normal(size=(16, 5)).astype(np.float32),
           "y": r.normal(size=(16, 3)).astype(np.float32)} for _ in range(k)]


def test_linen_train_state_matches_flax_train_state():
  model = MLP()
  params = model.init(jax.random.key(0), jnp.ones((1, 5)))["params"]

  def loss(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

  # Reference: plain flax TrainState, unsharded.
  ref = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                      tx=optax.adamw(1e-2, weight_decay=0.1))
  ref_step = jax.jit(lambda s, b: s.apply_gradients(grads=jax.grad(loss)(s.params, b)))
  for b in batches():
    ref = ref_step(ref, b)

  tx = z1.zero1(optax.adamw(1e-2, weight_decay=0.1), axis_name="data")
  state = z1flax.TrainState.create(apply_fn=model.apply, params=params, tx=tx,
                                   mesh=mesh(N))
  specs = z1flax.state_specs(state, mesh(N))

  def per_device(state, b):
    local = jax.lax.pcast(state.params, "data", to="varying")
    return state.apply_gradients(grads=jax.grad(loss)(local, b))

  step = jax.jit(jax.shard_map(per_device, mesh=mesh(N),
                               in_specs=(specs, P("data")), out_specs=specs))
  for b in batches():
    state = step(state, jax.device_put(b, NamedSharding(mesh(N), P("data"))))
  assert int(state.step) == int(ref.step) == 6
  assert_close(state.params, ref.params, FP32_REORDER, "linen ")


class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(5, 7, rngs=rngs)
    self.l2 = nnx.Linear(7, 3, rngs=rngs)
    self.calls = nnx.Variable(jnp.zeros((), jnp.int32))   # not trained

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def nnx_loss(model, b):
  return jnp.mean((model(b["x"]) - b["y"]) ** 2)


def test_nnx_trainer_matches_nnx_optimizer():
  ref_model = NnxMLP(nnx.Rngs(0))
  opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def ref_step(model, opt, b):
    grads = nnx.grad(nnx_loss)(model, b)
    opt.update(model, grads)

  for b in batches():
    ref_step(ref_model, opt, b)

  model = NnxMLP(nnx.Rngs(0))
  trainer = z1flax.NnxTrainer(model, z1.zero1(optax.adam(1e-2), axis_name="data"),
                              mesh(N), nnx_loss)
  for b in batches():
    metrics = trainer.train_step(b)
  assert np.isfinite(metrics["loss"])
  trainer.update_model(model)
  got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  want = nnx.to_pure_dict(nnx.state(ref_model, nnx.Param))
  assert_close(got, want, FP32_REORDER, "nnx ")
  b = batches(1)[0]
  np.testing.assert_allclose(model(b["x"]), ref_model(b["x"]), rtol=1e-5, atol=1e-6)


class Stateful(nnx.Module):
  """A model that updates state NnxTrainer holds constant: BatchNorm
  statistics, the RNG count Dropout draws from, or a counter it sets."""

  def __init__(self, kind, rngs):
    self.kind = kind
    self.l1 = nnx.Linear(5, 7, rngs=rngs)
    self.bn = nnx.data(nnx.BatchNorm(7, rngs=rngs) if "batchnorm" in kind else None)
    self.do = nnx.data(nnx.Dropout(0.5, rngs=rngs) if "dropout" in kind else None)
    self.calls = nnx.Variable(jnp.zeros((), jnp.int32))
    self.l2 = nnx.Linear(7, 3, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.l1(x))
    if self.bn is not None:
      h = self.bn(h)
    if self.do is not None:
      h = self.do(h)
    if self.kind == "counter":
      self.calls[...] += 1
    return self.l2(h)


@pytest.mark.parametrize("kind,names", [
    ("batchnorm", ["bn.mean (BatchStat)", "bn.var (BatchStat)"]),
    ("dropout", ["do.rngs.count (RngCount)"]),
    ("counter", ["calls (Variable)"]),
])
def test_nnx_trainer_refuses_a_model_that_updates_held_state(kind, names):
  """Before: flax's TraceContextError ('Cannot mutate BatchStat from a
  different trace level') from deep inside the step. Now one error at the
  first step naming the variables and both ways out."""
  trainer = z1flax.NnxTrainer(Stateful(kind, nnx.Rngs(0)),
                              z1.zero1(optax.adam(1e-2), axis_name="data"),
                              mesh(N), nnx_loss)
  with pytest.raises(z1flax.HeldStateMutated) as e:
    trainer.train_step(batches(1)[0])
  msg = str(e.value)
  assert isinstance(e.value, ValueError)
  for name in names:
    assert name in msg, msg
  assert "l1.kernel" not in msg and "(Param)" not in msg, msg
  assert "holds every other variable constant" in msg, msg
  assert "nnx.Optimizer(model, tx, wrt=nnx.Param)" in msg, msg
  assert "jax.set_mesh" in msg and "model.eval()" in msg, msg


def test_nnx_trainer_trains_the_same_model_in_eval_mode():
  """The error's second way out: deterministic BatchNorm and Dropout."""
  model = Stateful("batchnorm+dropout", nnx.Rngs(0))
  model.eval()
  trainer = z1flax.NnxTrainer(model, z1.zero1(optax.sgd(0.1), axis_name="data"),
                              mesh(N), nnx_loss)
  losses = [float(trainer.train_step(b)["loss"]) for b in batches(1) * 5]
  assert losses[-1] < losses[0], losses


def test_linen_example_script_trains():
  from experiments.examples import flax_linen
  first = flax_linen.main(steps=1)
  last = flax_linen.main(steps=60)
  assert last < 0.7 * first


def test_nnx_optimizer_checkpoint_restores_at_another_n(tmp_path):
  """nnx users save nnx.state(model, nnx.Param) and optimizer.opt_state,
  both full of Variables. The save wrote paths ending in '.value' that no
  restore could match ('optimizer state .inner[0].count is in the model,
  not in the checkpoint'); now Variables are stored as their values, restore
  takes the same templates and gives Variables back for nnx.update, and
  z1.flax.assign loads the state into a new optimizer. Saved at N=4, restored
  at N=2: the next step equals the uninterrupted run's."""
  tx = lambda: z1.zero1(optax.adamw(1e-2, weight_decay=0.1), axis_name="data")

  @nnx.jit
  def step(model, opt, b):
    opt.update(model, nnx.grad(nnx_loss)(model, b))

  bs = batches(4)
  with jax.set_mesh(mesh(4)):
    model = NnxMLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    for b in bs[:3]:
      step(model, opt, b)
    with z1.checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
      ckpt.save(3, nnx.state(model, nnx.Param), opt.opt_state)
    step(model, opt, bs[3])
    want = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  with jax.set_mesh(mesh(2)):
    model2 = NnxMLP(nnx.Rngs(1))          # other weights: all restored
    opt2 = nnx.Optimizer(model2, tx(), wrt=nnx.Param)
    with z1.checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
      params, opt_state, _ = ckpt.restore(None, tx(),
                                          nnx.state(model2, nnx.Param), mesh(2))
    # the template's form back: an nnx.State of Params
    assert all(isinstance(v, nnx.Param) for v in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    nnx.update(model2, params)
    z1flax.assign(opt2.opt_state, opt_state)
    opt2.step[...] = 3
    step(model2, opt2, bs[3])
    got = nnx.to_pure_dict(nnx.state(model2, nnx.Param))
  # N=4 -> N=2 sums the gradient in another order: fp32 rounding (measured
  # in test_checkpoint's resharding tests at ~1e-7)
  assert_close(got, want, FP32_REORDER, "nnx resumed at N=2 ")
  with pytest.raises(ValueError, match="pass the optimizer's opt_state"):
    z1flax.assign(opt2.opt_state, {"a": jnp.zeros(2)})


def test_nnx_optimizer_sharding_metadata_is_said_not_applied():
  """A param whose ``optimizer_sharding`` asks for its state to be placed
  unlike the param: zero1's placement (its sharding + the data axis)
  replaces it, and tx.init says so once, naming the param and the key. A
  param without it, or with it equal to its own sharding, is quiet."""
  import warnings
  msh = jax.make_mesh((4, 2), ("data", "model"))
  with jax.set_mesh(msh):
    asks = nnx.Linear(8, 4, rngs=nnx.Rngs(0), kernel_metadata={
        "out_sharding": (None, "model"), "optimizer_sharding": (None, None)})
    with pytest.warns(UserWarning, match=r"1 param\(s\) carry nnx's "
                      r"optimizer-sharding metadata .*\['kernel'\]: "
                      r"optimizer_sharding=\(None, None\).* not applied"):
      nnx.Optimizer(asks, z1.zero1(optax.adam(1e-2), axis_name="data"),
                    wrt=nnx.Param)
    same = nnx.Linear(8, 4, rngs=nnx.Rngs(0), kernel_metadata={
        "out_sharding": (None, "model"), "optimizer_sharding": (None, "model")})
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      nnx.Optimizer(same, z1.zero1(optax.adam(1e-2), axis_name="data"),
                    wrt=nnx.Param)


def test_nnx_optimizer_with_the_mesh_given_to_zero1_outside_set_mesh():
  """The fix zero1's no-mesh error names, ``zero1(..., mesh=mesh)``, for an
  ``nnx.Optimizer`` built outside ``jax.set_mesh``: nnx wraps each state
  leaf in a Variable whose ``out_sharding`` flax places only on the
  context's mesh or the Variable's own (before: flax's "An auto mesh context
  or metadata is required"). The leaves carry the mesh; the optimizer
  trains as optax's nnx.Optimizer with the moments 1/N."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), jnp.float32)

  def run(tx):
    model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
      loss, g = nnx.value_and_grad(lambda m: jnp.mean(jnp.tanh(m(x)) ** 2))(model)
      opt.update(model, g)
      return loss

    for _ in range(3):
      step(model, opt)
    moments = [v for v in jax.tree.leaves(nnx.state(opt)) if jnp.ndim(v) > 0]
    on_0 = sum(s.data.nbytes for v in moments for s in v.addressable_shards
               if s.device == jax.devices()[0])
    return nnx.state(model, nnx.Param), on_0

  want, optax_bytes = run(optax.adam(1e-2))
  got, zero1_bytes = run(z1.zero1(optax.adam(1e-2), axis_name="data",
                                  mesh=mesh(N)))
  assert_close(jax.tree.map(lambda v: v[...], got),
               jax.tree.map(lambda v: v[...], want), FP32_REORDER, "nnx ")
  assert optax_bytes == 2 * 4 * (8 * 16 + 16)
  assert zero1_bytes == optax_bytes // N
