"""Whether an inner optimizer does on a bf16 parameter's fp32 master what it
does on the parameter.

Under ZeRO-1 the inner optimizer runs on each trainable leaf's master: a
bfloat16 or float16 parameter's float32 copy (:func:`.layout.master_dtype`),
as DeepSpeed's bf16 optimizer keeps one. An optimizer, a mask or a label
that decides in Python by the leaf's dtype then decides otherwise than
optax on the same params: ``multi_transform({"train": adam(1e-3), "frozen":
set_to_zero()}, labels by x.dtype == float32)`` trains the bf16 leaves it
meant to freeze, ``masked(sgd(0.1), mask by dtype)`` steps leaves it meant to
leave out, and nothing fails.

:func:`dtype_reason` traces ``inner.init`` and ``inner.update`` abstractly
(no compile, no memory) on the whole parameters in their own dtypes and in
their masters' (as :mod:`.size_check` does for shapes) and holds them to be
one program: the same state structure, the same operations on the same
operands, where a conversion between a parameter's dtype and its master's
is no operation and a literal may be the master's rounded to the param's
dtype or the same property of its dtype (``finfo(dtype).eps``), and a call
that draws random numbers (``optax.add_noise``) is compared at the call.
Arithmetic in bf16 against fp32 is what the master is for; another
operation, operand or state is a decision by dtype.

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> from zero1_jax.core import layout as lay
  >>> L = lay.plan({"w": jnp.zeros((4, 4), jnp.bfloat16)}, 8)
  >>> dtype_reason(optax.adam(1e-3), L, jnp.float32) is None
  True
  >>> only_f32 = lambda p: jax.tree.map(lambda x: x.dtype == jnp.float32, p)
  >>> print(dtype_reason(optax.masked(optax.sgd(0.1), only_f32), L,
  ...                    jnp.float32))   # doctest: +ELLIPSIS
  its update runs other operations on params in their own dtypes than on ...
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from zero1_jax.core import extra_args as xa
from zero1_jax.core import layout as lay
from zero1_jax.core import size_check as sc



def _whole(layout: lay.Layout, dtype: Any, own: bool) -> Any:
  return layout.inner_tree([jax.ShapeDtypeStruct(
      s.shape, s.dtype if own else lay.master_dtype(s.dtype, dtype))
      for s in layout.leaves])


def _differs(what: str, a, b, names: dict, dtypes: dict) -> str | None:
  """Why ``what`` (``"init"``, ``"update"``) runs another program on the
  params in their own dtypes (closed jaxpr ``a``) than on their masters
  (``b``), or None."""
  try:
    sc.compare(a, b, set(), names, dtypes)
  except sc.Differ as d:
    return (f"its {what} runs other operations on params in their own "
            f"dtypes than on their fp32 masters ({d.a} against {d.b}): a "
            f"mask, label, constant or branch decided by dtype")
  return None


def dtype_reason(inner: optax.GradientTransformation, layout: lay.Layout,
                 dtype: Any, extra: dict | None = None) -> str | None:
  """Why ``inner`` computes something else on ``layout``'s params in their
  own dtypes than on their masters in ``dtype`` (the master dtype), or None
  (also where no trainable leaf has a master of another dtype, and where
  optax itself cannot trace the params in their own dtypes: there is
  nothing to differ from). ``extra``: the update's extra keyword arguments
  (:mod:`.extra_args`)."""
  dtypes = {np.dtype(s.dtype): lay.master_dtype(s.dtype, dtype)
            for s in layout.leaves if s.kind != lay.STATIC}
  dtypes = {k: v for k, v in dtypes.items() if k != v}
  if not dtypes:
    return None
  own, master = _whole(layout, dtype, True), _whole(layout, dtype, False)
  arrays, rebuild = xa.split(extra)
  update = xa.updater(inner, rebuild)
  try:
    s_own = jax.eval_shape(inner.init, own)
    p_own = (jax.make_jaxpr(inner.init)(own),
             jax.make_jaxpr(update)(own, s_own, own, arrays))
  except Exception:  # noqa: BLE001 - optax cannot run them either
    return None
  s_master = jax.eval_shape(inner.init, master)
  if jax.tree.structure(s_own) != jax.tree.structure(s_master):
    return ("its state has another structure for params in their own "
            "dtypes than for their fp32 masters (a mask or label by dtype?)")
  names = sc.input_names(params=own)
  return (_differs("init", p_own[0], jax.make_jaxpr(inner.init)(master),
                   names, dtypes)
          or _differs("update", p_own[1],
                      jax.make_jaxpr(update)(master, s_master, master, arrays),
                      sc.input_names(grads=own, state=s_own, params=own,
                                     extra=arrays), dtypes))
