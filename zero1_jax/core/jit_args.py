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


def _mismatches(frame) -> list[tuple[str, Any, Any]]:
  """(path, jit sharding, array sharding) of each state leaf the jit of
  ``frame`` would refuse."""
  loc = frame.f_locals
  vals = getattr(loc.get("args_ft"), "vals", None)
  shardings = loc.get("in_shardings_flat")
  if vals is None or shardings is None:
    return []
  vals, shardings = list(vals), list(shardings)
  if len(vals) != len(shardings):
    return []
  ids = _state_leaf_ids(loc.get("args"), loc.get("kwargs"))
  out = []
  for x, s in zip(vals, shardings):
    if (id(x) not in ids or not isinstance(x, jax.Array)
        or isinstance(x, jax.core.Tracer)
        or not isinstance(s, jax.sharding.Sharding)
        or not getattr(x, "committed", True)):
      continue
    if not x.sharding.is_equivalent_to(s, x.ndim):
      out.append((ids[id(x)], s, x.sharding))
  return out


def check() -> None:
  """Raises zero1's error where the ``jax.jit`` being traced gives state
  leaves passed to it other ``in_shardings`` than their own placement."""
  try:
    bad = next((m for m in map(_mismatches, _jit_frames()) if m), [])
  except Exception:   # jax internals other than read here: JAX's error stands
    return
  if not bad:
    return
  path, want, has = bad[0]
  spec = lambda s: getattr(s, "spec", s)
  raise ValueError(
      f"zero1: this jit's in_shardings give zero1's optimizer state another "
      f"placement than the arrays passed: {len(bad)} state leaves (e.g. "
      f"{path}: in_shardings {spec(want)}, the array {spec(has)}). JAX would "
      f"refuse the call (\"Sharding passed to jit does not match the sharding "
      f"on the respective arg\"); with the state given P() every device would "
      f"hold all of it, the saving gone. " + FIX)
