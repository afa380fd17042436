"""zero1 under ``jax.pmap``, as flax's pmap examples (imagenet, wmt) write
their steps: the program pmean's its gradients and only the optimizer line
changes. Inside pmap the data axis is bound, as inside shard_map, so each
device holds its own 1/N shards of the state: made inside pmap
(``jax.pmap(tx.init)``, ``TrainState.create`` inside it) and mapped over
the devices (``in_axes=0``). A state handed whole to every device
(``in_axes=None``, a state made on a mesh or with ``mesh=``) is refused with
the fix; before, its moments broadcast against the gradient's shard and
the weights came out wrong with no error. A ``TrainState`` created before
pmap with no mesh is refused naming the pmap fix first, and one device's
shards copied to every device (flax's ``unreplicate`` then ``replicate``)
are said at the next step traced.

Tolerance: per leaf ``max|got - ref| <= 1e-6 * max|ref|`` (helpers), the
fp32 floor of test_equivalence.py. zero1 averages the N pmean'd gradients
again: N equal fp32 values summed round at most once per add (N - 1 = 3)
and the division by N = 4 is exact, so each gradient element is within a
few ulps of optax's, and Adam's m / sqrt(v) carries that relative error
into steps of 1e-2 (measured: 8.1e-8 of max|w| after 5 steps). The kernel
is drawn at scale 0.1 so that tanh is not saturated: saturated, it leaves
gradients near 0 whose rounding Adam turns into whole steps (5e-6 at
scale 1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding, PartitionSpec as P

import zero1_jax as z1
from helpers import assert_close, mesh

N, STEPS = 4, 5
DEVS = jax.devices()[:N]
R = np.random.default_rng(0)
PARAMS = {"w": jnp.asarray(R.normal(size=(64, 31)) * 0.1, jnp.float32),
          "b": jnp.asarray(R.normal(size=(31,)), jnp.float32)}
X = jnp.asarray(R.normal(size=(N, 2, 64)), jnp.float32)   # a batch per device
Y = jnp.asarray(R.normal(size=(N, 2, 31)), jnp.float32)
INNER = lambda: optax.adam(1e-2)


def loss(p, x, y):
  return jnp.mean((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)


def replicate(tree):
  """One copy per device, stacked, as pmap takes it."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (N,) + a.shape), tree)


def device0_bytes(tree) -> int:
  return sum(s.data.nbytes for x in jax.tree.leaves(tree)
             for s in x.addressable_shards if s.device == DEVS[0])


def raw_loop(tx):
  """``tx.init`` and ``tx.update`` inside pmap: (params of device 0, state)."""
  params = replicate(PARAMS)
  state = jax.pmap(tx.init, axis_name="batch", devices=DEVS)(params)

  def step(p, s, x, y):
    g = jax.lax.pmean(jax.grad(loss)(p, x, y), "batch")
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  pstep = jax.pmap(step, axis_name="batch", devices=DEVS)
  for _ in range(STEPS):
    params, state = pstep(params, state, X, Y)
  return jax.tree.map(lambda a: a[0], params), state


def train_state_loop(tx):
  """flax's TrainState made inside pmap, stepped by ``apply_gradients``."""
  create = jax.pmap(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx),
                    axis_name="batch", devices=DEVS)
  state = create(replicate(PARAMS))

  def step(state, x, y):
    g = jax.lax.pmean(jax.grad(loss)(state.params, x, y), "batch")
    return state.apply_gradients(grads=g)

  pstep = jax.pmap(step, axis_name="batch", devices=DEVS)
  for _ in range(STEPS):
    state = pstep(state, X, Y)
  return jax.tree.map(lambda a: a[0], state.params), state.opt_state


@pytest.mark.parametrize("loop", [raw_loop, train_state_loop],
                         ids=["tx.update", "TrainState"])
def test_only_the_optimizer_line_changed_trains_as_optax_with_a_quarter_of_the_state(loop):
  """TrainState: before, its freshness check read the pmap-stacked step as
  a scalar and raised TypeError."""
  want, ref_state = loop(INNER())
  got, state = loop(z1.zero1(INNER(), axis_name="batch"))
  assert_close(got, want, 1e-6, "pmap ")
  # Adam's moments: 2 x 4 B x (64 x 31 + 31) for optax on every device;
  # zero1's are 1/N of them, padded (64 rows and 31 + 1 -> 32 divide by 4),
  # plus its replicated scalars (count, loss-scale state: 20 B).
  moments = 2 * 4 * (64 * 31 + 31)
  assert device0_bytes(ref_state) == moments + 4
  assert device0_bytes(state) <= 2 * 4 * (16 * 31 + 8) + 4 + 16


def step_whole_state(state):
  """imagenet's pattern: the state broadcast to every device (in_axes=None)."""
  def step(state, x, y):
    g = jax.lax.pmean(jax.grad(loss)(state.params, x, y), "batch")
    return state.apply_gradients(grads=g)

  return jax.pmap(step, in_axes=(None, 0, 0), out_axes=None,
                  axis_name="batch", devices=DEVS)(state, X, Y)


