"""Optimizer offload (``zero1(..., offload=True)``, DeepSpeed's
``offload_optimizer: {"device": "cpu"}``): the sharded state in pinned host
memory, the update streamed through the device one group at a time.

The update runs the same device code as without offload, so with N >= 2
(a collective between the backward and the update) every check against the
non-offloaded run is bitwise: any difference is a bug (a group updated twice
or not at all, a replicated leaf taken from the wrong group, a leaf's state
mixed with another's), not rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero1_jax as z1
from zero1_jax import inspect as zinspect
from zero1_jax.core import layout as lay
from zero1_jax.core import offload as ofl

from helpers import (assert_close, assert_equal, batch, float_part, loss_fn,
                     mesh, odd_params)
from tolerances import FP32_REORDER

HOST = "pinned_host"


def _params():
  """The suite's odd shapes (scalar, zero-size and integer leaves), with the
  dense kernel in bf16 so one sharded leaf keeps a stored fp32 master."""
  p = odd_params()
  p["dense"]["kernel"] = p["dense"]["kernel"].astype(jnp.bfloat16)
  return p


def _loss(p, b):
  q = dict(p, dense=dict(p["dense"], kernel=p["dense"]["kernel"].astype(
      jnp.float32)))
  return loss_fn(q, b)


def _kinds(state):
  return jax.tree.map(lambda x: x.sharding.memory_kind, state)


def _run(opt, n, offload, steps=3, bucket_bytes=64, stage=1):
  make = z1.zero2 if stage == 2 else z1.zero1
  tx = make(opt, axis_name="data", offload=offload, bucket_bytes=bucket_bytes)
  params, state = z1.init(tx, _params(), mesh(n))
  step = z1.train_step(_loss, tx, mesh(n))
  for i in range(steps):
    params, state, _ = step(params, state, batch(16, seed=i))
  return tx, params, state


def _assert_placed(tx, state, n):
  """Every master / inner leaf sharded over the data axis is in pinned host
  memory, everything else (counts, scalar moments, loss scale) on the
  device: as z1.state_shardings says."""
  want = z1.state_shardings(tx, _params(), mesh(n))
  got = _kinds(state)
  assert jax.tree.leaves(got) == [s.memory_kind for s in jax.tree.leaves(want)]
  specs = jax.tree.leaves(jax.tree.map(lambda s: s.spec, want,
                                       is_leaf=lambda x: hasattr(x, "spec")))
  for kind, spec in zip(jax.tree.leaves(got), specs):
    assert kind == (HOST if "data" in jax.tree.leaves(tuple(spec)) else
                    "device"), (kind, spec)
  assert HOST in jax.tree.leaves(got) and "device" in jax.tree.leaves(got)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("opt", [optax.adamw(1e-2, weight_decay=0.1),
                                 optax.sgd(0.1, momentum=0.9, nesterov=True)],
                         ids=["adamw", "nesterov"])
def test_offloaded_state_trains_bitwise_as_on_the_device(opt, n):
  """64-byte groups: every sharded leaf is streamed alone, so a group that
  saw another's state or a replicated leaf kept from the wrong group shows."""
  tx, p_off, s_off = _run(opt, n, True)
  _, p_dev, s_dev = _run(opt, n, False)
  if n == 1:
    # One device: no collective separates the backward from the update, so
    # XLA fuses the gradient's batch sum into the update, and differently
    # once the update is cut into groups (FMA contraction, summation order):
    # the reordering noise FP32_REORDER bounds (measured: 1 ulp in 2 of 30
    # weights). A group updated twice or mixed with another's state moves a
    # weight by ~lr = 1e-2, four orders above it.
    assert_close(float_part(p_off), float_part(p_dev), FP32_REORDER, "N=1")
  else:   # the same device code on the same reduced gradients: bitwise
    assert_equal(float_part(p_off), float_part(p_dev), "params")
    assert_equal(jax.tree.map(np.asarray, s_off),
                 jax.tree.map(np.asarray, s_dev), "state")
  _assert_placed(tx, s_off, n)


def test_zero2_and_one_big_group_bitwise_too():
  """Stage 2 (gradients reduced in the backward) and the default 64 MiB
  group (the whole state in one transfer each way)."""
  for stage, bucket in ((2, 64), (1, 1 << 26)):
    tx, p_off, s_off = _run(optax.adam(1e-2), 4, True, bucket_bytes=bucket,
                            stage=stage)
    _, p_dev, _ = _run(optax.adam(1e-2), 4, False, bucket_bytes=bucket,
                       stage=stage)
    assert_equal(float_part(p_off), float_part(p_dev), f"stage {stage}")
    _assert_placed(tx, s_off, 4)


