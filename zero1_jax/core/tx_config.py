"""``Zero1Config``, ``StepInfo`` and ``Zero1Transformation``: what
:func:`zero1_jax.zero1` is configured with, what a step reports, and the
optax transformation type it returns (:mod:`.transform` builds it).

Example:
  >>> cfg = Zero1Config("data", max_grad_norm=1.0)
  >>> cfg.reduce, cfg.clip_rule, cfg.offload
  ('reduce_scatter', 'optax', None)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zero1_jax.core import offload as ofl
from zero1_jax.core import precision


class StepInfo(NamedTuple):
  grad_norm: jax.Array   # f32[]  global norm of the averaged, unscaled gradient
  skipped: jax.Array     # bool[] the step overflowed and was skipped everywhere
  loss_scale: jax.Array  # f32[]  scale used for this step's gradients


@dataclasses.dataclass(frozen=True)
class Zero1Config:
  axis_name: str
  reduce: str = "reduce_scatter"
  bucket_bytes: int = 1 << 26
  gather_bucket_bytes: int | None = None
  master_dtype: Any = jnp.float32
  max_grad_norm: float | None = None
  loss_scale: precision.LossScale | None = None
  reduce_dtype: Any = None
  check_elementwise: bool = True
  clip_rule: str = "optax"
  inplace_bytes: int | None | str = "auto"
  stage: int = 1   # 2: train_step reduces gradients in the backward (zero2.py)
  param_specs: Any = dataclasses.field(default=None, compare=False)
  # Plain-jit mode (core/jit_mode.py): the mesh when none is set or placed
  # (jax.eval_shape(init) before jax.set_mesh), the logical axis rules for
  # nn.LogicallyPartitioned params, and the state placement check.
  mesh: Any = dataclasses.field(default=None, compare=False)
  logical_axis_rules: Any = dataclasses.field(default=None, compare=False)
  check_placement: bool = True
  # "pinned_host": the sharded state lives in host memory (core/offload.py).
  offload: str | None = None

  def inplace_threshold(self, num_shards: int = 2,
                        platform: str | None = None,
                        across_hosts: str | None = None,
                        reduced_by_jit: bool = False) -> int | None:
    """``inplace_bytes`` resolved for a program compiled for ``platform``
    (the mesh's devices' ``platform``: 'gpu', 'tpu', 'cpu'; None: jax's
    default backend). ``"auto"`` is 64 KiB on platforms whose collective
    combiners merge per-leaf collectives (GPU, TPU), for stage 2 (its point
    is the memory) and on one device (no collective is left); None (pack
    every leaf) for stage 1 on CPU with N > 1, where collectives are not
    combined and each costs a rendezvous of all devices (measured in
    ``make bench``, model s: in place, a reduce-scatter and an all-gather
    per large leaf instead of one of each made the overhead above the floor
    about 2x the packed one, 2.07x at N=8 and 1.69x at N=2).

    ``across_hosts``: the collectives asked about, where the data axis
    spans several GPU hosts (measured there only; XLA's cost model of
    H100s, 8 a host). ``"auto"`` packs every leaf for them:

    - ``"hooks"``: stage 1's backward hooks (plain jit with
      ``z1.value_and_grad``), bucketed in the backward's order, filled
      from its end (:func:`~zero1_jax.core.zero2.hook_groups`). In place,
      the small leaves shared a bucket that completed only at the
      backward's end. GPT-2 fp32 on 32 H100s: 19,532 µs packed (20,540
      filled from the start), 23,808 in place; DDP 20,531. Stage 2's hooks
      stay in place, each gradient freed once reduced (its point); packed
      as well they gained 1-2% there (zero2 on 32 H100s 20,109 µs against
      20,213 with the gathers alone packed).
    - ``"gathers"``: the stored shards' gathers at the start of
      :func:`zero1_jax.train_step`, in buckets of at most 64 MiB: fewer,
      larger collectives over the network. GPT-2 fp32 on 32 H100s,
      ``train_step`` 19,122 µs against 20,040 in place. Each packed leaf
      is copied out of its bucket before the forward reads it, so BERT-base
      fp32's peak stays 2 MiB above in place (1,769 MiB against 1,767).

    On one host in place is ahead (GPT-2 fp32 on 8 H100s, plain jit:
    15,672 µs against 16,172 packed).

    ``reduced_by_jit``: the gathers of an update handed gradients jit's
    partitioner reduced already (``jax.grad`` under plain jit,
    :mod:`~zero1_jax.core.jit_mode`'s REDUCED). ``"auto"`` packs them on
    GPU, one host or many: no leaf's gather can start with its own gradient
    there, only after XLA's combined reduce-scatter, so fewer and fuller
    gathers finish sooner. 8 H100s, XLA's cost model: BERT-base fp32
    11,162 µs against 11,432 in place, GPT-2 fp32 18,027 against 18,411
    (GSPMD 11,230 / 18,098)."""
    if self.inplace_bytes != "auto":
      return self.inplace_bytes
    platform = platform or jax.default_backend()
    if platform == "gpu" and reduced_by_jit:
      return None
    if platform == "gpu" and (across_hosts == "gathers" or (
        across_hosts == "hooks" and self.stage == 1)):
      return None
    if self.stage == 2 or num_shards == 1 or platform != "cpu":
      return 1 << 16
    return None

  def __post_init__(self):
    if self.stage not in (1, 2):
      raise ValueError(f"stage must be 1 or 2, got {self.stage!r}")
    if self.reduce not in ("reduce_scatter", "all_reduce"):
      raise ValueError(f"reduce must be 'reduce_scatter' or 'all_reduce', got "
                       f"{self.reduce!r}")
    if self.inplace_bytes not in (None, "auto") and int(self.inplace_bytes) < 0:
      raise ValueError(f"inplace_bytes must be >= 0, None (pack every leaf) or "
                       f"'auto', got {self.inplace_bytes!r}")
    for name in ("bucket_bytes", "gather_bucket_bytes"):
      v = getattr(self, name)
      if v is not None and int(v) < 1:
        raise ValueError(f"{name} must be a positive byte count, got {v}")
    if self.max_grad_norm is not None and not self.max_grad_norm > 0:
      raise ValueError("max_grad_norm must be > 0 (or None for no clipping), "
                       f"got {self.max_grad_norm}")
    if self.clip_rule not in ("optax", "deepspeed"):
      raise ValueError(f"clip_rule must be 'optax' or 'deepspeed', got "
                       f"{self.clip_rule!r}")
    if self.offload not in (None, ofl.HOST):
      raise ValueError(f"offload must be None or {ofl.HOST!r}, got "
                       f"{self.offload!r}")
    if not jnp.issubdtype(self.master_dtype, jnp.floating):
      raise ValueError(f"master_dtype must be floating, got {self.master_dtype}")


# zero1 clips the gradient it is handed, before the inner optimizer: with a
# MultiSteps inside, that is each micro-batch's gradient.
MULTISTEPS_CLIP = (
    "zero1(optax.MultiSteps(...), max_grad_norm=c) clips each micro-batch's "
    "gradient before MultiSteps accumulates it, as optax.chain("
    "clip_by_global_norm(c), MultiSteps(...)) does; DeepSpeed and optax."
    "MultiSteps(optax.chain(clip_by_global_norm(c), ...)) clip the "
    "accumulated gradient. For that, pass the optimizer itself and accumulate "
    "with z1.train_step(..., grad_accum_steps=k).")


class Zero1Transformation(optax.GradientTransformationExtraArgs):
  """An optax GradientTransformationExtraArgs with ZeRO-1 extras.

  ``update(grads, state, params, **extra_args)`` forwards extra keyword
  arguments (e.g. ``value=loss``) to the inner optimizer's update when it
  takes them (``optax.with_extra_args_support``: a plain
  GradientTransformation ignores them), as ``optax.chain`` does.

  Attributes (set by :func:`zero1`): ``config`` (:class:`Zero1Config`),
  ``inner`` (the wrapped transformation), ``init_from(params, values)``
  (the state for training ``params``, whose dtypes decide which leaves keep a
  master, with the master shards taken from ``values``: e.g. fp32 weights
  before their cast to bf16), ``apply(grads, state, params)``
  returning ``(new_params, new_state, StepInfo)`` without materialising an
  update tree (what :func:`zero1_jax.train_step` uses; with
  ``pre_reduced=True`` ``grads`` are the summed shards stage 2's backward
  produced, see :mod:`zero1_jax.core.zero2`), and ``loss_scaler(params)``
  returning the loss-scale policy for a param tree.

  Wrapping ``optax.MultiSteps``, it keeps MultiSteps' own methods:
  ``has_updated(state)`` (read on the zero1 state, which reads like
  MultiSteps') and ``gradient_transformation()`` (this transformation).
  """

  def has_updated(self, state) -> jax.Array:
    """``optax.MultiSteps.has_updated``: whether the last update applied the
    accumulated gradient."""
    if not isinstance(self.inner, optax.MultiSteps):
      raise AttributeError(
          f"has_updated: zero1 wraps {type(self.inner).__name__}, not "
          f"optax.MultiSteps")
    return self.inner.has_updated(state)

  def gradient_transformation(self) -> "Zero1Transformation":
    """``optax.MultiSteps.gradient_transformation``: itself, already one."""
    return self
