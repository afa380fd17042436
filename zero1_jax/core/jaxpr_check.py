"""The jaxpr half of the elementwise decision: a taint analysis.

Values computed from parameter-shaped data (gradients, parameters, sharded
state) are *tainted*. :func:`taints` propagates taints through a closed jaxpr
(into ``cond``/``while``/``scan`` bodies and call-like sub-jaxprs) and raises
:class:`NotElementwise` at the first step that mixes elements:

* allowed on tainted values: elementwise primitives whose tainted operands
  have the output's shape, and identities; their other operands must be
  broadcasts of values that do not depend on where an element sits;
* refused: a reduction, contraction, sort, cumulative op, reshape/slice/
  broadcast of tainted data, an unknown primitive, a loop or branch steered by
  tainted data, a scan over or stacking tainted rows; and a value whose content
  depends on its position (``iota``, random bits drawn with a non-scalar shape,
  a constant array) meeting tainted data.

What the outputs may carry (a position-dependent value, a tainted value in a
replicated slot) is for the caller to judge: :mod:`.elementwise`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> f = jax.make_jaxpr(lambda x: x * 2 + 1)(jnp.zeros(3))
  >>> [t.dep for t in taints(f, [Taint(True)])]
  [True]
  >>> taints(jax.make_jaxpr(jnp.sum)(jnp.zeros(3)), [Taint(True)])
  Traceback (most recent call last):
  ...
  zero1_jax.core.jaxpr_check.NotElementwise: reduce_sum on parameter-shaped data (reduces across elements)
"""

from __future__ import annotations

import numpy as np

_ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt
ceil clamp clz complex conj convert_element_type cos cosh digamma div eq erf
erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag integer_pow
is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
polygamma population_count pow real reduce_precision regularized_incomplete_beta
rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical
sign sin sinh sqrt square sub tan tanh xor zeta
""".split())
# One output per operand, equal to it.
_IDENTITY = frozenset("copy copy_p optimization_barrier sharding_constraint "
                      "device_put mesh_cast reshard pvary pcast".split())
# Produce values that depend on the position of an element (non-scalar).
_POSITIONAL = frozenset("iota random_bits rng_uniform rng_bit_generator "
                        "threefry2x32".split())
_KINDS = (
    ("reduce_ argmax argmin", "reduces across elements"),
    ("dot_general conv_general_dilated", "contracts across elements"),
    ("sort cumsum cumprod cummax cummin cumlogsumexp top_k",
     "sorts or accumulates along an axis"),
    ("broadcast_in_dim reshape squeeze expand_dims transpose slice "
     "dynamic_slice dynamic_update_slice gather scatter concatenate pad rev "
     "split", "moves elements between positions"),
)


class NotElementwise(Exception):
  """A step of the jaxpr mixes elements; the message says which."""


def _kind(prim: str) -> str:
  for names, what in _KINDS:
    if any(prim == n or (n.endswith("_") and prim.startswith(n))
           for n in names.split()):
      return what
  return "not known to be elementwise"


class Taint:
  """Per value: ``dep`` (computed from parameter-shaped data) and ``pos``
  (why its content depends on an element's position, or None)."""
  __slots__ = ("dep", "pos")

  def __init__(self, dep=False, pos=None):
    self.dep, self.pos = dep, pos

  def __or__(self, o):
    return Taint(self.dep or o.dep, self.pos or o.pos)

  def __eq__(self, o):
    return (self.dep, bool(self.pos)) == (o.dep, bool(o.pos))


_CLEAN = Taint()


def _sub_jaxprs(eqn):
  """(jaxpr, consts) of call-like sub-jaxprs taking exactly eqn's operands."""
  for v in eqn.params.values():
    j = getattr(v, "jaxpr", v)
    if (hasattr(j, "eqns") and len(j.invars) == len(eqn.invars)
        and len(j.outvars) == len(eqn.outvars)):
      return j, getattr(v, "consts", ())
  return None


def _open(cj):
  return (cj.jaxpr, cj.consts) if hasattr(cj, "consts") else (cj, ())


def _run(jaxpr, consts, ins: list) -> list:
  """Taints of ``jaxpr``'s outputs given its inputs' taints."""
  env: dict = {}
  for v, c in zip(jaxpr.constvars, consts):
    pos = (f"a constant array of shape {np.shape(c)}"
           if np.size(c) > 1 and np.ptp(np.asarray(c).ravel()) != 0 else None)
    env[v] = Taint(False, pos)
  for v, t in zip(jaxpr.invars, ins):
    env[v] = t
  read = lambda v: env.get(v, _CLEAN) if not hasattr(v, "val") else _CLEAN
  for eqn in jaxpr.eqns:
    outs = _eqn(eqn, [read(v) for v in eqn.invars])
    for v, t in zip(eqn.outvars, outs):
      env[v] = t
  return [read(v) for v in jaxpr.outvars]


def _fixpoint(body, carry: list) -> list:
  for _ in range(len(carry) + 2):
    new = [a | b for a, b in zip(carry, body(carry))]
    if new == carry:
      return new
    carry = new
  return carry


def _eqn(eqn, ins: list) -> list:
  prim = eqn.primitive.name
  p = eqn.params
  avals = [v.aval for v in eqn.outvars]
  if prim == "cond":
    if ins[0].dep or ins[0].pos:
      raise NotElementwise("a branch chosen by parameter-shaped data")
    outs = [_CLEAN] * len(avals)
    for br in p["branches"]:
      outs = [a | b for a, b in zip(outs, _run(*_open(br), ins[1:]))]
    return outs
  if prim == "while":
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cc, bc, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    carry = _fixpoint(lambda c: _run(*_open(p["body_jaxpr"]), bc + c), carry)
    (pred,) = _run(*_open(p["cond_jaxpr"]), cc + carry)
    if pred.dep or pred.pos:
      raise NotElementwise("a loop whose length depends on parameter-shaped "
                            "data")
    return carry
  if prim == "scan":
    nc, nk = p["num_consts"], p["num_carry"]
    consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
    if any(t.dep or t.pos for t in xs):
      raise NotElementwise("a scan over the rows of parameter-shaped data")
    body = lambda c: _run(*_open(p["jaxpr"]), consts + c + xs)[:nk]
    carry = _fixpoint(body, carry)
    ys = _run(*_open(p["jaxpr"]), consts + carry + xs)[nk:]
    if any(t.dep for t in ys):
      raise NotElementwise("a scan stacking parameter-shaped data")
    return carry + ys
  sub = _sub_jaxprs(eqn)
  if sub is not None:
    return _run(sub[0], sub[1], ins)
  dep = any(t.dep for t in ins)
  pos = next((t.pos for t in ins if t.pos), None)
  # Non-scalar: a draw of shape (1,) on a one-element shard is one draw per
  # device where the whole leaf draws one per element (all devices alike).
  if prim in _POSITIONAL and any(len(getattr(a, "shape", ())) for a in avals):
    what = "random numbers" if prim != "iota" else "an iota"
    pos = f"{what} drawn with a shape of the shard ({prim})"
  if dep and pos:
    raise NotElementwise(f"{pos} combined with parameter-shaped data")
  if not dep:
    return [Taint(False, pos)] * len(avals)
  if prim in _IDENTITY:
    return list(ins[:len(avals)])
  if prim in _ELEMENTWISE:
    for v, t in zip(eqn.invars, ins):
      if t.dep and tuple(v.aval.shape) != tuple(avals[0].shape):
        raise NotElementwise(f"{prim} broadcasts parameter-shaped data")
    return [Taint(True, None)] * len(avals)
  raise NotElementwise(f"{prim} on parameter-shaped data ({_kind(prim)})")



def taints(closed, ins: list) -> list:
  """Taints of the closed jaxpr ``closed``'s outputs given its inputs'
  (:class:`Taint` each); :class:`NotElementwise` if a step mixes elements."""
  return _run(*_open(closed), ins)
