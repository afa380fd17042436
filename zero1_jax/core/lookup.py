"""Row lookups (embeddings) read from this device's stored shard.

Where :func:`zero1_jax.train_step` keeps the params as shards between steps
(GPU, TPU), every leaf is all-gathered at the start of the next step. A
table that the forward first reads by rows (an embedding: ``table[ids]``)
makes that first gather the one nothing can hide: no compute precedes the
lookup. And where the table is tied to the output layer, its gradient is
complete only when the backward reaches the lookup, at its very end, so its
reduce-scatter is exposed too. On 8 H100s (XLA's cost model) BERT-base's
word embedding (94 MB in fp32) costs 299 µs at the start of a step and 112
µs at its end: most of what ZeRO-1 adds above a no-communication floor.

A table stored split on its columns (dim 1) needs neither for its lookups.
Each device gathers the step's token ids from every device (a few KB),
reads the rows of its own column block for all of them, and one
``all_to_all`` hands each device its own tokens' rows, all columns
(:func:`_lookup`): bytes ~ tokens x width instead of the table. The lookup's
gradient flows back the same way into the shard, summed over every
device's tokens: the reduced gradient of that block, with no
reduce-scatter. Other reads of the table (a tied output layer) still read
the gathered whole, whose gather and gradient now sit after the layers and
before them in the backward, where compute hides them.

Plain jit (:func:`zero1_jax.value_and_grad`) holds the whole table on
every device: its lookups read it with no collective, and only their
gradient goes to the blocks, by the same all-to-all in the backward
(:func:`_lookup_local`).

The loss is traced once to a jaxpr and evaluated again with those lookups
replaced (:func:`rewrite`); everything else is bound as traced. The values
are the same rows; the lookup's gradient sums the same terms in another
order (one scatter-add over all devices' tokens, instead of one per device
then across devices), so it rounds differently from the gathered path
within a few ulps of the sum of its terms' magnitudes.

Example:
  >>> import jax, jax.numpy as jnp
  >>> f = lambda p, ids: jnp.sum(p["emb"][ids] @ p["emb"].T)
  >>> p = {"emb": jnp.ones((8, 4))}
  >>> sorted(find(f, p, jnp.zeros((2, 3), jnp.int32), candidates={0}))
  [0]
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import jax
from jax.extend import core as jex_core

CALLS = ("pjit", "jit", "closed_call", "core_call")   # calls the rewrite follows


def _is_literal(v) -> bool:
  return isinstance(v, jex_core.Literal)


def is_row_lookup(eqn) -> bool:
  """Whether ``eqn`` is ``table[ids]`` on a 2-D table: whole rows, the row
  dim collapsed, the width the output's last dim."""
  if eqn.primitive.name != "gather":
    return False
  operand, indices = (v.aval for v in eqn.invars[:2])
  dn = eqn.params["dimension_numbers"]
  return (len(operand.shape) == 2 and len(indices.shape) >= 2
          and indices.shape[-1] == 1
          and tuple(dn.collapsed_slice_dims) == (0,)
          and tuple(dn.start_index_map) == (0,)
          and not tuple(getattr(dn, "operand_batching_dims", ()))
          and tuple(dn.offset_dims) == (len(indices.shape) - 1,)
          and tuple(eqn.params["slice_sizes"]) == (1, operand.shape[1]))


def _call_jaxpr(eqn):
  """The closed jaxpr of a call equation the rewrite follows, else None."""
  if eqn.primitive.name not in CALLS:
    return None
  sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if sub is None:
    return None
  return sub if hasattr(sub, "consts") else jex_core.ClosedJaxpr(sub, ())


def _found(jaxpr, positions: dict, out: set) -> None:
  positions = dict(positions)
  for eqn in jaxpr.eqns:
    src = eqn.invars[0] if eqn.invars else None
    table = src is not None and not _is_literal(src) and src in positions
    if table and is_row_lookup(eqn):
      out.add(positions[src])
    elif table and eqn.primitive.name == "convert_element_type":
      positions[eqn.outvars[0]] = positions[src]   # cast, then looked up
    sub = _call_jaxpr(eqn)
    if sub is not None:
      inner = {iv: positions[v] for iv, v in zip(sub.jaxpr.invars, eqn.invars)
               if not _is_literal(v) and v in positions}
      if inner:
        _found(sub.jaxpr, inner, out)


def find(fn: Callable, params: Any, *args: Any,
         candidates: Iterable[int]) -> frozenset[int]:
  """The leaves among ``candidates`` (``jax.tree.leaves(params)`` indices)
  that ``fn(params, *args)`` reads by row lookups (inside jitted calls
  too; not inside loops, remat or custom derivatives)."""
  leaves, treedef = jax.tree.flatten(params)
  closed = jax.make_jaxpr(lambda p, *a: fn(treedef.unflatten(p), *a))(
      leaves, *args)
  wanted = set(candidates)
  positions = {v: i for i, v in enumerate(closed.jaxpr.invars[:len(leaves)])
               if i in wanted}
  out: set[int] = set()
  _found(closed.jaxpr, positions, out)
  return frozenset(out)


def _lookup(shard: jax.Array, ids: jax.Array, eqn, axis: str) -> jax.Array:
  """``table[ids]`` from this device's column block ``shard`` of it: every
  device's ids gathered, this block's rows of them read, and each device
  handed its own rows, the blocks side by side in device order."""
  all_ids = jax.lax.all_gather(ids, axis, axis=0, tiled=True)
  rows = _read_rows(shard, all_ids, eqn)
  return jax.lax.all_to_all(rows, axis, 0, rows.ndim - 1, tiled=True)


