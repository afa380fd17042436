"""A GPT-2-style decoder in Flax linen: the causal-LM counterpart of :mod:`.bert`.

Pre-LN blocks (fused QKV projection, causal softmax attention, 4x GELU MLP),
learned token and position embeddings, a final LayerNorm and an output
projection tied to the token embedding, as in GPT-2 (Radford et al. 2019).
Layer norms, the softmax and the loss run in float32 whatever the parameter
and compute dtypes. ``gpt2`` is GPT-2 small: 12 layers of width 768 (124.4M
parameters with GPT-2's 50,257-token vocabulary and 1,024 positions).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from zero1_jax.models import gpt
  >>> cfg = gpt.make_config("gpt2", vocab_size=260, max_len=16, num_layers=1,
  ...                       hidden_size=32, num_heads=2)
  >>> params = gpt.init_params(cfg, jax.random.key(0))
  >>> loss = gpt.make_loss_fn(cfg)(params, {"input_ids": jnp.zeros((2, 16), jnp.int32)})
  >>> loss.dtype, gpt.num_params(params)
  (dtype('float32'), 21600)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from zero1_jax.models.bert import num_params  # noqa: F401  (same count)

Array = jax.Array
PyTree = Any

SIZES: dict[str, dict[str, int]] = {
    "gpt2": dict(num_layers=12, hidden_size=768, num_heads=12),
    "gpt2-medium": dict(num_layers=24, hidden_size=1024, num_heads=16),
}


@dataclasses.dataclass(frozen=True)
class GptConfig:
  """Hyper-parameters of :class:`GptLM`. ``dtype`` is the compute dtype."""

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  max_len: int
  dtype: Any = jnp.float32
  layer_norm_eps: float = 1e-5
  init_std: float = 0.02

  def __post_init__(self) -> None:
    if self.hidden_size % self.num_heads:
      raise ValueError(
          f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")


def make_config(name: str, vocab_size: int, max_len: int, dtype: Any = jnp.float32,
                **overrides: Any) -> GptConfig:
  """Config for one of ``SIZES`` (``overrides`` replace any field)."""
  if name not in SIZES:
    raise ValueError(f"unknown GPT size {name!r}; choose one of: {', '.join(SIZES)}")
  return GptConfig(vocab_size=vocab_size, max_len=max_len, dtype=dtype,
                   **{**SIZES[name], **overrides})


def _ln(cfg: GptConfig, name: str, x: Array) -> Array:
  y = nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=jnp.float32,
                   param_dtype=jnp.float32, name=name)(x.astype(jnp.float32))
  return y.astype(cfg.dtype)


class _Block(nn.Module):
  """x += attn(LN(x)); x += mlp(LN(x))."""

  cfg: GptConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.cfg
    b, l, d = x.shape
    heads, hd = cfg.num_heads, d // cfg.num_heads
    dense = lambda n, name, std=cfg.init_std: nn.Dense(
        n, dtype=cfg.dtype, kernel_init=nn.initializers.normal(std), name=name)
    # GPT-2 scales the residual projections' init by 1/sqrt(2 * layers).
    resid_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    qkv = dense(3 * d, "attn_qkv")(_ln(cfg, "ln_1", x)).reshape(b, l, 3, heads, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((l, l), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(cfg.dtype), v).reshape(b, l, d)
    x = x + dense(d, "attn_out", resid_std)(ctx)
    h = nn.gelu(dense(4 * d, "mlp_fc")(_ln(cfg, "ln_2", x)), approximate=True)
    return x + dense(d, "mlp_out", resid_std)(h)


class GptLM(nn.Module):
  """Token ids ``[B, L]`` -> float32 next-token logits ``[B, L, vocab]``."""

  cfg: GptConfig

  @nn.compact
  def __call__(self, input_ids: Array) -> Array:
    cfg = self.cfg
    seq_len = input_ids.shape[-1]
    if seq_len > cfg.max_len:
      raise ValueError(f"sequence length {seq_len} > max_len {cfg.max_len}")
    init = nn.initializers.normal(cfg.init_std)
    wte = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                   embedding_init=init, name="token_embed")
    wpe = self.param("position_embed", init, (cfg.max_len, cfg.hidden_size),
                     jnp.float32)
    x = wte(input_ids) + wpe[:seq_len].astype(cfg.dtype)[None]
    for i in range(cfg.num_layers):
      x = _Block(cfg, name=f"block_{i:02d}")(x)
    return wte.attend(_ln(cfg, "ln_f", x)).astype(jnp.float32)


def init_params(cfg: GptConfig, rng: Array, param_dtype: Any = jnp.float32) -> PyTree:
  """The parameters (a nested dict), every leaf cast to ``param_dtype``;
  traceable, so ``jax.eval_shape`` gives the shapes without allocating."""
  dummy = jnp.zeros((1, min(cfg.max_len, 8)), jnp.int32)

  @jax.jit
  def _init_fn(key: Array) -> PyTree:
    params = GptLM(cfg).init(key, dummy)["params"]
    return jax.tree.map(lambda p: p.astype(param_dtype), params)

  return _init_fn(rng)


def make_loss_fn(cfg: GptConfig) -> Callable[..., Array]:
  """``loss_fn(params, batch) -> float32 scalar``: the mean next-token
  cross-entropy of ``batch["input_ids"]`` (position t predicts token t+1)."""
  model = GptLM(cfg)

  def loss_fn(params: PyTree, batch: Mapping[str, Array]) -> Array:
    ids = jnp.asarray(batch["input_ids"])
    logits = model.apply({"params": params}, ids[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll)

  return loss_fn
