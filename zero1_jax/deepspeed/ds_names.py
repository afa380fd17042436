"""DeepSpeed engine names a ported training loop calls, and what to use here.

``Engine.train_batch(batch)`` is DeepSpeed's whole ``forward`` / ``backward``
/ ``step`` loop in one call (JAX differentiates the loss function), so most
of DeepSpeed's per-phase methods have no counterpart; reaching for one
raises an AttributeError that names the replacement.

Example:
  >>> print(hint("backward"))
  Engine has no 'backward' (DeepSpeed's): engine.train_batch(batch) does forward, backward and step in one call, from loss_fn
"""
from __future__ import annotations

_ONE_CALL = ("engine.train_batch(batch) does forward, backward and step in one "
             "call, from loss_fn")
REPLACEMENTS: dict[str, str] = {
    "forward": _ONE_CALL, "backward": _ONE_CALL, "step": _ONE_CALL,
    "zero_grad": "no gradient buffers persist between steps: train_batch "
                 "computes them anew",
    "module": "engine.params are the parameters; the model is your loss_fn",
    "optimizer": "engine.tx (the optax transformation) and engine.opt_state",
    "lr_scheduler": "engine.get_lr(); the schedule is inside engine.tx",
    "get_mom": "the betas are in the config's optimizer params",
    "train_micro_batch_size_per_gpu":
        "engine.config.train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "engine.config.gradient_accumulation_steps",
    "is_gradient_accumulation_boundary":
        "train_batch accumulates inside: every call ends at a boundary",
    "get_global_grad_norm": "metrics = engine.train_batch(batch); "
                            "metrics['grad_norm']",
    "was_step_applied": "not engine.train_batch(batch)['skipped']",
    "cur_scale": "engine.loss_scale",
    "fp16_enabled": "engine.config.fp16.enabled",
    "bfloat16_enabled": "engine.config.bf16.enabled",
    "global_rank": "jax.process_index() (a rank here is a device of the mesh)",
    "local_rank": "jax.process_index() (a rank here is a device of the mesh)",
    "world_size": "engine.config.world_size",
    "dp_world_size": "engine.config.world_size",
}
# deepspeed.initialize's keywords for a torch model.
INITIALIZE_KWARGS = ("model", "model_parameters", "optimizer", "lr_scheduler",
                     "training_data", "args", "collate_fn", "config_params",
                     "dist_init_required", "mpu")


def hint(name: str) -> str | None:
  """The AttributeError message for DeepSpeed's ``name``, or None."""
  if name not in REPLACEMENTS:
    return None
  return f"Engine has no {name!r} (DeepSpeed's): {REPLACEMENTS[name]}"


def initialize_error(kwargs: dict) -> TypeError:
  names = ", ".join(sorted(kwargs))
  return TypeError(
      f"initialize() got DeepSpeed's keyword(s) {names}: here it takes "
      f"config=, loss_fn=(params, batch) -> loss, params= (a pytree) and "
      f"mesh=, and returns the engine alone (DeepSpeed returns engine, "
      f"optimizer, dataloader, lr_scheduler)")


class CallableInt(int):
  """An int that DeepSpeed's method form (``engine.train_batch_size()``)
  may also call."""

  def __call__(self) -> int:
    return int(self)
