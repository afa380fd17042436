"""Programs that derive their jit shardings from an abstract state's Flax
metadata, with zero1 changing only the optimizer line (passing the mesh):
1/N of the optimizer state per device, optax's weights.

Two patterns, written here in the style of the programs that use them:

* lm1b (flax's examples/lm1b): params boxed by ``nn.with_logical_partitioning``;
  ``jax.eval_shape`` of the init outside the logical-axis-rules context;
  ``nn.get_partition_spec`` -> ``nn.logical_to_mesh_sharding(..., rules)``
  under the rules, with rules that map no logical name to the data axis; a
  jit of the init with those ``out_shardings``; the LogicallyPartitioned
  boxes taken off; a step jitted with them as ``in_shardings`` /
  ``out_shardings``.
* nanodo (google-deepmind/nanodo's data-parallel mode): unannotated params,
  ``nn.get_sharding(jax.eval_shape(init), mesh)`` with no mesh context, the
  init jitted with those ``out_shardings``, a step whose loss closes over the
  batch (given ``P()`` and constrained to the data axis inside).

Weights bound: as tests/test_flax_programs.py (the same plain-jit mode and
Adam chain): 36 K u relative to each leaf's scale over K steps.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from helpers import assert_close

K = 6
RTOL = 36 * K * 2.0 ** -24
N = 8
VOCAB, EMBED, LEN = 13, 8, 4          # 13: padded to 16 over 8 devices
# lm1b's rules: nothing maps to the data axis (its batch is placed by mesh
# axis names directly).
RULES = (("mlp", "tensor"), ("vocab", "tensor"), ("embed", "fsdp"))


class TinyLM(nn.Module):
  logical: bool

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.normal(0.5)
    wrap = (nn.with_logical_partitioning if self.logical
            else lambda f, _: f)
    x = nn.Embed(VOCAB, EMBED, embedding_init=wrap(init, ("vocab", "embed")))(tokens)
    x = nn.Dense(6, kernel_init=wrap(init, ("embed", "mlp")),
                 bias_init=wrap(nn.initializers.zeros, ("mlp",)))(x)
    return nn.Dense(VOCAB, kernel_init=wrap(init, ("mlp", "vocab")))(jnp.tanh(x))


def loss_of(apply_fn, tokens):
  def loss(params):
    logits = apply_fn({"params": params}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], tokens[:, 1:]).mean()
  return loss


def batches():
  r = np.random.default_rng(0)
  return [r.integers(0, VOCAB, (2 * N, LEN)).astype(np.int32) for _ in range(K)]


def optimizer(use_zero1, mesh):
  tx = optax.adamw(3e-2, weight_decay=0.1)
  return z1.zero1(tx, axis_name="data", mesh=mesh) if use_zero1 else tx


def run_lm1b_style(use_zero1):
  mesh = jax.make_mesh((N, 1, 1), ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  model, tx = TinyLM(logical=True), optimizer(use_zero1, mesh)

  def init_state(key):
    params = model.init(key, jnp.ones((1, LEN), jnp.int32))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  abstract = jax.eval_shape(init_state, jax.random.key(0))
  logical = nn.get_partition_spec(abstract)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    shardings = nn.logical_to_mesh_sharding(logical, mesh, RULES)
    state = jax.jit(init_state, out_shardings=shardings)(jax.random.key(0))
  state = jax.tree.map(
      lambda x: x.unbox() if isinstance(x, nn.LogicallyPartitioned) else x,
      state, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  data = NamedSharding(mesh, P("data"))

  def train_step(state, tokens):
    grads = jax.grad(loss_of(state.apply_fn, tokens))(state.params)
    return state.apply_gradients(grads=grads)

  step = jax.jit(train_step, in_shardings=(shardings, data),
                 out_shardings=shardings)
  for tokens in batches():
    state = step(state, tokens)
  return state


def run_nanodo_style(use_zero1):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("data",))
  model = TinyLM(logical=False)

  def init(key):
    params = model.init(key, jnp.ones((1, LEN), jnp.int32))["params"]
    return TrainState.create(apply_fn=model.apply, params=params,
                             tx=optimizer(use_zero1, mesh))

  shardings = nn.get_sharding(jax.eval_shape(init, jax.random.key(0)), mesh)
  state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))

  def train_step(state, tokens):
    tokens = jax.lax.with_sharding_constraint(tokens, NamedSharding(mesh, P("data")))
    loss, grads = jax.value_and_grad(loss_of(state.apply_fn, tokens))(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    return state.replace(step=state.step + 1, opt_state=opt_state,
                         params=optax.apply_updates(state.params, updates)), loss

  rep = NamedSharding(mesh, P())
  step = jax.jit(train_step, in_shardings=(shardings, rep),
                 out_shardings=(shardings, rep))
  for tokens in batches():
    state, _ = step(state, tokens)
  return state


def device0_bytes(tree) -> int:
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree)
             for s in x.addressable_shards if s.device == dev)


@pytest.fixture(scope="module", params=["lm1b", "nanodo"])
def runs(request):
  run = {"lm1b": run_lm1b_style, "nanodo": run_nanodo_style}[request.param]
  out = {}
  for use in (False, True):
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      out[use] = run(use), [str(x.message) for x in w]
  return request.param, out


def test_one_line_gives_a_nth_of_the_state_and_optax_weights(runs):
  name, out = runs
  (ref, _), (got, said) = out[False], out[True]
  assert not [m for m in said if "zero1" in m], said
  params = nn.meta.unbox(ref.params)
  assert_close(nn.meta.unbox(got.params), params, RTOL, f"{name} vs optax ")
  optax_bytes, zero1_bytes = device0_bytes(ref.opt_state), device0_bytes(got.opt_state)
  # optax's state is whole on every device (params and moments replicated).
  assert optax_bytes == sum(x.nbytes for x in jax.tree.leaves(ref.opt_state))
  # zero1's: each moment leaf (the param padded on one dim to a multiple of
  # N) split N ways on device 0, the scalars (count, loss-scale state) whole.
  leaves = jax.tree.leaves(got.opt_state)
  for x in leaves:
    if x.ndim:
      assert x.addressable_shards[0].data.size * N == x.size, (
          name, x.shape, x.sharding)
  assert zero1_bytes == sum(x.nbytes // N if x.ndim else x.nbytes
                            for x in leaves), (zero1_bytes, optax_bytes)
  assert zero1_bytes * N < optax_bytes * 1.5, (zero1_bytes, optax_bytes)


def _tutorial_program(state_in, state_out):
  """JAX's distributed-arrays tutorial style: a params dict placed
  replicated, a step jitted with explicit in_shardings / out_shardings."""
  mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  r = np.random.default_rng(0)
  params = jax.device_put({"w": r.normal(size=(12, 5)).astype(np.float32),
                           "b": np.zeros(5, np.float32)}, rep)
  tx = z1.zero1(optax.adam(1e-2), axis_name="data")
  opt_state = tx.init(params)

  def step(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  shard = {"P()": rep, "as placed": None}
  step = jax.jit(step, in_shardings=(rep, shard[state_in], rows),
                 out_shardings=(rep, shard[state_out]))
  x = jax.device_put(r.normal(size=(16, 12)).astype(np.float32), rows)
  return step, params, opt_state, x


def test_tutorial_out_shardings_replicating_the_state_warn_with_the_fix():
  """out_shardings give the state P(): the step that receives it warns,
  says the whole state is replicated and names the shardings to give it."""
  step, params, opt_state, x = _tutorial_program("as placed", "P()")
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # the first step receives zero1's placement
    params, opt_state = step(params, opt_state, x)
  with pytest.warns(UserWarning, match="places zero1's optimizer state") as w:
    step(params, opt_state, x)
  msg = next(str(m.message) for m in w if "zero1" in str(m.message))
  # At the program's line (here, its tx.update), though on Auto axes the
  # report comes from XLA's compile, where jax 0.10 runs it with none of the
  # program's frames on the stack.
  assert [m.filename for m in w if "zero1" in str(m.message)] == [__file__], [
      (m.filename, m.lineno) for m in w]
  assert "Every misplaced leaf is whole on each device" in msg, msg
  assert "in_shardings / out_shardings" in msg, msg
  assert "jax.tree.map(lambda x: x.sharding, state)" in msg, msg


def test_tutorial_in_shardings_replicating_the_state_is_named_by_zero1():
  """in_shardings P() against the state tx.init placed (zero1 built without
  mesh=): JAX would refuse the call after tracing; zero1's update, traced
  first, refuses it naming the state and the shardings to give it
  (tests/test_jit_in_shardings.py has the rest of this contract)."""
  step, params, opt_state, x = _tutorial_program("P()", "P()")
  with pytest.raises(ValueError, match=r"^zero1: this jit's in_shardings give "
                     r"zero1's optimizer state.*lambda x: x\.sharding"):
    step(params, opt_state, x)


@pytest.mark.parametrize("where", ["eager", "jit"])
def test_replicated_state_on_an_explicit_mesh_without_set_mesh_warns_and_runs(where):
  """jax.make_mesh's Explicit axes, no jax.set_mesh, the state device_put
  P() as the params are: tx.update warns with the fix (not JAX's shard_map
  spec error), reshards it to the plan and returns optax's updates."""
  mesh = jax.make_mesh((N,), ("data",))
  rep = NamedSharding(mesh, P())
  params = jax.device_put({"w": np.linspace(-1, 1, 64, dtype=np.float32).reshape(16, 4)}, rep)
  grads = jax.device_put({"w": np.linspace(0.5, -0.25, 64, dtype=np.float32).reshape(16, 4)}, rep)
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh)
  state = jax.device_put(tx.init(params), rep)
  update = tx.update if where == "eager" else jax.jit(tx.update)
  with pytest.warns(UserWarning, match="Every misplaced leaf is whole on each device"):
    u, state = update(grads, state, params)
  ref = optax.adam(1e-2)
  want, _ = ref.update(grads, ref.init(params), params)
  # One Adam step on the same gradients: the same element-wise arithmetic,
  # at most an ulp of |u| <= lr apart (the step's own rounding, fused or not).
  np.testing.assert_allclose(u["w"], want["w"], rtol=0, atol=2e-9)
  for x in jax.tree.leaves(state):   # the moments back on zero1's plan
    if x.ndim:
      assert x.addressable_shards[0].data.size * N == x.size, x.sharding


