"""Stage 2 of an update: the global norm, clipping and overflow as one divisor.

The reduced sums of stage 1 (:mod:`.grad_reduce`) are divided once, by
``N x loss scale`` (N only where they are sums of per-device gradients) x
the clip coefficient: one scalar that XLA fuses into the inner update of
stage 3. Norm and update both reading one divided tree would make XLA write
that tree out (it does not duplicate divides into two consumers). A divide,
not a multiply by the reciprocal: bitwise what optax computes from pmean'd
gradients.

The norm needs one scalar ``psum`` per group of mesh axes: shards are
disjoint, replicated leaves count once, and on a 2-D mesh each block once
(:meth:`.param_axes.ParamAxes.norm_axes`). It is also the overflow test.

Example:
  >>> import jax.numpy as jnp
  >>> from zero1_jax.core.tx_config import Zero1Config
  >>> cfg = Zero1Config("data", max_grad_norm=1.0)
  >>> float(clip(cfg, jnp.float32(4.0), jnp.float32(2.0)))   # 2 x 4 / 1
  8.0
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zero1_jax.core import layout as lay
from zero1_jax.core import param_axes as pax
from zero1_jax.core.tx_config import Zero1Config


class Scaled(NamedTuple):
  """What stage 2 hands on."""

  grads: dict[int, jax.Array]   # leaf -> the averaged, unscaled, clipped shard
  norm: jax.Array               # f32[]  global norm before clipping
  skipped: jax.Array            # bool[] overflow: the step changes nothing


def sum_sq(v) -> jax.Array:
  """Sum of ``|v|^2`` in float32 (complex: re^2 + im^2, as optax's norms)."""
  if jnp.iscomplexobj(v):
    v = v.astype(jnp.complex64)
    return jnp.sum(jnp.square(jnp.real(v)) + jnp.square(jnp.imag(v)))
  return jnp.sum(jnp.square(v.astype(jnp.float32)))


def global_norm(sums: dict[int, jax.Array], packed: list, layout: lay.Layout,
                pa: pax.ParamAxes | None, axis_name: str) -> jax.Array:
  """The norm of the undivided sums over every device. A packed bucket's sum
  of squares is read from the bucket in one pass (its padding is zero); per
  leaf, XLA:CPU would first copy every leaf's slice out of it (its
  reductions do not fuse a slice in)."""
  groups: dict[tuple, Any] = {}
  done: set[int] = set()
  if pa is None:
    for buf, leaves in packed:
      groups[(axis_name,)] = (groups.get((axis_name,), jnp.float32(0))
                              + sum_sq(buf))
      done.update(leaves)
  for i in sorted(set(sums) - done):
    v, spec = sums[i], layout.leaves[i]
    over = (pa.norm_axes(i, spec) if pa is not None
            else (axis_name,) if spec.kind == lay.SHARD else ())
    groups[over] = groups.get(over, jnp.float32(0)) + sum_sq(v)
  return jnp.sqrt(sum((jax.lax.psum(v, over) if over else v
                       for over, v in sorted(groups.items())),
                      jnp.float32(0)))


def clip(cfg: Zero1Config, g_norm: jax.Array, denom: jax.Array) -> jax.Array:
  """``denom`` times the clip coefficient of ``cfg.max_grad_norm`` for the
  averaged gradient's norm ``g_norm`` (``cfg.clip_rule``)."""
  if cfg.max_grad_norm is not None and cfg.clip_rule == "deepspeed":
    # runtime/zero/stage_1_and_2.py: clip = max(1, (norm + 1e-6) / c); the
    # gradients are divided by clip x loss scale.
    coef = jnp.maximum(jnp.float32(1), (g_norm + jnp.float32(1e-6))
                       / jnp.float32(cfg.max_grad_norm))
    return denom * coef
  if cfg.max_grad_norm is not None:
    # optax.clip_by_global_norm: g / norm * c once norm >= c.
    return jnp.where(g_norm < cfg.max_grad_norm, denom,
                     denom * (g_norm / jnp.float32(cfg.max_grad_norm)))
  return denom


def scale(sums: dict[int, jax.Array], packed: list, layout: lay.Layout,
          pa: pax.ParamAxes | None, cfg: Zero1Config, denom: jax.Array,
          skips_on_overflow: bool) -> Scaled:
  """The sums divided by ``denom`` (``N x loss scale``, or the loss scale
  alone where they sum to the mean) and the clip coefficient; the norm of
  the averaged gradient; whether the step overflowed (only where the loss
  scale skips such steps)."""
  g_norm = global_norm(sums, packed, layout, pa, cfg.axis_name) / denom
  denom = clip(cfg, g_norm, denom)
  grads = {i: v / denom.astype(jnp.finfo(v.dtype).dtype)
           for i, v in sums.items()}
  skipped = (~jnp.isfinite(g_norm) if skips_on_overflow
             else jnp.bool_(False))
  return Scaled(grads, g_norm, skipped)
