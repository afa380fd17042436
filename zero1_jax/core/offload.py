"""Optimizer offload: zero1's sharded state in host memory between steps.

With ``zero1(..., offload=True)`` (DeepSpeed's ``"offload_optimizer":
{"device": "cpu"}``) every state leaf sharded over the data axis (the master
shards of bf16/fp16 params, and the inner optimizer's parameter-shaped
leaves: Adam's moments) lives in JAX's pinned host memory
(``memory_kind="pinned_host"``), so a device holds none of it between steps.
Host memory then holds 12 bytes per parameter / N with Adam for bf16 params
(fp32 master + two moments) and 8 / N for fp32 params (a param in its master
dtype is its own master). Replicated leaves (counts, hyperparameters,
scalar-parameter moments) stay on the device: they are bytes, not Psi.

Where the update runs: on the device, streamed. Each step moves the state
in one group of leaves at a time (at most ``bucket_bytes`` of state per
device, a leaf larger than that alone), runs the same inner update there and
writes the group back, so device memory holds one group of state at a time.
Group ``k + 1``'s transfer in is tied behind group ``k``'s result
(``lax.optimization_barrier``), so the compiler cannot fetch every group at
once. Why the device and not the host (DeepSpeed's CPU Adam runs the update
on the host): the device's own update code runs, so weights are bitwise
those of the step without offload; XLA's host computation
(``compute_on("device_host")``) is neither DeepSpeed's vectorised CPU Adam
nor every op's. The price is traffic: the state crosses the host link twice
per step (12 or 8 bytes per parameter / N each way) instead of the gradient
and the weights (MaxText's ``optimizer_memory_host_offload`` makes the same
choice, moving the whole state at once).

On the CPU backend host and device memory are one memory and XLA moves
nothing; the compiled step still says where each buffer lives (its entry
layout marks host buffers ``S(5)``: :func:`zero1_jax.inspect.memory_spaces`).

Example:
  >>> import jax, jax.numpy as jnp, optax, zero1_jax as z1
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> tx = z1.zero1(optax.adam(1e-2), axis_name="data", offload=True)
  >>> params, state = z1.init(tx, {"w": jnp.ones((4, 3))}, mesh)
  >>> state.inner[0].mu["w"].sharding.memory_kind
  'pinned_host'
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from zero1_jax.core import state_dims
from zero1_jax.core import layout as lay

HOST = "pinned_host"


def resolve(offload: Any) -> str | None:
  """``zero1(offload=)`` as a memory kind: True / ``"pinned_host"`` /
  ``"cpu"`` -> ``"pinned_host"``; False / None / ``"none"`` -> None."""
  if offload in (None, False, "none"):
    return None
  if offload in (True, HOST, "cpu"):
    return HOST
  raise ValueError(
      f"offload must be True (the sharded state in pinned host memory), "
      f"False or None, got {offload!r}. ('unpinned_host' is not offered: a "
      f"jitted step writes host state through JAX's host memory space, "
      f"which is pinned host memory.)")


def to_host(x):
  return jax.device_put(x, jax.memory.Space.Host)


def to_device(x):
  return jax.device_put(x, jax.memory.Space.Device)


def on_host(layout: lay.Layout, i: int | None) -> bool:
  """Whether state owned by param leaf ``i`` (None: owned by none) is
  offloaded: exactly the leaves sharded over the data axis."""
  return i is not None and layout.leaves[i].kind == lay.SHARD


def masters_to_host(values: list, layout: lay.Layout) -> list:
  """The sharded leaves' master values moved to host memory (those a param
  is its own master of are dropped by ``state.master_tree`` anyway)."""
  return [to_host(v) if v is not None and on_host(layout, i) else v
          for i, v in enumerate(values)]


def owners(inner: Any, layout: lay.Layout, master_dtype: Any) -> list:
  """Per leaf of ``inner``'s state (``jax.tree.flatten`` order): the param
  leaf it is shaped like, or None (:func:`.state_dims.state_shard_dims`)."""
  return state_dims.state_shard_dims(inner, layout, master_dtype)[3]


def place_state(tree: Any, own: Sequence, layout: lay.Layout) -> Any:
  """``to_host`` on the leaves of a state tree owned by sharded params."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten([to_host(x) if on_host(layout, o) else x
                            for x, o in zip(leaves, own)])


def groups(layout: lay.Layout, own: Sequence, inner_leaves: Sequence,
           masters: Sequence, budget: int) -> list[list[int]]:
  """The sharded param leaves in order, cut into groups of at most
  ``budget`` bytes of offloaded state per device (master shard + the inner
  leaves it owns); a leaf over the budget is a group of its own."""
  size = {i: 0 for i in layout.indices(lay.SHARD)}
  for x, o in zip(inner_leaves, own):
    if on_host(layout, o):
      size[o] += x.size * jnp.dtype(x.dtype).itemsize
  for i in size:
    m = masters[i]
    if m is not None:
      size[i] += m.size * jnp.dtype(m.dtype).itemsize
  out, cur, used = [], [], 0
  for i in sorted(size):
    if cur and used + size[i] > budget:
      out.append(cur)
      cur, used = [], 0
    cur.append(i)
    used += size[i]
  return out + ([cur] if cur else [])


def _empty(x):
  """``x`` with its leading dim (or, for scalars, nothing) of size zero: an
  elementwise update does nothing on it."""
  shape = jnp.shape(x)
  return jnp.zeros((0,) + tuple(shape[1:]) if shape else (0,), x.dtype)


