"""In which order a loss reads its parameters, and collective groups in that order.

The forward pass reads the parameters in some order (embeddings, then layer
0, layer 1, ...) and the backward pass finishes their gradients in the
reverse one. A reduce-scatter can start as soon as its gradients are
complete, and a gather of stored shards is needed when the forward first
reads the leaf; so both are grouped by the position of each leaf's first
read in the loss's jaxpr (:func:`first_reads`), not by the tree's key order
(``layers_10`` sorts before ``layers_2``).

:func:`zero1_jax.core.layout.plan_buckets` cuts that order into groups;
each group's collectives carry their own XLA ``combiner_key`` (:func:`tagged`), so
XLA's GPU collective combiners (which run before scheduling and would merge
a whole backward's reduce-scatters into one that waits for the last
gradient) combine within a group but never across groups.

Example:
  >>> import jax.numpy as jnp
  >>> loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["a"]) @ p["b"])
  >>> p = {"b": jnp.ones((3, 2)), "a": jnp.ones((4, 3))}   # tree order: a, b
  >>> first_reads(loss, p, jnp.ones((5, 4)))               # read: a first
  (0, 1)
  >>> first_reads(lambda p, x: jnp.sum(x @ p["b"].T @ p["a"].T), p, jnp.ones((5, 2)))
  (1, 0)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax

from zero1_jax.core import lookup

try:   # jax >= 0.4.3x
  from jax.experimental.xla_metadata import set_xla_metadata as _set_metadata
except ImportError:   # pragma: no cover - older jax: no tags, XLA's default combining
  _set_metadata = None


def _subjaxprs(eqn) -> list:
  out = []
  for v in eqn.params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      inner = getattr(x, "jaxpr", x)
      if hasattr(inner, "eqns") and hasattr(inner, "invars"):
        out.append(inner)
  return out


def _reads(jaxpr, positions: dict, counter: list, seen: dict,
           lookups: frozenset = frozenset()) -> None:
  """Visits equations in order; ``seen[var] = step`` when a traced var that
  stands for a parameter leaf is first read (into sub-jaxprs too). A row
  lookup of a ``lookups`` leaf is no read: it reads the leaf's stored shard
  (:mod:`.lookup`)."""
  for eqn in jaxpr.eqns:
    step = counter[0]
    counter[0] += 1
    subs = _subjaxprs(eqn)
    for k, v in enumerate(eqn.invars):
      leaf = None if type(v).__name__ == "Literal" else positions.get(v)
      if leaf is None or (k == 0 and leaf in lookups
                          and lookup.is_row_lookup(eqn)):
        continue
      if not subs:
        seen.setdefault(leaf, step)
        continue
      # A call (pjit, custom_vjp, remat, shard_map): follow the operand into
      # each sub-jaxpr that takes it at the same position.
      for sub in subs:
        n_in = len(sub.invars)
        off = len(eqn.invars) - n_in
        if 0 <= k - off < n_in:
          _reads(sub, {sub.invars[k - off]: leaf}, counter, seen, lookups)
        else:
          seen.setdefault(leaf, step)


def first_reads(fn: Callable, params: Any, *args: Any,
                lookups: frozenset = frozenset()) -> tuple[int, ...]:
  """Indices of ``params``' leaves (``jax.tree.leaves`` order) sorted by
  where ``fn(params, *args)`` first reads them; leaves it never reads last,
  in tree order. ``params`` and ``args`` may be abstract. ``lookups``: leaves
  whose row lookups read their stored shard (:mod:`.lookup`), not them."""
  leaves, treedef = jax.tree.flatten(params)
  closed = jax.make_jaxpr(lambda p, *a: fn(treedef.unflatten(p), *a))(
      leaves, *args)
  jaxpr = closed.jaxpr
  positions = {v: i for i, v in enumerate(jaxpr.invars[:len(leaves)])}
  seen: dict[int, int] = {}
  _reads(jaxpr, positions, [0], seen, frozenset(lookups))
  never = len(jaxpr.eqns) * 10 + 1
  return tuple(sorted(range(len(leaves)), key=lambda i: (seen.get(i, never), i)))


def tagged(key: str | None):
  """A context in which the collectives traced carry XLA's ``combiner_key``
  ``key`` (None: no tag)."""
  if key is None or _set_metadata is None:
    return contextlib.nullcontext()
  return _set_metadata(combiner_key=key)
