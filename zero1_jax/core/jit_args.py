"""Does the jit tracing this update give zero1's state another placement?

A program that jits its step with shardings it writes itself (JAX's
distributed-arrays tutorial style) may give the optimizer state ``P()`` in
``in_shardings`` while passing the state as :func:`zero1_jax.init` placed it,
split over the data axis. JAX refuses that call ("Sharding passed to jit does
not match the sharding on the respective arg"), but only after tracing the
step, and its message names neither the optimizer state nor what to pass.
A traced argument is typed as the array passed, not as ``in_shardings``, so
the update cannot see them in its arguments: :func:`check` reads them from
the enclosing ``jax.jit`` call being traced (jax's ``_trace_for_jit`` frame:
its flat arguments and flat ``in_shardings``, both jax 0.10.2 and 0.12) and
raises zero1's error first, with the fix. It raises only where JAX's own
check would (a committed array whose sharding differs from the jit's); when
the frame cannot be read (another jax), it does nothing and JAX's error
stands.

The same frame holds the jit's ``out_shardings``. A jit that takes the state
with its own placement and gives it ``P()`` in ``out_shardings`` only runs
its first call; JAX refuses the second, handed the replicated state, and on
Auto axes reuses the first trace, so no zero1 code runs before that error.
:func:`check` raises at the first call instead where that is certain: no
``out_shardings`` leaf is the placement of a sharded state leaf (wherever the
new state lands among the outputs, it is placed otherwise).

Example (what the error says)::

  step = jax.jit(step, in_shardings=(rep, NamedSharding(mesh, P()), rows))
  step(params, opt_state, batch)
  # ValueError: zero1: this jit's in_shardings give zero1's optimizer state
  # P() ... state_shardings = jax.tree.map(lambda x: x.sharding, opt_state)
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from zero1_jax.core.state import Zero1State

FIX = (
    "Give the state the shardings tx.init placed it with, in in_shardings and "
    "out_shardings alike: state_shardings = jax.tree.map(lambda x: x.sharding, "
    "opt_state) (or z1.state_shardings(tx, params, mesh)), not "
    "NamedSharding(mesh, P()) or the params' shardings; or leave the state's "
    "entry None (jit then takes the arrays' own placement).")


def _jit_frames():
  """The frames of ``jax.jit`` calls being traced, innermost first."""
  f = sys._getframe(1)
  while f is not None:
    code = f.f_code
    if code.co_name == "_trace_for_jit" and code.co_filename.endswith("pjit.py"):
      yield f
    f = f.f_back


def _state_leaf_ids(args: tuple, kwargs: dict) -> dict[int, str]:
  """``id`` -> path (``args[1].inner[0].mu['w']``) of each array leaf of a
  :class:`Zero1State` in the jit's arguments."""
  is_state = lambda x: isinstance(x, Zero1State)
  keystr = jax.tree_util.keystr
  found = {}
  for name, tree in (("args", tuple(args or ())), ("kwargs", dict(kwargs or {}))):
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]:
      if is_state(x):
        for sub, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
          found[id(leaf)] = name + keystr(path) + keystr(sub)
  return found


def _state_args(frame) -> list[tuple[str, jax.Array, Any]]:
  """(path, array, the jit's in_sharding) of each state leaf passed as an
  array to the jit of ``frame`` whose ``in_shardings`` name a sharding."""
  loc = frame.f_locals
  vals = getattr(loc.get("args_ft"), "vals", None)
  shardings = loc.get("in_shardings_flat")
  if vals is None or shardings is None:
    return []
  vals, shardings = list(vals), list(shardings)
  if len(vals) != len(shardings):
    return []
  ids = _state_leaf_ids(loc.get("args"), loc.get("kwargs"))
  return [(ids[id(x)], x, s) for x, s in zip(vals, shardings)
          if id(x) in ids and isinstance(x, jax.Array)
          and not isinstance(x, jax.core.Tracer)
          and isinstance(s, jax.sharding.Sharding)]


def _mismatches(frame) -> list[tuple[str, Any, Any]]:
  """(path, jit sharding, array sharding) of each state leaf the jit of
  ``frame`` would refuse."""
  return [(path, s, x.sharding) for path, x, s in _state_args(frame)
          if getattr(x, "committed", True)
          and not x.sharding.is_equivalent_to(s, x.ndim)]


def _out_mismatches(frame) -> list[tuple[str, Any, Any]]:
  """(path, the jit's in_sharding, its out_shardings) of each sharded state
  leaf that the jit of ``frame`` takes with its own placement and can only
  return otherwise: no leaf of ``out_shardings`` is that placement, so
  wherever the new state lands among the outputs it is placed another way,
  and the next call, handed it, is refused. Empty where any ``out_shardings``
  leaf is left unspecified (the state may keep its placement there)."""
  outs = list(frame.f_locals.get("out_shardings_leaves") or ())
  if not outs or not all(isinstance(o, jax.sharding.Sharding) for o in outs):
    return []
  return [(path, s, outs) for path, x, s in _state_args(frame)
          if not x.sharding.is_fully_replicated
          and x.sharding.is_equivalent_to(s, x.ndim)
          and not any(o.is_equivalent_to(s, x.ndim) for o in outs)]


def _first(find) -> list:
  try:
    return next((m for m in map(find, _jit_frames()) if m), [])
  except Exception:   # jax internals other than read here: JAX's error stands
    return []


def check() -> None:
  """Raises zero1's error where the ``jax.jit`` being traced gives state
  leaves passed to it other ``in_shardings`` than their own placement, or
  takes them with their placement in ``in_shardings`` and can only return
  them placed otherwise (``P()`` in ``out_shardings``): JAX would refuse the
  next call, and on Auto axes nothing of zero1 runs before it (the first
  trace is reused)."""
  spec = lambda s: getattr(s, "spec", s)
  bad = _first(_mismatches)
  if bad:
    path, want, has = bad[0]
    raise ValueError(
        f"zero1: this jit's in_shardings give zero1's optimizer state another "
        f"placement than the arrays passed: {len(bad)} state leaves (e.g. "
        f"{path}: in_shardings {spec(want)}, the array {spec(has)}). JAX would "
        f"refuse the call (\"Sharding passed to jit does not match the sharding "
        f"on the respective arg\"); with the state given P() every device would "
        f"hold all of it, the saving gone. " + FIX)
  bad = _first(_out_mismatches)
  if bad:
    path, want, outs = bad[0]
    given = sorted({str(spec(o)) for o in outs})
    raise ValueError(
        f"zero1: this jit's out_shardings give zero1's optimizer state another "
        f"placement than its in_shardings: {len(bad)} state leaves (e.g. "
        f"{path}: in_shardings {spec(want)}; out_shardings has none such, only "
        f"{', '.join(given)}). The state this call returns would be placed "
        f"otherwise, and JAX would refuse the next call, handed it (\"Sharding "
        f"passed to jit does not match the sharding on the respective arg\"); "
        f"given P() every device would hold all of it, the saving gone. " + FIX)