@pytest.mark.parametrize("how", ["on_a_mesh", "mesh_kwarg"])
def test_a_state_handed_whole_to_every_device_is_refused_with_the_fix(how):
  """Made on a mesh (set_mesh; restored to the host as flax's
  restore_checkpoint gives it) or with ``zero1(..., mesh=)`` (boxed leaves,
  which reached optax: TypeError), then broadcast by in_axes=None."""
  msh = mesh(N, "batch")
  if how == "on_a_mesh":
    with jax.set_mesh(msh):
      state = TrainState.create(apply_fn=None, params=PARAMS,
                                tx=z1.zero1(INNER(), axis_name="batch"))
    state = jax.device_get(state)
  else:
    state = TrainState.create(apply_fn=None, params=PARAMS, tx=z1.zero1(
        INNER(), axis_name="batch", mesh=msh))
  with pytest.raises(ValueError, match=r"opt_state\.inner\[0\]\.mu\['b'\] has "
                     r"shape \(32,\), but this device's shard of it is \(8,\).*"
                     r"jax\.pmap\(tx\.init\)"):
    step_whole_state(state)


def test_a_state_created_before_pmap_without_a_mesh_is_refused_with_the_pmap_fix():
  """flax's wmt and imagenet: ``TrainState.create`` on the host, then
  ``jax_utils.replicate``. With no mesh anywhere zero1 cannot place the
  state, and its error leads with the pmap fix (it led with ``mesh=``, which
  only reached the next error, the whole state refused inside pmap); the
  state made as it says trains as optax."""
  tx = z1.zero1(INNER(), axis_name="batch")
  with pytest.raises(ValueError, match=r"Under jax\.pmap\(\.\.\., axis_name='batch'\)"
                     r".*jax_utils\.replicate.*create the state inside pmap.*"
                     r"jax\.pmap\(lambda p: TrainState\.create\(") as e:
    TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
  assert "mesh=mesh" in str(e.value)   # the jit programs' fix is still named
  got, _ = train_state_loop(tx)        # the fix it names, as written
  assert_close(got, train_state_loop(INNER())[0], 1e-6, "pmap ")


def test_one_devices_state_copied_to_every_device_is_said_at_the_next_step():
  """flax's pmap examples save, evaluate and restore ``unreplicate(state)``
  and ``replicate`` it back: with zero1 every device then holds device 0's
  shards and trains on the wrong moments with no error (each shard has the
  right shape). The next step traced says so, naming the leaves; a state
  as pmap stacked it, and a new one (all 0), say nothing."""
  import re
  import warnings
  from flax import jax_utils
  from zero1_jax.core import copied_state

  tx = z1.zero1(INNER(), axis_name="batch")
  _, state = train_state_loop(tx)
  full = jax.pmap(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx),
                  axis_name="batch", devices=DEVS)(replicate(PARAMS))
  full = full.replace(opt_state=state)     # trained: each device its shards

  def said(st):
    def step(state, x, y):
      g = jax.lax.pmean(jax.grad(loss)(state.params, x, y), "batch")
      return state.apply_gradients(grads=g)
    copied_state._SAID.clear()
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      jax.pmap(step, axis_name="batch", devices=DEVS)(st, X, Y)   # traced anew
    return [str(x.message) for x in w if "same shard" in str(x.message)]

  copied = jax_utils.replicate(jax_utils.unreplicate(full), devices=DEVS)
  (text,) = said(copied)
  assert re.search(r"opt_state\.inner\[0\]\.mu\['b'\] and opt_state\.inner\[0\]"
                   r"\.mu\['w'\] are equal on all 4 local "
                   r"devices.*save jax\.device_get\(state\)", text), text
  assert not said(full)
  assert not said(jax.pmap(lambda p: TrainState.create(apply_fn=None, params=p, tx=tx),
                           axis_name="batch", devices=DEVS)(replicate(PARAMS)))


def test_shard_map_given_the_whole_state_is_refused_with_the_fix():
  """The same mistake in a shard_map step of one's own: in_specs P() for the
  state instead of its shardings' specs."""
  msh = mesh(N)
  tx = z1.zero1(INNER(), axis_name="data")
  with jax.set_mesh(msh):
    state = tx.init(PARAMS)

  def per_device(p, s, x, y):
    local = jax.lax.pcast(p, "data", to="varying")
    return tx.update(jax.grad(loss)(local, x[0], y[0]), s, p)

  step = jax.shard_map(per_device, mesh=msh, in_specs=(P(), P(), P("data"), P("data")),
                       out_specs=(P(), P()))
  with pytest.raises(ValueError, match=r"this device's shard of it is .*"
                     r"z1\.state_shardings"):
    jax.jit(step)(PARAMS, jax.device_get(state),
                  *jax.device_put((X, Y), NamedSharding(msh, P("data"))))
