"""A DeepSpeed config file's text, read as DeepSpeed 0.19 reads it: JSON,
or the Hjson it also accepts, with duplicate keys an error."""
from __future__ import annotations

import hjson
import json

from zero1_jax.deepspeed.schema import ConfigError


def _no_duplicates(pairs):
  keys = [k for k, _ in pairs]
  dup = sorted({k for k in keys if keys.count(k) > 1})
  if dup:
    raise ConfigError(f"Duplicate keys in DeepSpeed config: {dup}")
  return dict(pairs)


def parse_text(text: str, source: str = "the config"):
  """A DeepSpeed config file's text, read as DeepSpeed 0.19 reads it
  (``runtime/config.py``: ``hjson.load`` with duplicate keys an error): JSON,
  plus the comments, unquoted keys and strings Hjson allows. Text that is
  plain JSON is read by ``json`` (Hjson would make ``1.0`` the int 1).

  >>> parse_text('{"train_batch_size": 8, zero_optimization: {stage: 1}}  # 1 node')
  {'train_batch_size': 8, 'zero_optimization': {'stage': 1}}
  """
  try:   # plain JSON as JSON: 1.0 stays a float (Hjson reads it as 1)
    return json.loads(text, object_pairs_hook=_no_duplicates)
  except json.JSONDecodeError:
    pass
  except ConfigError as e:
    raise ConfigError(f"{source!r}: {e}") from None
  try:
    return hjson.loads(text, object_pairs_hook=_no_duplicates)
  except hjson.HjsonDecodeError as e:
    raise ConfigError(f"invalid JSON in {source!r} at line {e.lineno} column "
                      f"{e.colno} (char {e.pos}): {e.msg}") from e
  except ConfigError as e:
    raise ConfigError(f"{source!r}: {e}") from None
