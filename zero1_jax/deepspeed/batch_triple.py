"""What one data-parallel rank is: the batch triple and the keys that change it.

``train_batch_size = train_micro_batch_size_per_gpu x
gradient_accumulation_steps x world size``, two of them derive the third as
DeepSpeed 0.19.8's ``runtime/config.py`` does (:func:`resolve`);
``sequence_parallel_size`` and ``gradient_allreduce_op="sum"``, which would
change what a rank is or how it reduces, are refused
(:func:`check_parallelism`).

Example:
  >>> resolve({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4)
  (32, 4, 2)
"""
from __future__ import annotations

from typing import Mapping

from zero1_jax.deepspeed.schema import ConfigError, as_int


def resolve(raw: Mapping, ws: int) -> tuple[int, int, int]:
  """runtime/config.py _set_batch_related_parameters + _batch_assertion."""
  names = ("train_batch_size", "train_micro_batch_size_per_gpu",
           "gradient_accumulation_steps")
  tb, mb, ga = (None if raw.get(k) is None else as_int(k, raw[k]) for k in names)
  given = None not in (tb, mb, ga)
  mb_derived = raw.get(names[1]) is None
  if ga is not None and ga <= 0:
    raise ConfigError(f"Gradient accumulation steps: {ga} has to be greater "
                      "than 0")
  if None not in (tb, mb, ga):
    pass
  elif tb is not None and mb is not None:
    ga = tb // mb // ws if mb > 0 else 0
  elif tb is not None and ga is not None:
    mb = tb // ws // ga
  elif mb is not None and ga is not None:
    tb = mb * ga * ws
  elif tb is not None:
    ga, mb = 1, tb // ws
  elif mb is not None:
    tb, ga = mb * ws, 1
  else:
    raise ConfigError("Either train_batch_size or "
                      "train_micro_batch_size_per_gpu needs to be provided")
  for value, what in ((tb, "Train batch size"),
                      (mb, "Micro batch size per gpu"),
                      (ga, "Gradient accumulation steps")):
    if value <= 0:
      raise ConfigError(f"{what}: {value} has to be greater than 0")
  if tb != mb * ga * ws:
    # DeepSpeed's words, then which value would make the rule hold.
    fix = (f"gradient_accumulation_steps {tb // (mb * ws)} would make it hold "
           f"with the other two" if tb % (mb * ws) == 0 else
           f"train_batch_size must be a multiple of devices x "
           f"gradient_accumulation_steps = {ws * ga}" if mb_derived else
           f"train_batch_size must be a multiple of micro batch x devices = "
           f"{mb * ws}")
    rest = ("; or leave one of the three out, or \"auto\" in zero1-train, "
            "and it is derived" if given else
            f"; the values not given were derived from {tb} on {ws} devices")
    raise ConfigError(
        "Check batch related parameters. train_batch_size is not equal to "
        "micro_batch_per_gpu * gradient_acc_step * world_size "
        f"{tb} != {mb} * {ga} * {ws} ({fix}{rest})")
  return tb, mb, ga


def check_parallelism(raw: Mapping) -> None:
  """Keys that change what a data-parallel rank is, or reduce differently."""
  sp = raw.get("sequence_parallel_size", 1)
  if as_int("sequence_parallel_size", sp, 1) != 1:
    raise ConfigError(f"sequence_parallel_size={sp} is not supported: "
                      "zero1_jax is data parallel only (DeepSpeed would also "
                      "divide the data-parallel size by it). Remove the key.")
  op = raw.get("gradient_allreduce_op", "mean")
  if not isinstance(op, str) or op.lower() not in ("mean", "sum"):
    raise ConfigError("Invalid gradient_allreduce_op. Supported operations: "
                      f"['mean', 'sum']. Got: {op!r}")
  if op.lower() == "sum":
    raise ConfigError(
        "gradient_allreduce_op='sum' (updates from the sum of the gradients "
        "over ranks) is not supported by zero1_jax, which averages. Remove "
        "the key and multiply your loss by the data-parallel size instead.")
  if "gradient_allreduce_op" in raw:
    raw["gradient_allreduce_op"] = op.lower()
