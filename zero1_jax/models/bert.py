"""A small, self-contained Flax linen BERT for masked-language modelling.

Post-LN encoder blocks, learned token + position embeddings and an MLM head
whose output projection is tied to the token embedding. Layer norms, the
attention softmax and the loss are always computed in float32, so the
parameters and the compute dtype may be float16/bfloat16.

Example::

    import jax, jax.numpy as jnp
    from zero1_jax.models import bert

    cfg = bert.make_config("bert-tiny", vocab_size=260, max_len=128)
    params = bert.init_params(cfg, jax.random.key(0), param_dtype=jnp.bfloat16)
    loss_fn = bert.make_loss_fn(cfg)
    batch = {"input_ids": jnp.zeros((2, 16), jnp.int32),
             "labels": jnp.full((2, 16), -100, jnp.int32).at[:, 3].set(65)}
    loss = loss_fn(params, batch)          # float32 scalar
    print(bert.num_params(params))
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
PyTree = Any

IGNORE_INDEX = -100

# Standard BERT sizes (Turc et al. 2019 for the small ones; Devlin et al. 2019).
SIZES: dict[str, dict[str, int]] = {
    "bert-tiny": dict(num_layers=2, hidden_size=128, num_heads=2),
    "bert-mini": dict(num_layers=4, hidden_size=256, num_heads=4),
    "bert-small": dict(num_layers=4, hidden_size=512, num_heads=8),
    "bert-medium": dict(num_layers=8, hidden_size=512, num_heads=8),
    "bert-base-uncased": dict(num_layers=12, hidden_size=768, num_heads=12),
    "bert-large-uncased": dict(num_layers=24, hidden_size=1024, num_heads=16),
}
for _kw in SIZES.values():
  _kw["intermediate_size"] = 4 * _kw["hidden_size"]
del _kw


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Hyper-parameters of :class:`BertMLM`. ``dtype`` is the compute dtype."""

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  intermediate_size: int
  max_len: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  layer_norm_eps: float = 1e-12
  init_std: float = 0.02

  def __post_init__(self) -> None:
    if self.hidden_size % self.num_heads:
      raise ValueError(
          f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")


def make_config(name: str, vocab_size: int, max_len: int, dtype: Any = jnp.float32,
                **overrides: Any) -> BertConfig:
  """Config for one of the standard ``SIZES`` (``overrides`` e.g. dropout_rate=0.1)."""
  if name not in SIZES:
    raise ValueError(f"unknown BERT size {name!r}; choose one of: {', '.join(SIZES)}")
  kwargs = {**SIZES[name], **overrides}
  return BertConfig(vocab_size=vocab_size, max_len=max_len, dtype=dtype, **kwargs)


def _init(cfg: BertConfig) -> Callable:
  return nn.initializers.truncated_normal(cfg.init_std)


def _layer_norm(cfg: BertConfig, name: str, x: Array) -> Array:
  """LayerNorm evaluated in float32 (fp32 params); output cast to the compute dtype.

  Call only from inside a ``@nn.compact`` method (the module binds to the caller).
  """
  y = nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=jnp.float32,
                   param_dtype=jnp.float32, name=name)(x.astype(jnp.float32))
  return y.astype(cfg.dtype)


class _SelfAttention(nn.Module):
  cfg: BertConfig

  @nn.compact
  def __call__(self, x: Array, bias: Array | None, deterministic: bool) -> Array:
    cfg = self.cfg
    b, l, _ = x.shape
    head_dim = cfg.hidden_size // cfg.num_heads
    dense = lambda name, bias=True: nn.Dense(
        cfg.hidden_size, dtype=cfg.dtype, kernel_init=_init(cfg), use_bias=bias,
        name=name)
    split = lambda t: t.reshape(b, l, cfg.num_heads, head_dim)
    q = split(dense("query")(x)) * jnp.asarray(1.0 / math.sqrt(head_dim), cfg.dtype)
    # No key bias: it adds q.b_k to a whole row of logits, which softmax
    # ignores, so its true gradient is zero and Adam would only amplify the
    # rounding noise of that zero into full-size steps.
    k = split(dense("key", bias=False)(x))
    v = split(dense("value")(x))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    if bias is not None:
      logits = logits + bias
    probs = jax.nn.softmax(logits, axis=-1)  # fp32 softmax
    probs = nn.Dropout(cfg.dropout_rate)(probs, deterministic=deterministic)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(cfg.dtype), v)
    return dense("out")(ctx.reshape(b, l, cfg.hidden_size))