def test_plain_jit_loop_keeps_the_state_on_the_host():
  """tx.init / tx.update in a user's own jax.jit step (no shard_map)."""
  out = {}
  for offload in (True, False):
    with jax.set_mesh(mesh(4)):
      tx = z1.zero1(optax.adam(1e-2), axis_name="data", offload=offload)
      p = float_part(_params())
      s = tx.init(p)

      @jax.jit
      def step(p, s, b):
        u, s = tx.update(jax.grad(_loss)(p, b), s, p)
        return optax.apply_updates(p, u), s

      for i in range(3):
        p, s = step(p, s, batch(16, seed=i))
    out[offload] = p
    if offload:
      assert s.inner[0].mu["dense"]["kernel"].sharding.memory_kind == HOST
      assert s.master["dense"]["kernel"].sharding.memory_kind == HOST
  assert_equal(out[True], out[False], "plain jit")


def _shard_bytes(params, n, per_param):
  """Bytes per device of ``per_param`` bytes for every sharded leaf's
  padded shard (layout.plan: the same split the state uses)."""
  plan = lay.plan(params, n)
  return sum(int(np.prod(s.shard_shape)) * per_param(s.dtype)
             for s in plan.leaves if s.kind == lay.SHARD)


def test_compiled_step_holds_12_or_8_bytes_per_parameter_over_n_on_the_host():
  """Read from the compiled step's entry layout (host buffers are S(5)):
  Adam keeps 12 bytes / N per bf16 parameter (master + two moments) and
  8 / N per fp32 one (its own master) on the host, in and out; the device
  arguments are exactly the non-offloaded step's minus those bytes."""
  n = 4
  params = _params()
  want = _shard_bytes(params, n, lambda dt: 12 if dt == jnp.bfloat16 else 8)
  got = {}
  for offload in (True, False):
    tx = z1.zero1(optax.adam(1e-2), axis_name="data", offload=offload)
    p, s = z1.init(tx, params, mesh(n))
    compiled = z1.train_step(_loss, tx, mesh(n)).lower(
        p, s, batch(16)).compile()
    got[offload] = zinspect.memory_spaces(compiled)
  assert got[True]["host"] == {"arguments": want, "outputs": want}
  assert got[False]["host"] == {"arguments": 0, "outputs": 0}
  for part in ("arguments", "outputs"):
    assert (got[True]["device"][part]
            == got[False]["device"][part] - want), part


def test_groups_hold_at_most_one_bucket_and_are_chained():
  """The plan cuts the sharded leaves into groups of <= bucket_bytes of
  state per device (a larger leaf alone), and each group's transfer in is
  tied behind the previous group's result: one optimization_barrier per
  group after the first in the step."""
  n, budget = 4, 100
  params = float_part(odd_params())   # fp32: no stored masters, moments only
  layout = lay.plan(params, n)
  tx = z1.zero1(optax.adam(1e-2), axis_name="data", offload=True,
                bucket_bytes=budget)
  own = ofl.owners(tx.inner, layout, jnp.float32)
  shards = [jax.ShapeDtypeStruct(s.shard_shape, jnp.float32)
            for s in layout.leaves]
  inner = jax.tree.leaves(jax.eval_shape(tx.inner.init,
                                         layout.inner_tree(shards)))
  masters = [None] * len(layout.leaves)
  plan = ofl.groups(layout, own, inner, masters, budget)
  assert sorted(i for g in plan for i in g) == layout.indices(lay.SHARD)
  size = lambda i: 8 * int(np.prod(layout.leaves[i].shard_shape))
  for g in plan:
    assert len(g) == 1 or sum(map(size, g)) <= budget, (g, budget)
  assert len(plan) > 1
  p, s = z1.init(tx, params, mesh(n))
  text = z1.train_step(_loss, tx, mesh(n)).lower(p, s, batch(16)).as_text()
  assert text.count("stablehlo.optimization_barrier") == len(plan) - 1


def test_checkpoint_from_host_state_restores_at_another_n(tmp_path):
  """Saved from host-resident state at N=4; restored at N=2 into host memory
  (offload) or device memory (none), each then steps as the other."""
  from zero1_jax.checkpoint import Checkpointer
  tx, p4, s4 = _run(optax.adam(1e-2), 4, True, steps=2)
  with Checkpointer(tmp_path) as ck:
    ck.save(2, p4, s4)
    ck.wait()
  after = {}
  for offload in (True, False):
    tx2 = z1.zero1(optax.adam(1e-2), axis_name="data", offload=offload,
                   bucket_bytes=64)
    with Checkpointer(tmp_path) as ck:
      p2, s2, _ = ck.restore(2, tx2, _params(), mesh(2))
    if offload:
      _assert_placed(tx2, s2, 2)
    else:
      assert set(jax.tree.leaves(_kinds(s2))) == {"device"}
    p2, s2, _ = z1.train_step(_loss, tx2, mesh(2))(p2, s2, batch(16, seed=7))
    after[offload] = p2
  assert_equal(float_part(after[True]), float_part(after[False]), "restored")


def test_offload_values():
  assert ofl.resolve(True) == ofl.resolve("cpu") == HOST
  assert ofl.resolve(False) is None and ofl.resolve(None) is None
  with pytest.raises(ValueError, match="offload must be True"):
    z1.zero1(optax.adam(1e-3), axis_name="data", offload="unpinned_host")


