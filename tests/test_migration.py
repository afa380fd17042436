"""An optax run continued with zero1: z1.from_optax_state (optax -> zero1
at any N) and z1.inner_state (zero1 -> optax, the export).

Bound for the continued run: it starts from the same saved state as optax's
own continuation, on the same mesh, so the gradients jit reduces are the same
program; zero1 slices this device's shard of them and runs the same
elementwise AdamW ops there. Each step's weights can then differ only by
fusion choices: at most one rounding (2^-24 relative) per op of the update
chain (m, v, two bias corrections, sqrt, +eps, divide, weight decay, apply):
9 u a step relative to the weights' scale, over M steps 9 M u; x4 headroom
for other CPUs: 36 M u.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from helpers import assert_close, assert_equal, float_part, loss_fn, mesh, odd_params

K, M = 3, 3
RTOL = 36 * M * 2.0 ** -24


def opt():
  return optax.adamw(1e-2, weight_decay=0.1)


def data(k, seed=0):
  r = np.random.default_rng(seed)
  return [{"x": r.normal(size=(16, 5)).astype(np.float32),
           "y": r.normal(size=(16, 3)).astype(np.float32)} for _ in range(k)]


def run(tx, params, state, batches, msh):
  """Plain-jit steps on ``msh``: params replicated, batch over "data"."""
  @jax.jit
  def one(p, s, b):
    g = jax.grad(loss_fn)(p, b)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  with jax.set_mesh(msh):
    params = jax.device_put(params, NamedSharding(msh, P()))
    for b in batches:
      params, state = one(params, state,
                          jax.device_put(b, NamedSharding(msh, P("data"))))
  return params, state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """K optax steps of a data-parallel run (8 devices), saved with orbax and
  read back as the host arrays a user restores."""
  import orbax.checkpoint as ocp
  p0 = float_part(odd_params())
  tx = opt()
  with jax.set_mesh(mesh(8)):
    s0 = tx.init(jax.device_put(p0, NamedSharding(mesh(8), P())))
  params, state = run(tx, p0, s0, data(K), mesh(8))
  path = tmp_path_factory.mktemp("optax") / "ck"
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, {"params": params, "opt_state": state})
  ckpt.wait_until_finished()
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        {"params": params, "opt_state": state})
  got = ckpt.restore(path, target)
  return jax.tree.map(np.asarray, got)


@pytest.mark.parametrize("n", [4, 8])
def test_optax_checkpoint_continued_with_zero1_equals_optax(saved, n):
  params, state = saved["params"], saved["opt_state"]
  more = data(M, seed=1)
  want, _ = run(opt(), params, jax.tree.map(jnp.asarray, state), more, mesh(n))
  tx = z1.zero1(opt(), axis_name="data")
  zstate = z1.from_optax_state(tx, state, params, mesh=mesh(n))
  mu = zstate.inner[0].mu["dense"]["kernel"]
  assert mu.addressable_shards[0].data.size * n == mu.size   # 1/N each
  got, _ = run(tx, params, zstate, more, mesh(n))
  assert_close(got, want, RTOL, f"continued at N={n} ")


@pytest.mark.parametrize("n", [3, 8])
def test_roundtrip_is_bitwise(saved, n):
  params, state = saved["params"], saved["opt_state"]
  tx = z1.zero1(opt(), axis_name="data")
  zstate = z1.from_optax_state(tx, state, params, mesh=mesh(n))
  back = z1.inner_state(tx, zstate, jax.device_put(
      params, NamedSharding(mesh(n), P())))
  assert_equal(jax.tree.map(np.asarray, back), state)


def test_another_optimizers_state_names_the_function(saved):
  tx = z1.zero1(optax.sgd(1e-2, momentum=0.9), axis_name="data")
  with pytest.raises(ValueError, match="z1.from_optax_state: optax_state "
                     "has the tree"):
    z1.from_optax_state(tx, saved["opt_state"], saved["params"], mesh=mesh(4))


def test_flax_checkpoint_of_an_optax_run_restores_into_zero1():
  """A flax TrainState checkpoint of an optax run, restored into a zero1
  TrainState with z1.flax.restore_checkpoint: moments and count come back
  (flax's own restore would leave them at zero), and the run continues as
  optax's does (bound: module docstring)."""
  import tempfile
  from flax.training import checkpoints, train_state
  import zero1_jax.flax as z1flax

  msh = mesh(4)
  p0 = float_part(odd_params())
  with jax.set_mesh(msh):
    p0 = jax.device_put(p0, NamedSharding(msh, P()))
    ref = train_state.TrainState.create(apply_fn=None, params=p0, tx=opt())
  params, state = run(opt(), p0, ref.opt_state, data(K), msh)
  d = tempfile.mkdtemp()
  checkpoints.save_checkpoint(d, ref.replace(step=K, params=params,
                                             opt_state=state), step=K)
  tx = z1.zero1(opt(), axis_name="data")
  with jax.set_mesh(msh):
    target = train_state.TrainState.create(apply_fn=None, params=p0, tx=tx)
    restored = z1flax.restore_checkpoint(d, target)
    # flax's own restore: the hazard this function exists for.
    silent = checkpoints.restore_checkpoint(d, target=target)
  assert int(silent.opt_state.inner[0].count) == 0
  assert int(restored.step) == K
  assert int(restored.opt_state.inner[0].count) == K
  more = data(M, seed=1)
  want, _ = run(opt(), params, state, more, msh)
  got, _ = run(tx, restored.params, restored.opt_state, more, msh)
  assert_close(got, want, RTOL, "restored from flax checkpoint ")


@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
def test_flax_restore_of_params_made_under_the_mesh_runs_in_jit(tmp_path, kind):
  """An optax run's TrainState checkpoint saved on one device; then, as a
  linen program does it, params made under ``jax.set_mesh``,
  z1.flax.restore_checkpoint and the jitted step, all under the mesh. The optax state and step restored
  without a target lie on one device; they come back on the mesh (the pad
  and the jit under the mesh context refused them), the step an int as
  flax's restore gives it."""
  from flax.training import checkpoints, train_state
  import zero1_jax.flax as z1flax

  def run(s, n):
    step = jax.jit(lambda s: s.apply_gradients(
        grads=jax.tree.map(jnp.ones_like, s.params)))
    for _ in range(n):
      s = step(s)
    return s

  msh = jax.make_mesh((4,), ("data",),
                      axis_types=(getattr(jax.sharding.AxisType, kind),))
  params = {"k0": jnp.ones((5, 16)), "b0": jnp.zeros((16,)),   # a linen MLP's
            "k1": jnp.ones((16, 3)), "b1": jnp.zeros((3,))}
  # the optax run on one device, as before zero1 (its arrays restore there)
  ref = run(train_state.TrainState.create(apply_fn=None, params=params,
                                          tx=opt()), 2)
  checkpoints.save_checkpoint(tmp_path, ref, step=2)
  with jax.set_mesh(msh):
    params = jax.tree.map(jnp.array, params)   # made under the mesh
    target = train_state.TrainState.create(
        apply_fn=None, params=params, tx=z1.zero1(opt(), axis_name="data"))
    restored = z1flax.restore_checkpoint(tmp_path, target)
    more = run(restored, 3)
    assert isinstance(restored.step, int) and restored.step == 2
  assert int(more.step) == 5 and int(more.opt_state.inner[0].count) == 5


# A state restored new under a run that is not (issue #38 item 7):
# core/fresh_state.py finds the TrainState / nnx.Optimizer the step was
# called with and warns where the update is traced, once, naming the fix;
# nothing of it is in the compiled step (tests/test_dispatch.py).
NEW = r"the optimizer state is new .* but the training's step is {}.*" \
      r"z1.flax.restore_checkpoint\(ckpt_dir, state\).*z1.from_optax_state"


def _said(fn, where=None):
  """The zero1 'new state' warnings ``fn()`` raised (run to completion),
  each message said once per process forgotten first; ``where`` (a list)
  gets the file each points at."""
  import warnings
  from zero1_jax.core import fresh_state
  fresh_state._SAID.clear()
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    jax.block_until_ready(fn())
  w = [x for x in w if "optimizer state is new" in str(x.message)]
  if where is not None:
    where.extend(x.filename for x in w)
  return [str(x.message) for x in w]


def test_flax_restore_of_an_optax_checkpoint_warns_at_the_first_update(tmp_path):
  """flax's checkpoints.restore_checkpoint of an optax TrainState into a
  zero1 one: params and step restored, zero1's state new. Its first
  apply_gradients warns, in jit and eagerly; a state updated once,
  z1.flax.restore_checkpoint's state and a run from step 0 never do, each
  traced anew (a step already compiled is not traced again: see
  core/fresh_state.py)."""
  import re
  from flax.training import checkpoints, train_state
  import zero1_jax.flax as z1flax

  msh = mesh(4)
  p0 = float_part(odd_params())
  g = jax.tree.map(jnp.ones_like, p0)
  step = jax.jit(lambda s: s.apply_gradients(grads=g))
  with jax.set_mesh(msh):
    p0 = jax.device_put(p0, NamedSharding(msh, P()))
    ref = step(step(train_state.TrainState.create(apply_fn=None, params=p0,
                                                  tx=opt())))
    checkpoints.save_checkpoint(tmp_path, ref, step=2)
    tx = z1.zero1(opt(), axis_name="data")
    target = train_state.TrainState.create(apply_fn=None, params=p0, tx=tx)
    silent = checkpoints.restore_checkpoint(tmp_path, target=target)
    where = []
    said = _said(lambda: step(silent), where)
    assert len(said) == 1 and re.search(NEW.format(2), said[0]), said
    assert where == [__file__], where   # the user's line, not zero1's
    fresh = lambda: jax.jit(lambda s: s.apply_gradients(grads=g))  # noqa: E731
    said = _said(lambda: silent.apply_gradients(grads=g))   # eagerly
    assert len(said) == 1 and re.search(NEW.format(2), said[0]), said
    once = step(silent)
    assert not _said(lambda: fresh()(once))   # updated once: no longer new
    restored = z1flax.restore_checkpoint(tmp_path, target)
    assert not _said(lambda: fresh()(restored))
    assert not _said(lambda: fresh()(target))
    assert not _said(lambda: fresh()(step(target)))


def test_flax_dynamic_scale_overflows_at_the_start_are_not_a_restore():
  """flax's imagenet fp16 step keeps the optimizer state where its
  DynamicScale finds the gradients not finite, so after overflows only the
  state is new at step 1 by design: no warning (it was given, naming a
  checkpoint restore that never happened). A dynamic scale that has counted
  finite steps, or a step past fresh_state.OVERFLOWS, is still warned about."""
  import functools
  from flax.training import dynamic_scale as dsl, train_state

  class TS(train_state.TrainState):   # imagenet's TrainState
    dynamic_scale: dsl.DynamicScale | None = None

  def step(state, x):
    ds, finite, _, grads = state.dynamic_scale.value_and_grad(
        lambda p: jnp.sum(p["w"] * x))(state.params)
    new = state.apply_gradients(grads=grads)
    keep = functools.partial(jax.tree.map, functools.partial(jnp.where, finite))
    return new.replace(opt_state=keep(new.opt_state, state.opt_state),
                       params=keep(new.params, state.params), dynamic_scale=ds)

  fresh = lambda: jax.jit(lambda s, x: step(s, x))  # noqa: E731  traced anew
  with jax.set_mesh(mesh(4)):
    s = TS.create(apply_fn=None, params={"w": jnp.ones(8)},
                  tx=z1.zero1(opt(), axis_name="data"),
                  dynamic_scale=dsl.DynamicScale())
    over = fresh()(s, jnp.full(8, jnp.inf))     # overflowed: state kept
    assert int(over.step) == 1 and int(over.dynamic_scale.fin_steps) == 0
    assert not _said(lambda: fresh()(over, jnp.ones(8)).step)
    counted = over.replace(dynamic_scale=over.dynamic_scale.replace(
        fin_steps=jnp.asarray(3)))
    assert len(_said(lambda: fresh()(counted, jnp.ones(8)).step)) == 1
    from zero1_jax.core import fresh_state
    late = over.replace(step=jnp.asarray(fresh_state.OVERFLOWS + 1))
    assert len(_said(lambda: fresh()(late, jnp.ones(8)).step)) == 1


def test_a_donated_owner_and_a_raising_object_are_passed_over():
  """A TrainState whose arrays an earlier step took (donate_argnums) may
  still sit in a caller's frame when a step is traced: the check passes it
  over instead of reading deleted arrays. An object whose ``tx`` raises is
  not an owner either."""
  from flax.training import train_state
  from zero1_jax.core import fresh_state
  with jax.set_mesh(mesh(4)):
    tx = z1.zero1(opt(), axis_name="data")
    s = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(8)},
                                      tx=tx).replace(step=jnp.asarray(3))
    s.opt_state.loss_scale.step.delete()   # as a donation leaves it
    assert not fresh_state.is_new(s.step, s.opt_state)
    assert fresh_state.concrete_owner(tx) is s   # found; its step is alive
    s.step.delete()
    assert fresh_state.concrete_owner(tx) is None

    class Raises:   # someone else's object in a caller's frame
      @property
      def tx(self):
        raise ValueError("not an owner")
    here = Raises()   # read by concrete_owner from this frame
    assert fresh_state.concrete_owner(tx) is None, here


