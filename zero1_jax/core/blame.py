"""Which transformation of a refused optimizer is refused, and where it sits.

A refusal names what the whole inner optimizer does (``reduce_sum on
parameter-shaped data``), but optax's optimizers are compositions:
``optax.adafactor`` and ``optax.lamb`` are chains, ``optax.MultiSteps`` and
``optax.masked`` wrap one, ``optax.multi_transform`` holds one per group.
:func:`locate` runs the check that refused the whole again on each part it
is built from (found in its ``init`` / ``update`` closures: a chain's
functions, a wrapper's transformation, a group's), descends into the first
part refused for the same kind of reason, and names it with its place:
``optax.scale_by_trust_ratio (element 2 of optax.chain, in optax.MultiSteps)``.
A part is checked on the whole parameters, where the composite may hand it
only some (a group's labels); a part refused for another kind of reason is
not blamed.

Example:
  >>> import optax
  >>> name(optax.scale_by_adam())
  'optax.scale_by_adam'
  >>> [(place, name(p)) for place, p in parts(optax.chain(optax.clip(1.0),
  ...                                                    optax.scale(-1.0)))]
  [('element 0', 'optax.clip'), ('element 1', 'optax.scale')]
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any, Callable

import optax

from zero1_jax.core.extra_args import UNTRACEABLE as _UNTRACEABLE

_MAX_DEPTH = 8


def _closure(f: Any) -> dict:
  f = getattr(f, "__func__", f)
  names = getattr(getattr(f, "__code__", None), "co_freevars", ())
  out = {}
  for n, c in zip(names, getattr(f, "__closure__", None) or ()):
    try:
      out[n] = c.cell_contents
    except ValueError:   # an empty cell
      pass
  return out


def _is_tx(x: Any) -> bool:
  return (isinstance(x, tuple) and hasattr(x, "_fields")
          and callable(getattr(x, "init", None))
          and callable(getattr(x, "update", None)))


def _own_update(tx: Any) -> Any:
  """``tx.update`` past optax.with_extra_args_support's wrapper."""
  f = tx.update
  for _ in range(_MAX_DEPTH):
    inner = _closure(f).get("tx")
    if not (getattr(f, "__qualname__", "").startswith("with_extra_args_support.")
            and _is_tx(inner)):
      return f
    f = inner.update
  return f


def _public(base: str, module: str) -> str:
  """``optax.<base>`` / ``optax.contrib.<base>`` where optax exports it."""
  for pkg in (optax, optax.contrib):
    with warnings.catch_warnings(record=True) as said:   # a deprecated alias
      warnings.simplefilter("always")                   # warns when read
      found = getattr(pkg, base, None) is not None
    if found and not any(issubclass(w.category, DeprecationWarning) for w in said):
      return f"{pkg.__name__}.{base}"
  return f"{module}.{base}"


def name(tx: Any) -> str:
  """How the user would write ``tx``'s maker: ``optax.scale_by_adam``,
  ``optax.MultiSteps``, ``optax.inject_hyperparams(optax.adafactor)``,
  ``optax.stateless(<their function>)``, or the module and function of one
  of their own."""
  f = _own_update(tx)
  if inspect.ismethod(f):
    cls = type(f.__self__)
    return _public(cls.__name__, cls.__module__)
  base = getattr(f, "__qualname__", type(f).__name__).split(".<locals>")[0]
  base = base.split(".")[0]
  out = _public(base, getattr(f, "__module__", "?"))
  free = _closure(f)
  factory = free.get("inner_factory")
  if base == "inject_hyperparams" and callable(factory):
    fb = getattr(factory, "__name__", "?")
    out += f"({_public(fb, getattr(factory, '__module__', '?'))})"
  elif base.startswith("stateless") and callable(free.get("f")):   # the user's f
    g = free["f"]
    out += f"({getattr(g, '__module__', '?')}.{getattr(g, '__qualname__', '?')})"
  return out


def parts(tx: Any) -> list[tuple[str, Any]]:
  """``(place, transformation)`` for each part ``tx`` is built from: a
  chain's elements, a group of a multi_transform, a named chain's names, a
  wrapper's transformation (place ``""``)."""
  upd = _own_update(tx)
  if inspect.ismethod(upd):   # optax.MultiSteps(...).gradient_transformation()
    found = dict(vars(upd.__self__))
  else:
    found = {**_closure(tx.init), **_closure(upd)}
  if "inner_factory" in found and "numeric_hps" in found:
    # optax.inject_hyperparams: the transformation its factory builds (at
    # the hyperparameters' first values) is its one part.
    try:
      hps = {**found.get("other_hps", {}), **found["numeric_hps"],
             **{k: f(f.init()) for k, f in found.get("sched_hps", {}).items()}}
      inner = found["inner_factory"](**hps)
    except Exception:  # noqa: BLE001 - a factory that cannot be built here
      return []
    return [("", inner)] if _is_tx(inner) else []
  if "init_fns" in found and "update_fns" in found:   # optax.chain
    return [(f"element {i}", optax.GradientTransformationExtraArgs(i_fn, u_fn))
            for i, (i_fn, u_fn) in enumerate(zip(found["init_fns"],
                                                 found["update_fns"]))]
  out, seen = [], set()

  def add(place, x):
    if _is_tx(x) and id(x) not in seen:
      seen.add(id(x))
      out.append((place, x))

  for v in found.values():
    if _is_tx(v):
      add("", v)
    elif isinstance(v, dict):
      for k, x in v.items():
        add(f"group {k!r}", x)
    elif isinstance(v, (tuple, list)):
      for i, x in enumerate(v):
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
          add(f"{x[0]!r}", x[1])   # optax.named_chain's (name, transformation)
        else:
          add(f"element {i}", x)
  return out


def _kind(why: str) -> list[str]:
  """A reason's words without paths, shapes and numbers: what kind of
  refusal it is (a part's reason names its own state paths)."""
  words = [w for w in why.split() if not re.search(r"[\d\[\]'\"`]", w)]
  return words[:6]


def locate(tx: Any, why: str, check: Callable[[Any], str | None]) -> str:
  """The refused part of ``tx`` and its place, in words; ``why`` is the
  reason ``check`` gave for ``tx`` itself."""
  path = [("", name(tx))]
  node, kind = tx, _kind(why)
  for _ in range(_MAX_DEPTH):
    refused = []   # the parts refused alone, for any reason
    for place, part in parts(node):
      try:
        got = check(part)
      except Exception:  # noqa: BLE001 - a part that cannot be checked alone
        got = None
      if got and _kind(got) == kind:
        path.append((place, name(part)))
        node = part
        break
      if got:
        refused.append((place, part, _UNTRACEABLE in got))
    else:
      # The one part refused alone, which could not run on every param (a
      # partition's group meant for some: optax.contrib.muon's on the 1-D
      # ones): the refusal is in it. A part refused for a reason of its own
      # is not blamed for the whole's.
      if len(refused) != 1 or not refused[0][2]:
        break
      place, node, _ = refused[0]
      path.append((place, name(node)))
  where = [f"{place} of {path[i - 1][1]}" if place else f"in {path[i - 1][1]}"
           for i, (place, _) in reversed(list(enumerate(path))) if i]
  return path[-1][1] + (f" ({', '.join(where)})" if where else "")
