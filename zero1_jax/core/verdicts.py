"""The elementwise check's verdicts, remembered by what they depend on.

:func:`.elementwise.check_elementwise` traces and runs the inner optimizer
on the parameters' shapes (whole, as shards, and a small probe): seconds on
a real model, at every ``z1.init`` / ``tx.init``. Its verdict is a function
of the optimizer's computation and of the layout, nothing else, so a second
check of an equal optimizer on an equal layout in the same process returns
the first verdict.

"Equal optimizer" is decided from what defines an optax transformation: the
code of its ``init`` and ``update`` functions and every value they close
over (hyperparameters, schedules, masks, nested transformations), followed
recursively. Where a closure holds something whose behaviour its value
does not pin down (an object of an unknown class, a tracer, a jitted
function), there is no key and the check runs as before: a miss costs the
check, never a wrong verdict.

Verdicts are also kept on disk, one small file per key (under
``$ZERO1_VERDICT_CACHE``, default ``~/.cache/zero1_jax/verdicts``;
``ZERO1_VERDICT_CACHE=0`` turns it off), so a later process skips the check
too: on bert-large's tree a start drops from the check's seconds to a
file read. The file name hashes the key together with the versions of
Python, jax and optax and the source of the check itself (this module,
:mod:`.elementwise`, :mod:`.probe`, :mod:`.state_dims`, :mod:`.jaxpr_check`,
:mod:`.size_check`, :mod:`.dtype_check`, :mod:`.layout` and the rest it
reads): a change to any of them misses. A file that cannot be read or written is a miss, never an
error.

Example:
  >>> import optax
  >>> key(optax.adam(1e-3)) == key(optax.adam(1e-3))
  True
  >>> key(optax.adam(1e-3)) == key(optax.adam(2e-3))
  False
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import os
import pathlib
import sys
import types
from typing import Any, Hashable

import numpy as np

_VERDICTS: dict[Hashable, str | None] = {}
_MAX = 256   # distinct (optimizer, layout) pairs kept per process


class _NoKey(Exception):
  """Something in the closure whose value does not define its behaviour."""


def _code(c: types.CodeType, seen: set[int]) -> Hashable:
  consts = tuple(_code(k, seen) if isinstance(k, types.CodeType) else _fp(k, seen)
                 for k in c.co_consts)
  return ("code", c.co_filename, c.co_qualname if hasattr(c, "co_qualname")
          else c.co_name, c.co_firstlineno, c.co_code, consts, c.co_names)


def _globals(fn: types.FunctionType, seen: set[int]) -> Hashable:
  """The data globals ``fn``'s code reads (a module-level constant changed
  between two checks changes the key); modules, classes and functions
  there are named by their code or qualified name."""
  out = []
  names = set(fn.__code__.co_names)
  for k in fn.__code__.co_consts:
    if isinstance(k, types.CodeType):
      names |= set(k.co_names)
  for name in sorted(names):
    if name in fn.__globals__:
      v = fn.__globals__[name]
      if isinstance(v, types.FunctionType) and not _library(v):
        out.append((name, _fp(v, seen)))    # the user's own function: its code
      elif isinstance(v, (types.ModuleType, type)) or callable(v):
        out.append((name, getattr(v, "__module__", None),
                    getattr(v, "__qualname__", getattr(v, "__name__", None))))
      else:
        out.append((name, _fp(v, seen)))
  return tuple(out)


def _fp(x: Any, seen: set[int]) -> Hashable:
  if x is None or isinstance(x, (bool, int, str, bytes)):
    return (type(x).__name__, x)
  if isinstance(x, (float, complex)):
    return (type(x).__name__, repr(x))
  if isinstance(x, enum.Enum):
    return ("enum", type(x).__qualname__, x.name)
  if isinstance(x, (np.dtype, type)) and not isinstance(x, types.FunctionType):
    if isinstance(x, type):
      return ("type", x.__module__, x.__qualname__)
    return ("dtype", str(x))
  if isinstance(x, np.generic):
    return ("np", str(x.dtype), x.tobytes())
  if id(x) in seen:
    return ("cycle",)
  seen = seen | {id(x)}
  if isinstance(x, (tuple, list)):
    return (type(x).__qualname__, tuple(_fp(v, seen) for v in x))
  if isinstance(x, dict):
    return ("dict", tuple(sorted(((repr(k), _fp(v, seen)) for k, v in x.items()),
                                 key=lambda kv: kv[0])))
  if isinstance(x, functools.partial):
    return ("partial", _fp(x.func, seen), _fp(x.args, seen), _fp(x.keywords, seen))
  if isinstance(x, types.FunctionType):
    cells = tuple(_fp(c.cell_contents, seen) if _filled(c) else ("empty",)
                  for c in (x.__closure__ or ()))
    return ("fn", _code(x.__code__, seen), _fp(x.__defaults__, seen),
            _fp(x.__kwdefaults__, seen), cells, _globals(x, seen))
  if isinstance(x, types.BuiltinFunctionType):
    return ("builtin", getattr(x, "__module__", None), x.__qualname__)
  if isinstance(x, types.MethodType):
    return ("method", _fp(x.__func__, seen), _fp(x.__self__, seen))
  if isinstance(x, types.ModuleType):
    return ("module", x.__name__)
  if type(x).__name__ == "PyTreeDef":
    return ("treedef", str(x))
  if isinstance(x, np.ndarray) or _is_concrete_jax_array(x):
    a = np.asarray(x)
    return ("array", str(a.dtype), a.shape, hashlib.sha256(a.tobytes()).hexdigest())
  if _library(type(x)) and hasattr(x, "__dict__"):   # e.g. optax.MultiSteps
    return ("obj", _fp(type(x), seen), _fp(vars(x), seen))
  raise _NoKey(type(x).__qualname__)


_LIBRARIES = ("jax", "jaxlib", "optax", "numpy", "flax", "zero1_jax",
              "functools", "builtins", "math", "chex")


def _library(fn) -> bool:
  return (getattr(fn, "__module__", None) or "").split(".")[0] in _LIBRARIES


def _filled(cell) -> bool:
  try:
    cell.cell_contents
  except ValueError:
    return False
  return True


def _is_concrete_jax_array(x) -> bool:
  import jax
  return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def key(inner: Any, layout: Any = None, dtype: Any = None) -> Hashable | None:
  """What the elementwise verdict on ``inner`` (an optax transformation)
  over ``layout`` in ``dtype`` depends on, or None where that cannot be
  told from values (then nothing is remembered)."""
  try:
    return (_fp(type(inner), set()), _fp(inner.init, set()),
            _fp(inner.update, set()), _fp(layout, set()),
            None if dtype is None else str(np.dtype(dtype)))
  except (_NoKey, RecursionError, TypeError, AttributeError):
    return None


CACHE_ENV = "ZERO1_VERDICT_CACHE"   # a directory, or "0": no disk cache


def cache_dir() -> pathlib.Path | None:
  """Where verdicts are kept across processes, or None (turned off)."""
  v = os.environ.get(CACHE_ENV)
  if v == "0":
    return None
  if v:
    return pathlib.Path(v)
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "zero1_jax" / "verdicts"


# The check's source: elementwise.py and every core module it imports,
# directly or not (tests/test_verdicts.py reads the imports and holds them
# to this list).
SOURCES = ("verdicts", "elementwise", "probe", "state_dims", "jaxpr_check",
           "size_check", "dtype_check", "blame", "extra_args", "refusal",
           "layout")


@functools.lru_cache(maxsize=1)
def _salt() -> str:
  """What else a verdict depends on: the versions and the check's source."""
  import jax
  import optax
  h = hashlib.sha256(repr((sys.version, jax.__version__,
                           optax.__version__)).encode())
  here = pathlib.Path(__file__).parent   # read, not imported (no cycle)
  for name in SOURCES:
    h.update((here / f"{name}.py").read_bytes())
  return h.hexdigest()


