"""Offline, deterministic MLM data: a byte-level tokenizer, a text corpus and batches.

Token ids 0..255 are raw bytes; 256..259 are the specials PAD, MASK, CLS, SEP
(``VOCAB_SIZE == 260``). The default corpus is the Python standard library's own
source, which exists on every machine, so nothing is downloaded. Batches are a
pure function of ``(seed, step)``: a run resumed at step ``s`` sees exactly the
data it would have seen without the interruption. numpy only, no jax.

Example::

    from zero1_jax import data

    corpus = data.load_corpus(None)            # stdlib *.py sources, <= 8 MB
    batches = data.MLMBatches(corpus, seq_len=128, batch_size=32, seed=0)
    b = batches.batch_at(7)                    # {"input_ids", "labels"}: int32 [32, 128]
    for step, b in zip(range(100, 110), batches.iter_from(100)):
        ...
"""
from __future__ import annotations

import functools
import os
import sysconfig
from typing import Iterator

import numpy as np

PAD_ID = 256
MASK_ID = 257
CLS_ID = 258
SEP_ID = 259
VOCAB_SIZE = 260
IGNORE_INDEX = -100

DEFAULT_CORPUS_CAP = 8 * 1024 * 1024
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def encode(text: str | bytes) -> np.ndarray:
  """UTF-8 bytes of ``text`` as int32 token ids (no specials added)."""
  raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
  return np.frombuffer(raw, dtype=np.uint8).astype(np.int32)


def decode(ids: np.ndarray | list[int]) -> str:
  """Inverse of :func:`encode`; specials are rendered as ``[PAD]``, ``[MASK]`` etc."""
  names = {PAD_ID: "[PAD]", MASK_ID: "[MASK]", CLS_ID: "[CLS]", SEP_ID: "[SEP]"}
  out, buf = [], bytearray()
  for i in np.asarray(ids).reshape(-1).tolist():
    if 0 <= i < 256:
      buf.append(i)
      continue
    out.append(buf.decode("utf-8", errors="replace"))
    buf = bytearray()
    out.append(names.get(i, f"[{i}]"))
  out.append(buf.decode("utf-8", errors="replace"))
  return "".join(out)


@functools.lru_cache(maxsize=1)
def _stdlib_corpus(cap: int) -> bytes:
  root = sysconfig.get_paths()["stdlib"]
  files: list[str] = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
  files.sort(key=lambda p: os.path.relpath(p, root))
  parts, size = [], 0
  for path in files:
    try:
      with open(path, "rb") as fh:
        text = fh.read()
    except OSError:
      continue
    if not text:
      continue
    parts.append(text)
    size += len(text) + 1
    if size >= cap:
      break
  return b"\n".join(parts)[:cap]


def load_corpus(train_file: str | None = None, cap: int = DEFAULT_CORPUS_CAP) -> bytes:
  """Raw bytes of ``train_file``, or by default the stdlib ``.py`` sources (sorted, capped).

  An explicit ``train_file`` is read whole (``cap`` only applies to the default).
  """
  if train_file is not None:
    with open(train_file, "rb") as fh:
      corpus = fh.read()
  else:
    corpus = _stdlib_corpus(cap)
  if not corpus:
    raise ValueError(f"empty corpus ({train_file or 'stdlib sources'})")
  return corpus


class MLMBatches:
  """Masked-LM batches over random windows of ``corpus``, deterministic in (seed, step).

  Each row is ``[CLS] <seq_len-2 corpus bytes> [SEP]``. Every byte position is
  selected with probability ``mask_prob``; of those 80% become ``[MASK]``, 10% a
  random byte, 10% stay unchanged. ``labels`` holds the original byte at selected
  positions and -100 everywhere else.
  """

  def __init__(self, corpus: bytes, seq_len: int, batch_size: int, seed: int,
               mask_prob: float = 0.15, start_step: int = 0) -> None:
    if seq_len < 3:
      raise ValueError(f"seq_len must be >= 3, got {seq_len}")
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0.0 <= mask_prob <= 1.0:
      raise ValueError(f"mask_prob must be in [0, 1], got {mask_prob}")
    if not corpus:
      raise ValueError("empty corpus")
    self.seq_len, self.batch_size = int(seq_len), int(batch_size)
    self.seed, self.mask_prob, self.start_step = int(seed), float(mask_prob), int(start_step)
    self._window = self.seq_len - 2
    data = np.frombuffer(bytes(corpus), dtype=np.uint8)
    if data.size < self._window:  # tiny corpus: repeat it so one window fits
      data = np.resize(data, self._window)
    self._data = data

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """The batch for ``step``: ``input_ids`` and ``labels``, int32 ``[batch_size, seq_len]``."""
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    rng = np.random.default_rng([self.seed, int(step)])
    b, w = self.batch_size, self._window
    starts = rng.integers(0, self._data.size - w + 1, size=b)
    text = self._data[starts[:, None] + np.arange(w)].astype(np.int32)

    selected = rng.random((b, w)) < self.mask_prob
    action = rng.random((b, w))
    random_bytes = rng.integers(0, 256, size=(b, w), dtype=np.int32)
    corrupted = np.where(selected & (action < 0.8), MASK_ID, text)
    corrupted = np.where(selected & (action >= 0.8) & (action < 0.9), random_bytes, corrupted)
    labels = np.where(selected, text, IGNORE_INDEX).astype(np.int32)

    input_ids = np.empty((b, self.seq_len), np.int32)
    input_ids[:, 0], input_ids[:, -1], input_ids[:, 1:-1] = CLS_ID, SEP_ID, corrupted
    full_labels = np.full((b, self.seq_len), IGNORE_INDEX, np.int32)
    full_labels[:, 1:-1] = labels
    return {"input_ids": input_ids, "labels": full_labels}

  def iter_from(self, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches for ``start_step, start_step + 1, ...``."""
    step = int(start_step)
    while True:
      yield self.batch_at(step)
      step += 1

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches starting at ``self.start_step``."""
    return self.iter_from(self.start_step)