def test_nnx_optimizer_and_zero1_train_state_warn_too():
  from flax import nnx
  import zero1_jax.flax as z1flax

  class Lin(nnx.Module):
    def __init__(self):
      self.l = nnx.Linear(5, 3, rngs=nnx.Rngs(0))

  @nnx.jit
  def update(model, o):
    o.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))

  with jax.set_mesh(mesh(4)):
    model = Lin()
    o = nnx.Optimizer(model, z1.zero1(opt(), axis_name="data"), wrt=nnx.Param)
    o.step[...] = 7            # the model and step restored, the optimizer new
    said = _said(lambda: update(model, o) or o.step[...])
    assert len(said) == 1 and "the training's step is 7" in said[0], said
    again = nnx.jit(lambda m, o: update.__wrapped__(m, o))
    assert not _said(lambda: again(model, o) or o.step[...])   # updated: not new
    m2 = Lin()
    fresh = nnx.Optimizer(m2, z1.zero1(opt(), axis_name="data"), wrt=nnx.Param)
    assert not _said(lambda: update(m2, fresh) or fresh.step[...])   # step 0
  # z1.flax.TrainState (inside shard_map): said once, on the host
  tx = z1.zero1(opt(), axis_name="data")
  st = z1flax.TrainState.create(apply_fn=None, params=float_part(odd_params()),
                                tx=tx, mesh=mesh(4)).replace(step=5)
  specs = z1flax.state_specs(st, mesh(4))
  g = jax.tree.map(np.ones_like, float_part(odd_params()))
  per_device = lambda s, g: s.apply_gradients(
      grads=jax.lax.pcast(g, "data", to="varying"))
  step = jax.jit(jax.shard_map(per_device, mesh=mesh(4),
                               in_specs=(specs, P()), out_specs=specs))
  said = _said(lambda: step(st, g).step)
  assert len(said) == 1 and "the training's step is 5" in said[0], said


def test_zero1_checkpointer_names_the_conversion(saved, tmp_path):
  """An optax run's orbax checkpoint given to z1.checkpoint: not zero1's,
  and what converts it."""
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(tmp_path / "optax") as m:
    m.save(3, args=ocp.args.StandardSave(dict(saved)))
  tx = z1.zero1(opt(), axis_name="data")
  with pytest.raises(z1.checkpoint.UnreadableCheckpointError,
                     match=r"not a zero1_jax checkpoint .* z1.from_optax_state"
                           r"\(tx, optax_state, params\).*"
                           r"z1.flax.restore_checkpoint"):
    z1.checkpoint.Checkpointer(tmp_path / "optax").restore(
        None, tx, saved["params"], mesh(4))