def _file(k: Hashable) -> pathlib.Path | None:
  d = cache_dir()
  if d is None:
    return None
  name = hashlib.sha256(repr(k).encode() + _salt().encode()).hexdigest()
  return d / f"{name}.json"


def remembered(k: Hashable | None) -> tuple[bool, str | None]:
  """``(found, verdict)``: the reason of a refusal, None for accepted;
  from this process's memory, else from the disk cache."""
  if k is None:
    return False, None
  if k in _VERDICTS:
    return True, _VERDICTS[k]
  try:
    path = _file(k)
    rec = json.loads(path.read_text()) if path is not None else None
  except (OSError, ValueError):
    rec = None
  if not isinstance(rec, dict) or "verdict" not in rec:
    return False, None
  _keep(k, rec["verdict"])
  return True, rec["verdict"]


def _keep(k: Hashable, why: str | None) -> None:
  if len(_VERDICTS) >= _MAX:
    _VERDICTS.pop(next(iter(_VERDICTS)))
  _VERDICTS[k] = why


def remember(k: Hashable | None, why: str | None) -> None:
  if k is None:
    return
  _keep(k, why)
  try:
    path = _file(k)
    if path is None:
      return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"verdict": why}))
    os.replace(tmp, path)   # whole or absent, for a concurrent reader
  except OSError:
    pass   # a read-only or full disk: the check runs again next time


def forget() -> None:
  """Drops every remembered verdict, in memory and in the disk cache (tests
  that change the check itself)."""
  _VERDICTS.clear()
  d = cache_dir()
  if d is not None and d.is_dir():
    for f in d.glob("*.json"):
      try:
        f.unlink()
      except OSError:
        pass