def _read_rows(table: jax.Array, ids: jax.Array, eqn) -> jax.Array:
  """``eqn``'s row gather of ``ids`` from ``table`` (any row count)."""
  return jax.lax.gather(
      table, ids, eqn.params["dimension_numbers"], (1, table.shape[1]),
      indices_are_sorted=eqn.params["indices_are_sorted"],
      unique_indices=eqn.params["unique_indices"],
      mode=eqn.params["mode"], fill_value=eqn.params["fill_value"])


def _lookup_local(table: jax.Array, shard: jax.Array, ids: jax.Array, eqn,
                  axis: str) -> jax.Array:
  """``table[ids]`` read from the whole ``table`` (plain jit has it on every
  device), its gradient sent to the column block ``shard`` alone: the rows'
  gradient handed to their blocks' devices by one all-to-all and summed
  over every device's tokens, as :func:`_lookup`'s backward does (the same
  terms in the same order). The forward then moves nothing."""

  @jax.custom_vjp
  def rows(table, shard, ids):
    del shard
    return _read_rows(table, ids, eqn)

  def fwd(table, shard, ids):
    # the ids gathered in the forward (a few KB), where they hide
    return (rows(table, shard, ids),
            jax.lax.all_gather(ids, axis, axis=0, tiled=True))

  def bwd(all_ids, ct):
    cols = jax.lax.all_to_all(ct, axis, ct.ndim - 1, 0, tiled=True)
    _, pull = jax.vjp(lambda s: _read_rows(s, all_ids, eqn),
                      jax.numpy.zeros(shard.shape, shard.dtype))
    return None, pull(cols)[0], None   # the whole table: no gradient here

  rows.defvjp(fwd, bwd)
  return rows(table, shard, ids)


def _context(eqn):
  """What jax's own ``eval_jaxpr`` binds an equation under: its name stack
  (the op names XLA's profiles and schedules show) and its context."""
  stack = contextlib.ExitStack()
  try:
    from jax._src import source_info_util as siu
    stack.enter_context(siu.user_context(
        eqn.source_info.traceback,
        name_stack=siu.current_name_stack() + eqn.source_info.name_stack))
  except (ImportError, AttributeError):   # pragma: no cover - other jax
    pass
  ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
  if ctx is not None:
    stack.enter_context(ctx)
  return stack


def _eval(jaxpr, consts, args, tables: dict, axis: str, local: bool) -> list:
  """``jaxpr`` evaluated on ``args`` with the row lookups of ``tables``'
  vars (var -> this device's column block) read from the block (``local``:
  from the whole table, only their gradient going to the block)."""
  env: dict = {}
  read = lambda v: v.val if _is_literal(v) else env[v]
  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    src = eqn.invars[0] if eqn.invars else None
    is_table = src is not None and not _is_literal(src) and src in tables
    sub = _call_jaxpr(eqn)
    inner = {} if sub is None else {
        iv: tables[v] for iv, v in zip(sub.jaxpr.invars, eqn.invars)
        if not _is_literal(v) and v in tables}
    if is_table and is_row_lookup(eqn):
      ids = read(eqn.invars[1])
      outs = [_lookup_local(read(src), tables[src], ids, eqn, axis) if local
              else _lookup(tables[src], ids, eqn, axis)]
    elif inner:
      outs = _eval(sub.jaxpr, sub.consts, [read(v) for v in eqn.invars],
                   inner, axis, local)
    else:
      bound = eqn.primitive.get_bind_params(eqn.params)
      subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
      with _context(eqn):
        ans = eqn.primitive.bind(*subfuns, *[read(v) for v in eqn.invars],
                                 **params)
      outs = ans if eqn.primitive.multiple_results else [ans]
      if is_table and eqn.primitive.name == "convert_element_type":
        # the table cast to the compute dtype: its block cast alike
        tables = {**tables, eqn.outvars[0]: jax.lax.convert_element_type(
            tables[src], eqn.params["new_dtype"])}
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def rewrite(fn: Callable, params: Any, *args: Any, leaves: Iterable[int],
            axis: str, local: bool = False) -> Callable:
  """``g(params, blocks, *args)``: ``fn(params, *args)`` with the row
  lookups of ``leaves`` read from ``blocks`` ({leaf: this device's column
  block}, inside a shard_map over ``axis``); ``local``: ``params`` holds
  the whole tables, which the lookups read, their gradient going to
  ``blocks`` alone. Traced once on ``params`` and ``args`` (abstract or not)
  to a jaxpr of their shapes."""
  p_leaves, treedef = jax.tree.flatten(params)
  a_leaves, a_tree = jax.tree.flatten(args)
  closed, shape = jax.make_jaxpr(
      lambda p, a: fn(treedef.unflatten(p), *a_tree.unflatten(a)),
      return_shape=True)(p_leaves, a_leaves)
  out_tree = jax.tree.structure(shape)
  keep = tuple(sorted(leaves))

  def g(params, blocks, *args):
    flat = jax.tree.leaves(params) + jax.tree.leaves(args)
    tables = {closed.jaxpr.invars[i]: blocks[i] for i in keep}
    return out_tree.unflatten(_eval(closed.jaxpr, closed.consts, flat,
                                    tables, axis, local))

  return g
