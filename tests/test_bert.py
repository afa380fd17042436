"""Fast CPU tests for zero1_jax.models.bert (tiny BERT MLM) and zero1_jax.data."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zero1_jax import data
from zero1_jax.models import bert

SEQ = 16
TINY = bert.BertConfig(vocab_size=data.VOCAB_SIZE, hidden_size=32, num_layers=2, num_heads=2,
                       intermediate_size=64, max_len=SEQ)


@pytest.fixture(scope="module")
def corpus() -> bytes:
  return data.load_corpus(None)


@pytest.fixture(scope="module")
def batch(corpus: bytes) -> dict[str, np.ndarray]:
  return data.MLMBatches(corpus, seq_len=SEQ, batch_size=8, seed=0).batch_at(0)


def test_bert_base_param_count() -> None:
  cfg = bert.make_config("bert-base-uncased", vocab_size=30522, max_len=512)
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size) == (
      12, 768, 12, 3072)
  shapes = jax.eval_shape(lambda k: bert.init_params(cfg, k), jax.random.key(0))
  n = bert.num_params(shapes)
  assert 105e6 < n < 115e6, n


def test_sizes_and_unknown_name() -> None:
  for name, kw in bert.SIZES.items():
    cfg = bert.make_config(name, vocab_size=data.VOCAB_SIZE, max_len=128)
    assert cfg.intermediate_size == 4 * cfg.hidden_size == 4 * kw["hidden_size"]
  assert bert.make_config("bert-large-uncased", 100, 8).num_layers == 24
  with pytest.raises(ValueError, match="bert-tiny"):
    bert.make_config("bert-gigantic", 100, 8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_loss_finite_in_each_dtype(dtype, batch) -> None:
  cfg = dataclasses.replace(TINY, dtype=dtype)
  params = bert.init_params(cfg, jax.random.key(0), param_dtype=dtype)
  assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(dtype)}
  loss_fn = bert.make_loss_fn(cfg)
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
  assert loss.dtype == jnp.float32
  assert np.isfinite(float(loss))
  assert abs(float(loss) - np.log(data.VOCAB_SIZE)) < 1.5  # near-uniform at init
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  logits = jax.jit(bert.BertMLM(cfg).apply)({"params": params}, batch["input_ids"])
  assert logits.shape == (8, SEQ, data.VOCAB_SIZE) and logits.dtype == jnp.float32


def test_loss_without_masked_positions_is_zero(batch) -> None:
  params = bert.init_params(TINY, jax.random.key(0))
  no_mask = dict(batch, labels=np.full_like(batch["labels"], -100))
  loss, grads = jax.jit(jax.value_and_grad(bert.make_loss_fn(TINY)))(params, no_mask)
  assert float(loss) == 0.0
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_adam_lowers_loss_on_fixed_batch(batch) -> None:
  params = bert.init_params(TINY, jax.random.key(1))
  loss_fn = bert.make_loss_fn(TINY)
  opt = optax.adam(1e-2)
  state = opt.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(30):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  final = float(jax.jit(loss_fn)(params, batch))
  assert np.all(np.isfinite(losses))
  assert final < 0.5 * losses[0], (losses[0], final)


def test_dropout_uses_rng(batch) -> None:
  cfg = dataclasses.replace(TINY, dropout_rate=0.5)
  params = bert.init_params(cfg, jax.random.key(0))
  loss_fn = jax.jit(bert.make_loss_fn(cfg))
  assert float(loss_fn(params, batch)) == float(loss_fn(params, batch))
  a = loss_fn(params, batch, jax.random.key(1))
  b = loss_fn(params, batch, jax.random.key(2))
  assert float(a) != float(b)


def test_batch_at_is_deterministic(corpus) -> None:
  mk = lambda seed: data.MLMBatches(corpus, seq_len=SEQ, batch_size=4, seed=seed)
  a, b = mk(0), mk(0)
  for step in (0, 5, 123):
    x, y = a.batch_at(step), b.batch_at(step)
    assert set(x) == {"input_ids", "labels"}
    for k in x:
      assert x[k].dtype == np.int32 and x[k].shape == (4, SEQ)
      np.testing.assert_array_equal(x[k], y[k])
  assert not np.array_equal(a.batch_at(0)["input_ids"], a.batch_at(1)["input_ids"])
  assert not np.array_equal(a.batch_at(0)["input_ids"], mk(1).batch_at(0)["input_ids"])
  # resuming iteration at step s gives the same batches as batch_at(s), s+1, ...
  it = a.iter_from(7)
  for s in (7, 8):
    np.testing.assert_array_equal(next(it)["labels"], a.batch_at(s)["labels"])
  resumed = data.MLMBatches(corpus, seq_len=SEQ, batch_size=4, seed=0, start_step=3)
  np.testing.assert_array_equal(next(iter(resumed))["input_ids"], a.batch_at(3)["input_ids"])


def test_masking_and_labels(corpus) -> None:
  batches = data.MLMBatches(corpus, seq_len=64, batch_size=64, seed=3)
  b = batches.batch_at(0)
  ids, labels = b["input_ids"], b["labels"]
  masked = labels != -100
  assert np.all(ids[:, 0] == data.CLS_ID) and np.all(ids[:, -1] == data.SEP_ID)
  assert not masked[:, 0].any() and not masked[:, -1].any()
  assert np.all((labels[masked] >= 0) & (labels[masked] < 256))
  assert np.all(labels[~masked] == -100)
  # unmasked positions carry the original bytes; byte ids stay in vocab
  assert np.all((ids >= 0) & (ids < data.VOCAB_SIZE))
  assert np.all(ids[:, 1:-1][~masked[:, 1:-1]] < 256)
  frac = masked[:, 1:-1].mean()
  assert 0.12 < frac < 0.18, frac
  as_mask = (ids == data.MASK_ID)
  assert np.all(masked[as_mask])  # [MASK] only appears at labelled positions
  assert 0.7 < as_mask.sum() / masked.sum() < 0.9
  # the corpus window is recoverable: labels are the true bytes there
  kept = masked & (ids == labels)
  assert 0.02 < kept.sum() / masked.sum() < 0.25


def test_default_corpus_and_tokenizer(corpus, tmp_path) -> None:
  assert isinstance(corpus, bytes) and len(corpus) > 100_000
  assert len(corpus) <= data.DEFAULT_CORPUS_CAP
  assert data.VOCAB_SIZE == 260 and {data.PAD_ID, data.MASK_ID} <= set(range(256, 260))
  assert data.decode(data.encode("héllo")) == "héllo"
  f = tmp_path / "tiny.txt"
  f.write_text("abc")
  assert data.load_corpus(str(f)) == b"abc"
  b = data.MLMBatches(data.load_corpus(str(f)), seq_len=SEQ, batch_size=2, seed=0).batch_at(0)
  assert b["input_ids"].shape == (2, SEQ)
