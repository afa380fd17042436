"""``"auto"`` in a DeepSpeed JSON, filled the way the HF Trainer fills it.

DeepSpeed itself rejects ``"auto"`` outside ``fp16``/``bf16``/
``zero_optimization``; the HF Trainer replaces each one with its
``TrainingArguments`` value before DeepSpeed sees the config
(``transformers/integrations/deepspeed.py``, ``trainer_config_process`` and
``trainer_config_finalize``). ``zero1-train`` takes HF-style flags, so it
does the same: an ``"auto"`` takes the flag's value when the flag is given,
otherwise the ``TrainingArguments`` default (:data:`HF_DEFAULTS`). The batch
sizes HF would compute follow DeepSpeed's own rule instead
(train_batch_size = micro batch x accumulation x data-parallel size), from
whatever the flags and the JSON give.

Example:
  >>> raw = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
  ...        "gradient_clipping": "auto", "optimizer": {"type": "AdamW",
  ...        "params": {"lr": "auto", "weight_decay": "auto"}}}
  >>> filled = fill(raw, flags={"lr": 1e-4}, max_steps=100, hidden_size=128)
  >>> raw["train_micro_batch_size_per_gpu"], "train_batch_size" in raw
  (8, False)
  >>> raw["gradient_clipping"], raw["optimizer"]["params"]
  (1.0, {'lr': 0.0001, 'weight_decay': 0.0})
  >>> filled[0]
  'train_micro_batch_size_per_gpu=8 (HF default per_device_train_batch_size)'
"""

from __future__ import annotations

from typing import Any

# transformers.TrainingArguments defaults for the values DeepSpeed's "auto" takes.
HF_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
               "max_grad_norm": 1.0, "learning_rate": 5e-5, "adam_beta1": 0.9,
               "adam_beta2": 0.999, "adam_epsilon": 1e-8, "weight_decay": 0.0,
               "fp16": False, "bf16": False}

# with_overrides names of the optimizer flags (``__`` separates the path).
WEIGHT_DECAY = "optimizer__params__weight_decay"
EPS = "optimizer__params__eps"
BETAS = "optimizer__params__betas"

_BATCH = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
          "train_batch_size")


def has_auto(node: Any) -> bool:
  """Whether ``"auto"`` appears anywhere in the JSON value ``node``."""
  if isinstance(node, dict):
    return any(has_auto(v) for v in node.values())
  if isinstance(node, list):
    return any(has_auto(v) for v in node)
  return node == "auto"


def hf_optimizer(raw: dict, *, flags: dict, max_steps: int) -> str | None:
  """A JSON without an ``optimizer`` section gets the optimizer the HF Trainer
  builds then (``trainer.create_optimizer()``: torch AdamW from its
  arguments), and without a ``scheduler`` section too, the Trainer's default
  linear schedule (warmup over --warmup_steps, decay to 0 at --max_steps).
  Edits ``raw``; returns the line saying so, or None with an optimizer.
  ``flags`` as for :func:`fill`.

  >>> raw = {"train_batch_size": 8}
  >>> hf_optimizer(raw, flags={"lr": 1e-3}, max_steps=10)[:59]
  "no 'optimizer' in the JSON: the HF Trainer's AdamW(lr=0.001"
  >>> raw["scheduler"]
  {'type': 'HFLinear', 'params': {'num_warmup_steps': 0, 'num_training_steps': 10}}
  """
  if raw.get("optimizer") is not None:
    return None
  def pick(flag, default):
    value = flags.get(flag)
    return (value, True) if value is not None else (HF_DEFAULTS[default], False)
  lr, lr_given = pick("lr", "learning_rate")
  wd, _ = pick(WEIGHT_DECAY, "weight_decay")
  eps, _ = pick(EPS, "adam_epsilon")
  betas = flags.get(BETAS) or [HF_DEFAULTS["adam_beta1"], HF_DEFAULTS["adam_beta2"]]
  if wd:
    raise ValueError(
        f"--weight_decay {wd} with no 'optimizer' section: the HF Trainer's "
        "AdamW leaves biases and LayerNorm weights undecayed, which a "
        "DeepSpeed optimizer section cannot say (it decays every parameter). "
        "Add an \"optimizer\" section with weight_decay (all parameters), or "
        "drop --weight_decay")
  raw["optimizer"] = {"type": "AdamW", "params": {
      "lr": lr, "betas": list(betas), "eps": eps, "weight_decay": wd}}
  what = (f"the HF Trainer's AdamW(lr={lr!r}, betas=({betas[0]!r}, "
          f"{betas[1]!r}), eps={eps!r}, weight_decay={wd!r}) from "
          f"{'--learning_rate' if lr_given else 'HF default learning_rate'}, "
          "--adam_beta1/2, --adam_epsilon, --weight_decay (HF defaults where "
          "not given)")
  if raw.get("scheduler") is None:
    warmup = flags.get("warmup_steps") or 0
    raw["scheduler"] = {"type": "HFLinear", "params": {
        "num_warmup_steps": warmup, "num_training_steps": max_steps}}
    what += (f" and its linear schedule (0 to lr over --warmup_steps {warmup}, "
             f"then down to 0 at --max_steps {max_steps})")
  return f"no 'optimizer' in the JSON: {what}, as the Trainer builds them"