def test_zero1_train_says_where_the_state_lives(tmp_path, capsys):
  """A DeepSpeed JSON with offload_optimizer cpu: zero1-train trains, and
  its After line gives the bytes left on the device and those in pinned
  host memory (the training itself is checked bitwise above)."""
  import json
  import os
  from helpers import train_cli
  here = os.path.dirname(__file__)
  cfg = json.load(open(os.path.join(here, "..", "experiments", "configs",
                                    "ds_zero_offload.json")))
  cfg.update(train_batch_size=4)
  assert train_cli(tmp_path, cfg, max_steps=2) == 0
  out = capsys.readouterr().out
  after = [l for l in out.splitlines() if "After" in l]
  assert after and "GiB in pinned host memory" in after[0], out
  assert "offload_optimizer: cpu" in after[0]
  assert "(counts, scalars) on the device" in after[0]


def test_a_program_that_moves_the_state_to_the_device_is_told():
  """A jit step whose out_shardings name no memory kind (the specs copied
  from the state, as flax programs derive them) puts the offloaded state
  back in device memory; the next tx.update says so, with the fix."""
  mesh4 = mesh(4)
  with jax.set_mesh(mesh4):
    tx = z1.zero1(optax.adam(1e-2), axis_name="data", offload=True)
    p = float_part(odd_params())
    s = tx.init(p)
    on_device = jax.tree.map(
        lambda x: jax.sharding.NamedSharding(mesh4, x.sharding.spec), s)

    def step(p, s, b):
      u, s = tx.update(jax.grad(loss_fn)(p, b), s, p)
      return optax.apply_updates(p, u), s

    import warnings
    with warnings.catch_warnings():
      warnings.simplefilter("error")   # as tx.init placed it: nothing said
      p, s = jax.jit(step, out_shardings=(None, on_device))(p, s, batch(16))
    assert s.inner[0].mu["dense"]["kernel"].sharding.memory_kind == "device"
    with pytest.warns(UserWarning, match=r"offload=True, but \d+ optimizer-"
                      r"state leaves .* reached tx.update in device memory.*"
                      r"memory_kind='pinned_host'"):
      jax.jit(step)(p, s, batch(16))


def test_2d_mesh_tensor_parallel_params_offload_bitwise():
  """("data", "model") mesh, params sharded over "model": the state's
  blocks split over "data" go to the host, and training is bitwise the
  non-offloaded 2-D run."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  msh = jax.make_mesh((2, 2), ("data", "model"),
                      axis_types=(AxisType.Auto,) * 2,
                      devices=jax.devices()[:4])
  r = np.random.default_rng(0)
  params = {"w1": jnp.asarray(r.normal(size=(5, 8)), jnp.float32),
            "w2": jnp.asarray(r.normal(size=(8, 3)), jnp.bfloat16)}
  specs = {"w1": P(None, "model"), "w2": P("model", None)}
  placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(msh, s)),
                        params, specs)

  def loss2(p, b):
    h = jnp.tanh(b["x"] @ p["w1"])
    return jnp.mean((h @ p["w2"].astype(jnp.float32) - b["y"]) ** 2)

  out = {}
  for offload in (True, False):
    tx = z1.zero1(optax.adam(1e-2), axis_name="data", offload=offload,
                  bucket_bytes=64)
    p, s = z1.init(tx, placed, msh)
    step = z1.train_step(loss2, tx, msh)
    for i in range(3):
      b = batch(16, seed=i)
      p, s, _ = step(p, s, {"x": b["x"], "y": b["y"]})
    out[offload] = (p, s)
    if offload:
      kinds = _kinds(s)
      assert kinds.inner[0].mu["w1"] == HOST and kinds.master["w2"] == HOST
      assert p["w1"].sharding.spec == P(None, "model")
  assert_equal(out[True][0], out[False][0], "2-D")


def test_fp16_overflow_skips_keep_the_host_state_bitwise():
  """fp16 params under the dynamic loss scale (2^16 first: the first steps
  overflow and are skipped): a skipped step keeps the old master and moments,
  read back from the host group by group, exactly as without offload."""
  def run(offload):
    tx = z1.zero1(optax.adam(1e-2), axis_name="data", offload=offload,
                  bucket_bytes=64)
    p = jax.tree.map(lambda x: x.astype(jnp.float16)
                     if jnp.issubdtype(x.dtype, jnp.floating) else x,
                     odd_params())
    params, state = z1.init(tx, p, mesh(4))
    step = z1.train_step(loss_fn, tx, mesh(4))
    skipped = []
    for i in range(4):
      params, state, m = step(params, state, batch(16, seed=i))
      skipped.append(bool(m["skipped"]))
    return params, state, skipped
  p_off, s_off, sk_off = run(True)
  p_dev, s_dev, sk_dev = run(False)
  assert sk_off == sk_dev and any(sk_dev) and not all(sk_dev), sk_dev
  assert_equal(float_part(p_off), float_part(p_dev), "fp16")
  assert_equal(jax.tree.map(np.asarray, s_off.master),
               jax.tree.map(np.asarray, s_dev.master), "masters")