class FsdpLM(nn.Module):
  """nanodo's FSDP mode: kernels annotated over the data axis itself."""

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.normal(0.5)
    x = nn.Embed(VOCAB, 16, embedding_init=nn.with_partitioning(
        init, (None, "data")))(tokens)
    return nn.Dense(VOCAB, use_bias=False, kernel_init=nn.with_partitioning(
        init, ("data", None)))(x)


def test_fsdp_params_keep_optax_and_are_refused_naming_it():
  """Params sharded over the data axis: optax's state already follows them,
  1/N per device (the measurement the refusal rests on), and zero1 refuses
  them saying so."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("data",))
  model = FsdpLM()

  def make_init(tx):
    def init(key):
      params = model.init(key, jnp.ones((1, LEN), jnp.int32))["params"]
      return TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return init

  init = make_init(optax.adamw(1e-2))
  shardings = nn.get_sharding(jax.eval_shape(init, jax.random.key(0)), mesh)
  state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
  for x in jax.tree.leaves(state.opt_state):
    if x.ndim:
      assert x.addressable_shards[0].data.size * N == x.size, x.sharding
  with pytest.raises(ValueError, match=r"sharded over the data axis 'data'.*"
                     r"FSDP.*optax's own state already follows their "
                     r"sharding.*keep the plain optax optimizer"):
    jax.eval_shape(make_init(z1.zero1(optax.adamw(1e-2), axis_name="data",
                                      mesh=mesh)), jax.random.key(0))


def test_regex_specs_of_the_abstract_state_fit_the_init_under_a_legacy_mesh():
  """EasyLM's pattern: ``jax.eval_shape`` of the init outside any mesh, its
  regex rules mapped over that abstract state's paths (walking into
  zero1's boxes), then the init pjitted under the legacy ``with mesh:``
  with those specs as ``out_shardings``. The pjit sets the abstract mesh
  inside, where zero1 made the state bare, so JAX failed with a "pytree
  structure error" naming no zero1. Both now have the same structure; the
  regex rules' ``P('fsdp', 'mp')`` replicates the state, which zero1 then
  names at the step."""
  import re
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)   # EasyLM's pjit
    from jax.experimental.pjit import pjit
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(N, 1, 1),
                           ("dp", "fsdp", "mp"))
  model = nn.Dense(8)
  tx = z1.zero1(optax.adamw(1e-3), axis_name="dp", mesh=mesh)
  init = lambda key: TrainState.create(
      params=model.init(key, jnp.zeros((4, 8))), tx=tx, apply_fn=None)

  def regex_specs(tree):
    def spec(path, leaf):
      name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                      for k in path)
      return P() if not leaf.shape else (
          P("fsdp", "mp") if re.search("kernel", name) else P(None))
    return jax.tree_util.tree_map_with_path(spec, tree)

  shapes = jax.eval_shape(init, jax.random.key(0))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)   # pjit, `with mesh:`
    with mesh:
      state = pjit(init, out_shardings=regex_specs(shapes))(jax.random.key(0))
  assert (jax.tree.structure(state.opt_state)
          == jax.tree.structure(shapes.opt_state))
  x = jax.device_put(jnp.ones((N, 8)), NamedSharding(mesh, P("dp")))
  step = jax.jit(lambda s, x: s.apply_gradients(grads=jax.grad(
      lambda p: jnp.mean(model.apply(p, x) ** 2))(s.params)))
  with pytest.warns(UserWarning, match="places zero1's optimizer state other "
                    "than zero1 planned"):
    step(state, x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Named:
  """A leaf container of the program's own, as haliax's ``NamedArray``: an
  array and its axis names (static)."""
  array: jax.Array
  axes: tuple = dataclasses.field(metadata=dict(static=True))


def test_state_in_the_programs_own_containers_is_not_boxed():
  """zero1(mesh=) outside jax.set_mesh boxes the sharded state leaves for
  flax's readers only where the params sit in dicts and lists (nanodo,
  above). In a container of the program's own (levanter's params hold
  haliax NamedArrays), each state leaf stays the array the program
  expects there: levanter's checkpoint saves the array-like leaves of its
  NamedArrays (a box was skipped: the moments were not saved), and an
  eager init still places the state 1/N."""
  mesh = jax.make_mesh((N,), ("data",))
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh)
  params = {"w": Named(jnp.ones((16, 8)), ("embed", "mlp")),
            "b": Named(jnp.zeros((8,)), ("mlp",))}
  is_named = lambda x: isinstance(x, Named)
  held = [n.array for n in jax.tree.leaves(jax.eval_shape(tx.init, params),
                                           is_leaf=is_named)
          if is_named(n) and n.array is not None]
  assert len(held) == 4, held                    # mu and nu of w and b
  assert all(isinstance(a, jax.ShapeDtypeStruct) for a in held), held
  nanodo = jax.eval_shape(tx.init, {"w": jnp.ones((16, 8))})
  is_box = z1.core.boxes.is_state_box
  assert any(map(is_box, jax.tree.leaves(nanodo, is_leaf=is_box))), nanodo
  state = tx.init(params)
  moments = 2 * 4 * (16 * 8 + 8)      # divide by 8: no padding
  scalars = sum(a.nbytes for a in jax.tree.leaves(state) if a.ndim == 0)
  assert device0_bytes(state) - scalars == moments // N, state