def streamed(step: Callable, layout: lay.Layout, own: Sequence, grads: list,
             inner_state: Any, view: list, stored: Sequence[bool],
             budget: int) -> tuple[list, Any]:
  """``step(grads_list, inner_state, view_list) -> (new_view_list,
  new_inner_state)`` run one group of sharded leaves at a time.

  ``view[i]`` is leaf ``i``'s master shard: on the host where
  ``stored[i]`` and the leaf is sharded, else on the device (a param in its
  master dtype is its own master). Each group's call sees its own sharded
  leaves, every replicated leaf, and empty arrays for the other groups'
  sharded leaves (an elementwise update, which :func:`zero1_jax.init`
  verified, leaves them alone; replicated state does not depend on sharded
  values, so every group computes it alike and group 0's is kept). Returns
  the new view on the device (the caller casts it for the all-gather and
  puts the stored masters back with :func:`to_host`) and the new inner
  state (offloaded leaves back on the host).
  """
  in_leaves, treedef = jax.tree.flatten(inner_state)
  plan = groups(layout, own, in_leaves,
                [v if s else None for v, s in zip(view, stored)], budget)
  sharded = set(layout.indices(lay.SHARD))
  new_view = list(view)
  new_inner = [None] * len(in_leaves)
  prev = None
  for k, members in enumerate(plan or [[]]):
    mine = set(members)
    h_view = {i: view[i] for i in members if stored[i]}
    h_inner = {j: x for j, x in enumerate(in_leaves) if own[j] in mine}
    if prev is not None:   # this group's transfer in waits for the last's result
      (h_view, h_inner), _ = jax.lax.optimization_barrier(((h_view, h_inner),
                                                            prev))
    g_in, v_in, s_in = [], [], []
    for i, (g, v) in enumerate(zip(grads, view)):
      if i in sharded and i not in mine:
        g_in.append(None if g is None else _empty(g))
        v_in.append(None if v is None else _empty(v))
      else:
        g_in.append(g)
        v_in.append(to_device(h_view[i]) if i in h_view else v)
    for j, x in enumerate(in_leaves):
      if own[j] in mine:
        s_in.append(to_device(h_inner[j]))
      elif on_host(layout, own[j]):
        s_in.append(_empty(x))
      else:
        s_in.append(x)
    out_view, out_inner = step(g_in, treedef.unflatten(s_in), v_in)
    out_inner = jax.tree.leaves(out_inner)
    for i in members:
      new_view[i] = out_view[i]
    for j, x in enumerate(out_inner):
      if own[j] in mine:
        new_inner[j] = to_host(x)
      elif k == 0 and not on_host(layout, own[j]):
        new_inner[j] = x
    if k == 0:
      for i in set(range(len(view))) - sharded:
        new_view[i] = out_view[i]
    prev = ([out_view[i] for i in members], [out_inner[j] for j, o in
                                             enumerate(own) if o in mine])
  return new_view, treedef.unflatten(new_inner)


def _names(spec) -> set:
  out = set()
  for e in tuple(spec):
    out.update(() if e is None else (e,) if isinstance(e, str) else e)
  return out


def state_shardings(mesh: Any, specs: Any, axis: str,
                    offload: str | None) -> Any:
  """``NamedSharding``s of a ``Zero1State`` from its ``PartitionSpec``s:
  with ``offload``, the master and inner leaves sharded over ``axis`` in
  that memory kind; everything else (and all without offload) on the device."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  is_spec = lambda x: isinstance(x, P)

  def one(kind_of):
    return lambda s: NamedSharding(mesh, s, memory_kind=kind_of(s))

  device = lambda s: None
  host = (lambda s: offload if axis in _names(s) else None) if offload else device
  return type(specs)(
      jax.tree.map(one(host), specs.master, is_leaf=is_spec),
      jax.tree.map(one(host), specs.inner, is_leaf=is_spec),
      jax.tree.map(one(device), specs.loss_scale, is_leaf=is_spec))


UNDONE = (
    "zero1: offload=True, but {count} optimizer-state leaves sharded over the "
    "data axis (e.g. {where}) reached tx.update in device memory: the program "
    "placed them there (jit out_shardings / in_shardings without "
    "memory_kind), so the state takes device memory again. Place the state "
    "as tx.init returned it: shardings taken from the state itself "
    "(jax.tree.map(lambda x: x.sharding, opt_state)), or "
    "NamedSharding(mesh, spec, memory_kind='pinned_host') for those leaves "
    "(z1.state_shardings(tx, params, mesh) gives them).")


def check_placed(state: Any, specs: Any, axis: str) -> None:
  """Warns (:data:`UNDONE`) when leaves planned for host memory arrive in
  device memory (read from the arrays, or the tracers' memory space)."""
  import warnings
  from jax.sharding import PartitionSpec as P
  got = jax.tree_util.tree_flatten_with_path(state._replace(loss_scale=None))[0]
  want = jax.tree.leaves(specs._replace(loss_scale=None),
                         is_leaf=lambda x: isinstance(x, P))
  wrong = ["opt_state" + jax.tree_util.keystr(path)
           for (path, x), s in zip(got, want)
           if axis in _names(s)
           and getattr(jax.typeof(x), "memory_space",
                       None) == jax.memory.Space.Device]
  if wrong:
    warnings.warn(UNDONE.format(count=len(wrong), where=wrong[0]),
                  UserWarning, stacklevel=5)