class _EncoderBlock(nn.Module):
  """Post-LN transformer block: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

  cfg: BertConfig

  @nn.compact
  def __call__(self, x: Array, bias: Array | None, deterministic: bool) -> Array:
    cfg = self.cfg
    drop = nn.Dropout(cfg.dropout_rate)
    h = _SelfAttention(cfg, name="attention")(x, bias, deterministic)
    x = _layer_norm(cfg, "attention_ln", x + drop(h, deterministic=deterministic))
    h = nn.Dense(cfg.intermediate_size, dtype=cfg.dtype, kernel_init=_init(cfg),
                 name="intermediate")(x)
    h = nn.gelu(h, approximate=False)
    h = nn.Dense(cfg.hidden_size, dtype=cfg.dtype, kernel_init=_init(cfg), name="output")(h)
    return _layer_norm(cfg, "output_ln", x + drop(h, deterministic=deterministic))


class BertMLM(nn.Module):
  """BERT encoder + tied MLM head. Returns float32 logits ``[B, L, vocab]``."""

  cfg: BertConfig

  @nn.compact
  def __call__(self, input_ids: Array, attention_mask: Array | None = None,
               deterministic: bool = True) -> Array:
    cfg = self.cfg
    seq_len = input_ids.shape[-1]
    if seq_len > cfg.max_len:
      raise ValueError(f"sequence length {seq_len} > max_len {cfg.max_len}")
    embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                     embedding_init=_init(cfg), name="token_embed")
    pos = self.param("position_embed", _init(cfg), (cfg.max_len, cfg.hidden_size),
                     jnp.float32)
    x = embed(input_ids) + pos[:seq_len].astype(cfg.dtype)[None]
    x = _layer_norm(cfg, "embed_ln", x)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)

    bias = None
    if attention_mask is not None:  # [B, L], nonzero = attend
      keep = attention_mask.astype(bool)[:, None, None, :]
      bias = jnp.where(keep, 0.0, -1e9).astype(jnp.float32)
    for i in range(cfg.num_layers):
      x = _EncoderBlock(cfg, name=f"layer_{i:02d}")(x, bias, deterministic)

    # MLM head: dense + gelu + LN, then decoder tied to the token embedding.
    h = nn.Dense(cfg.hidden_size, dtype=cfg.dtype, kernel_init=_init(cfg),
                 name="mlm_transform")(x)
    h = _layer_norm(cfg, "mlm_ln", nn.gelu(h, approximate=False))
    logits = embed.attend(h).astype(jnp.float32)
    out_bias = self.param("mlm_bias", nn.initializers.zeros, (cfg.vocab_size,), jnp.float32)
    return logits + out_bias.astype(jnp.float32)


def init_params(cfg: BertConfig, rng: Array, param_dtype: Any = jnp.float32) -> PyTree:
  """Initialise the parameters (a nested dict) and cast every leaf to ``param_dtype``.

  Traceable, so ``jax.eval_shape(lambda k: init_params(cfg, k), key)`` gives shapes
  without allocating.
  """
  dummy = jnp.zeros((1, min(cfg.max_len, 8)), jnp.int32)

  @jax.jit
  def _init_fn(key: Array) -> PyTree:
    params = BertMLM(cfg).init(key, dummy)["params"]
    return jax.tree.map(lambda p: p.astype(param_dtype), params)

  return _init_fn(rng)


def make_loss_fn(cfg: BertConfig) -> Callable[..., Array]:
  """``loss_fn(params, batch, rng=None) -> float32 scalar``.

  Mean cross-entropy over positions with ``labels != -100``; 0.0 if none are
  masked. An optional ``batch["attention_mask"]`` is honoured. Dropout is only
  applied when ``rng`` is given and ``cfg.dropout_rate > 0``.
  """
  model = BertMLM(cfg)

  def loss_fn(params: PyTree, batch: Mapping[str, Array], rng: Array | None = None) -> Array:
    train = rng is not None and cfg.dropout_rate > 0
    logits = model.apply({"params": params}, batch["input_ids"],
                         batch.get("attention_mask"), deterministic=not train,
                         rngs={"dropout": rng} if train else None)
    labels = jnp.asarray(batch["labels"])
    mask = labels != IGNORE_INDEX
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.where(mask, labels, 0)[..., None], axis=-1)[..., 0]
    total = jnp.sum(jnp.where(mask, nll, 0.0))
    count = jnp.sum(mask).astype(jnp.float32)
    return total / jnp.maximum(count, 1.0)

  return loss_fn


def num_params(params: PyTree) -> int:
  """Total number of scalars in ``params`` (arrays or ``jax.ShapeDtypeStruct`` leaves)."""
  return sum(math.prod(p.shape) for p in jax.tree.leaves(params))