def fill(raw: dict, *, flags: dict, max_steps: int, hidden_size: int) -> list[str]:
  """Replaces the ``"auto"`` values of ``raw`` in place; returns one
  ``key=value (source)`` line per value filled or key dropped.

  ``flags``: the command line's values under their DeepSpeed names
  (``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
  ``train_batch_size``, ``lr``, ``fp16``, ``bf16``, ``gradient_clipping``,
  :data:`WEIGHT_DECAY`, :data:`EPS`, :data:`BETAS`) and ``warmup_steps``;
  None when not given. Raises ValueError for an 'auto' no value can fill.
  """
  done: list[str] = []

  def put(node: dict, key: str, path: str, value, source: str) -> None:
    if node.get(key) == "auto":
      node[key] = value
      done.append(f"{path}={value!r} ({source})")

  # Batch triple: a given flag fills its own key; the other 'auto's are
  # dropped so DeepSpeed derives them. With no batch flag and no
  # train_batch_size in the JSON, the micro batch takes HF's default
  # per_device_train_batch_size.
  given = {k: flags.get(k) for k in _BATCH if flags.get(k) is not None}
  for k in _BATCH:
    if raw.get(k) == "auto" and k in given:
      put(raw, k, k, given[k], "flag")
  if not given and raw.get("train_batch_size") in (None, "auto"):
    if raw.get("train_batch_size") == "auto" and _BATCH[0] not in raw:
      # HF fills train_batch_size from its default micro batch; DeepSpeed
      # then derives that micro batch back: the same as setting it.
      raw[_BATCH[0]] = "auto"
    put(raw, _BATCH[0], _BATCH[0], HF_DEFAULTS["per_device_train_batch_size"],
        "HF default per_device_train_batch_size")
  derived = [k for k in _BATCH if raw.get(k) == "auto"]
  for k in derived:
    del raw[k]
  if derived:
    done.append(f"{' and '.join(derived)} derived by DeepSpeed's rule "
                "(train_batch_size = micro batch x accumulation x devices)")

  def flag_or_default(flag: str, default: str):
    if flags.get(flag) is not None:
      return flags[flag], "flag"
    return HF_DEFAULTS[default], f"HF default {default}"

  put(raw, "gradient_clipping", "gradient_clipping",
      *flag_or_default("gradient_clipping", "max_grad_norm"))

  opt = (raw.get("optimizer") or {}).get("params")
  lr_flag = flags.get("lr")
  lr = lr_flag if lr_flag is not None else HF_DEFAULTS["learning_rate"]
  if isinstance(opt, dict):
    src = "flag --learning_rate" if lr_flag is not None else "HF default learning_rate"
    put(opt, "lr", "optimizer.params.lr", lr, src)
    if isinstance(opt.get("lr"), (int, float)) and lr_flag is None:
      lr = opt["lr"]     # warmup_max_lr below follows the optimizer's lr
    if flags.get(BETAS) is not None:
      put(opt, "betas", "optimizer.params.betas", flags[BETAS], "flags")
    put(opt, "betas", "optimizer.params.betas",
        [HF_DEFAULTS["adam_beta1"], HF_DEFAULTS["adam_beta2"]],
        "HF default adam_beta1, adam_beta2")
    put(opt, "eps", "optimizer.params.eps", *flag_or_default(EPS, "adam_epsilon"))
    put(opt, "weight_decay", "optimizer.params.weight_decay",
        *flag_or_default(WEIGHT_DECAY, "weight_decay"))

  sched = (raw.get("scheduler") or {}).get("params")
  if isinstance(sched, dict):
    put(sched, "warmup_min_lr", "scheduler.params.warmup_min_lr", 0, "HF: 0")
    put(sched, "warmup_max_lr", "scheduler.params.warmup_max_lr", lr,
        "the optimizer's learning rate")
    # transformers 5.x keeps it positive, as DeepSpeed >= 0.19.6 requires
    # (integrations/deepspeed.py trainer_config_finalize).
    warmup = flags.get("warmup_steps") or 0
    put(sched, "warmup_num_steps", "scheduler.params.warmup_num_steps",
        max(1, warmup), "HF: max(1, --warmup_steps)")
    put(sched, "total_num_steps", "scheduler.params.total_num_steps", max_steps,
        "--max_steps")

  for name in ("fp16", "bf16"):
    section = raw.get(name)
    if isinstance(section, dict):
      flag = flags.get(name)
      put(section, "enabled", f"{name}.enabled",
          bool(flag) if flag is not None else HF_DEFAULTS[name],
          f"flag --{name}" if flag is not None else f"HF default {name}")

  zero = raw.get("zero_optimization")
  if isinstance(zero, dict):
    put(zero, "reduce_bucket_size", "zero_optimization.reduce_bucket_size",
        hidden_size * hidden_size, "HF: hidden_size^2")
  return done
