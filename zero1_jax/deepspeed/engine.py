"""``initialize()`` and the ``Engine``: a DeepSpeed config, run on a JAX mesh.

Example:
  >>> import jax, jax.numpy as jnp, zero1_jax as z1
  >>> cfg = {"train_batch_size": 4, "zero_optimization": {"stage": 1},
  ...        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> loss = lambda p, b: jnp.mean((b["x"] * p["w"]) ** 2)
  >>> engine = z1.initialize(config=cfg, loss_fn=loss,
  ...                        params={"w": jnp.ones(3)}, mesh=mesh)
  >>> m = engine.train_batch({"x": jnp.ones((4, 3))})
  >>> engine.global_steps
  1
  >>> [round(float(w), 4) for w in engine.params["w"]]   # Adam's first step: -lr x sign(grad)
  [0.99, 0.99, 0.99]
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from zero1_jax.deepspeed import config as zconfig
from zero1_jax import checkpoint, distributed, inspect
from zero1_jax.deepspeed import ds_names
from zero1_jax.deepspeed import log as ds_log
from zero1_jax.deepspeed import memory_log
from zero1_jax.deepspeed import monitor as ds_monitor
from zero1_jax.deepspeed import optim as ds_optim
from zero1_jax.deepspeed import resume
from zero1_jax.deepspeed import schedules
# the config -> tx rules (tx.py); importable from here as before
from zero1_jax.deepspeed.tx import (build_tx, compute_dtype,  # noqa: F401
                                    loss_scale_policy, run_stage)
from zero1_jax.core import batch as zbatch
from zero1_jax.core import step as zstep

logger = logging.getLogger("zero1_jax")


def make_step(config: zconfig.DeepSpeedConfig, tx: Any, loss_fn: Callable,
              mesh: jax.sharding.Mesh, *, has_aux: bool = False) -> Callable:
  """The jitted step :class:`Engine` runs (``z1.train_step`` with the
  config's accumulation): ``step.lower(params, opt_state, batch)`` compiles
  the engine's program on abstract arguments too."""
  return zstep.train_step(loss_fn, tx, mesh,
                          grad_accum_steps=config.gradient_accumulation_steps,
                          has_aux=has_aux)


class Engine:
  """Holds params, sharded optimizer state and counters; one call a step.

  Attributes:
    params: replicated parameters (in the fp16/bf16 compute dtype if the
      config enables one; the fp32 master copy lives in ``opt_state``).
    opt_state: the sharded :class:`zero1_jax.Zero1State`.
    global_steps: optimizer steps taken, skipped ones included (DeepSpeed).
    skipped_steps: steps skipped for fp16 overflow or a non-finite gradient
      norm (fp32, bf16 with check_grad_overflow), as DeepSpeed 0.19.
    steps_per_print: log DeepSpeed's ``step=, skipped=, lr=`` line (and the
      loss) at INFO every this many steps (the config's); None (DeepSpeed
      0.19's default): never.
    config: the resolved :class:`zero1_jax.DeepSpeedConfig`.
    tx: the :func:`zero1_jax.zero1` (or ``zero2``) transformation it built.
    mesh: the device mesh.
  """

  def __init__(self, config: zconfig.DeepSpeedConfig, loss_fn: Callable,
               params: Any, mesh: jax.sharding.Mesh, *, axis_name: str = "data",
               has_aux: bool = False):
    self.config, self.mesh, self.axis_name = config, mesh, axis_name
    self.tx = build_tx(config, axis_name)
    # The fp32 master copy is taken from the params as given, before the cast
    # to the compute dtype, so nothing is lost.
    self.params, self.opt_state = zstep.init(
        self.tx, params, mesh, param_dtype=compute_dtype(config))
    self.global_steps = 0
    self.skipped_steps = 0
    # DeepSpeed's monitors' x-axis: samples trained (runtime/engine.py)
    self.global_samples = 0
    self.monitor = ds_monitor.Monitors(config.monitor, jax.process_index())
    # DeepSpeed's step line every steps_per_print steps; None (0.19.8's
    # default, runtime/constants.py:46): no line
    self.steps_per_print: int | None = config.steps_per_print
    self._ckpts: dict = {}
    self._batch_checked = False   # multi-process: the same batch everywhere
    self._step = make_step(config, self.tx, loss_fn, mesh, has_aux=has_aux)

  @property
  def train_batch_size(self) -> int:
    """An int; ``engine.train_batch_size()`` (DeepSpeed's form) works too."""
    return ds_names.CallableInt(self.config.train_batch_size)

  def __getattr__(self, name: str):
    # only reached when the attribute does not exist: DeepSpeed's names
    # say what to use instead
    raise AttributeError(ds_names.hint(name) or
                         f"'Engine' object has no attribute {name!r}")

  def __call__(self, *args, **kwargs):
    raise TypeError(ds_names.hint("forward"))

  def train_batch(self, batch: Any) -> dict:
    """One optimizer step on ``train_batch_size`` examples.

    In a multi-process run every process passes the same global batch and
    feeds only its own devices' rows (``jax.make_array_from_process_local_data``).

    Raises:
      ValueError: the batch's leading dimension is not train_batch_size.
      RuntimeError: fp16 overflow at the minimum loss scale (as DeepSpeed).
    """
    size = zbatch.leading_size(batch)
    if size != self.train_batch_size:
      raise ValueError(
          f"train_batch: the batch's leading dimension {size} "
          f"!= train_batch_size {self.train_batch_size} (= micro batch "
          f"{self.config.train_micro_batch_size_per_gpu} x accumulation "
          f"{self.config.gradient_accumulation_steps} x devices "
          f"{self.config.world_size}).")
    if jax.process_count() > 1:   # each process keeps only its own rows
      if not self._batch_checked:
        distributed.check_same_batch(batch, "train_batch")
        self._batch_checked = True
      batch = distributed.global_batch(batch, self.mesh, self.axis_name)
    f = self.config.fp16
    dynamic = f.enabled and f.dynamic_loss_scale
    # DeepSpeed raises on an overflow only where it would halve the scale
    # (hysteresis used up) and the scale is at its minimum already.
    tried = (float(self.opt_state.loss_scale.scale),
             int(self.opt_state.loss_scale.hysteresis)) if dynamic else None
    due = dynamic and (int(f.hysteresis) == 1 or tried[1] == 1)
    self.params, self.opt_state, metrics = self._step(
        self.params, self.opt_state, batch)
    self.global_steps += 1
    self.global_samples += self.config.train_batch_size
    if self.monitor.enabled:
      self._write_monitor(metrics)
    if bool(metrics["skipped"]):
      self.skipped_steps += 1
      if jax.process_index() == 0:
        logger.info(_overflow_line(tried, due,
                                   float(self.opt_state.loss_scale.scale)))
      if due and float(metrics["loss_scale"]) <= float(f.min_loss_scale):
        lower = (", or lower fp16.min_loss_scale" if float(f.min_loss_scale) > 1
                 else "")
        raise RuntimeError(
            "Current loss scale already at minimum - cannot decrease scale "
            f"anymore (fp16.min_loss_scale={f.min_loss_scale}). Lower the "
            f"learning rate, or use bf16{lower}.")
    every = self.steps_per_print
    if every and self.global_steps % every == 0 and jax.process_index() == 0:
      logger.info("[Rank 0] step=%d, skipped=%d, lr=%s, loss=%.4f",
                  self.global_steps, self.skipped_steps, self.get_lr(),
                  float(metrics["loss"]))
    return metrics

  def _write_monitor(self, metrics) -> None:
    """DeepSpeed's events after a step (runtime/pipe/engine.py train_batch,
    runtime/engine.py step): the loss, the next update's lr, fp16's scale."""
    n = self.global_samples
    events = [("Train/Samples/train_loss", float(metrics["loss"]), n)]
    events += [("Train/Samples/lr", lr, n) for lr in self.get_lr()[:1]]
    if self.config.fp16.enabled:
      events.append(("Train/Samples/loss_scale", self.loss_scale, n))
    self.monitor.write_events(events)

  # -- checkpoints (orbax; see zero1_jax.checkpoint) -------------------------

  def _checkpointer(self, directory, max_to_keep=None, *, saving=False):
    """The directory's Checkpointer. A save with another ``max_to_keep``
    than the cached one's (a load's comes first, with None) replaces it, so
    the limit holds after a resume."""
    key = os.path.abspath(os.fspath(directory))
    old = self._ckpts.get(key)
    if old is not None and saving and old.max_to_keep != max_to_keep:
      old.close()
      old = None
    if old is None:
      self._ckpts[key] = checkpoint.Checkpointer(key, max_to_keep=max_to_keep)
    return self._ckpts[key]

  def save_checkpoint(self, save_dir, tag: int | None = None,
                      client_state: dict | None = None, *,
                      extra: dict | None = None,
                      max_to_keep: int | None = None) -> int:
    """Saves params, sharded state, loss scale, counters and the config;
    returns the step saved under.

    Each device writes only its own shards; the save is asynchronous (the
    next step may start at once; :meth:`wait_checkpoints` blocks). ``tag``
    is the step number to save under (default: ``global_steps``; DeepSpeed's
    ``"global_step12"`` tags are step numbers here: ``tag=12``).
    ``client_state`` (DeepSpeed's name; ``extra`` is the same) is a JSON-able
    dict that :meth:`load_checkpoint` returns.
    """
    if client_state is not None and extra is not None:
      raise ValueError("save_checkpoint: give client_state or extra, not both "
                       "(they are the same thing)")
    if tag is not None and not str(tag).isdigit():
      raise ValueError(
          f"save_checkpoint: tag={tag!r}: tags are step numbers here (a "
          f"DeepSpeed tag 'global_step12' is tag=12); the default is "
          f"global_steps ({self.global_steps})")
    step = self.global_steps if tag is None else int(tag)
    extra = {"global_steps": self.global_steps,
             "skipped_steps": self.skipped_steps,
             "global_samples": self.global_samples,
             **(client_state if client_state is not None else extra or {})}
    self._checkpointer(save_dir, max_to_keep, saving=True).save(
        step, self.params, self.opt_state, extra=extra,
        config=self.config.to_dict(), force=True)
    return step

  def load_checkpoint(self, load_dir, tag: int | None = None, *,
                      fallback_to_valid: bool = False) -> tuple[str, dict]:
    """Restores checkpoint ``tag``, at this engine's N whatever N it was
    saved at. Returns ``(load_path, client_state)`` as DeepSpeed does: the
    step's directory, and the dict saved with it (``client_state`` /
    ``extra``, plus ``global_steps`` and ``skipped_steps``).

    With no ``tag``, as DeepSpeed, the step of the last
    :meth:`save_checkpoint` into ``load_dir`` (its ``latest`` file), even
    when a higher step is there from an earlier run; a directory without
    that file (written by :class:`zero1_jax.checkpoint.Checkpointer`) gives
    its highest committed step, and so does a ``latest`` whose save never
    committed (with a warning).

    Raises:
      zero1_jax.checkpoint.UnreadableCheckpointError: ``load_dir`` does not
        exist (nothing is created), holds no committed step, or the step is
        damaged.
    """
    if "://" not in str(load_dir) and not os.path.isdir(load_dir):
      raise checkpoint.UnreadableCheckpointError(
          f"zero1 checkpoint: {os.path.abspath(load_dir)} does not exist")
    ckpt = self._checkpointer(load_dir)
    if tag is None:
      resume.warn_uncommitted_latest(ckpt)
    try:
      self.params, self.opt_state, extra = ckpt.restore(
          tag, self.tx, self.params, self.mesh,
          fallback_to_valid=fallback_to_valid)
    except checkpoint.CheckpointMismatchError as e:
      hint = resume.config_change(ckpt, ckpt.restored_step or tag,
                                  self.config.to_dict())
      if not hint:
        raise
      raise checkpoint.CheckpointMismatchError(f"{e}. {hint}") from None
    self.global_steps = int(extra.get("global_steps", 0))
    self.skipped_steps = int(extra.get("skipped_steps", 0))
    self.global_samples = int(extra.get(
        "global_samples", self.global_steps * self.config.train_batch_size))
    return os.path.join(ckpt.directory, str(ckpt.restored_step)), extra

  def wait_checkpoints(self) -> None:
    for c in self._ckpts.values():
      c.wait()

  def step_memory(self, batch: Any) -> dict[str, int]:
    """Per-device bytes of the compiled step for ``batch``
    (:func:`zero1_jax.inspect.memory`: argument, output, alias, temp, peak).

    Compiles the step ahead of time; the next :meth:`train_batch` with a
    batch of the same shapes reuses that executable.
    """
    if jax.process_count() > 1:
      batch = distributed.global_batch(batch, self.mesh, self.axis_name)
    return inspect.memory(self._step, self.params, self.opt_state, batch)

  @property
  def loss_scale(self) -> float:
    return float(self.opt_state.loss_scale.scale)

  def get_lr(self) -> list[float]:
    """DeepSpeed's ``get_lr()``: the rate the optimizer holds now, which is
    the rate of the *next* update (DeepSpeed steps its scheduler after each
    applied update; before the first, the first update's), one per parameter
    group (one here). A skipped step does not advance it."""
    states = [x for x in jax.tree.leaves(
        self.opt_state.inner, is_leaf=lambda x: isinstance(
            getattr(x, "hyperparams", None), dict))
              if isinstance(getattr(x, "hyperparams", None), dict)
              and "learning_rate" in x.hyperparams]
    if not states:
      return []
    lr = ds_optim.resolve_optimizer(self.config.optimizer)["lr"]
    if self.config.scheduler is None:
      return [float(lr)]
    schedule = schedules.build_schedule(self.config.scheduler, lr)
    return [float(schedule(jnp.asarray(states[0].count)))]

  def memory_report(self) -> dict:
    """Optimizer-state bytes (master copy + moments) measured from the live
    arrays: what the first device holds, and what every device would hold
    with the same state replicated (the global arrays' size)."""
    state = (self.opt_state.master, self.opt_state.inner)
    return {"sharded_bytes": inspect.device_bytes(state, self.mesh.devices.flat[0]),
            "replicated_bytes": sum(x.nbytes for x in jax.tree.leaves(state)),
            "num_devices": self.mesh.shape[self.axis_name]}


def initialize(config: str | os.PathLike | Mapping | zconfig.DeepSpeedConfig
               = None, loss_fn: Callable = None, params: Any = None,
               mesh: jax.sharding.Mesh | None = None, *, axis_name: str = "data",
               has_aux: bool = False, coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               heartbeat_timeout_seconds: int = 100,
               initialization_timeout: int = 300,
               **deepspeed_kwargs: Any) -> Engine:
  """DeepSpeed's ``deepspeed.initialize`` for a JAX loss function.

  Logs DeepSpeed's optimizer-memory lines once, on process 0 (the state's
  bytes replicated and per device; :mod:`zero1_jax.deepspeed.memory_log`).

  Args:
    config: a DeepSpeed JSON path, dict, or loaded config.
    loss_fn: ``loss_fn(params, batch) -> mean loss`` over a micro-batch (or
      ``(loss, aux)`` with ``has_aux``).
    params: the initial parameter pytree (fp32 recommended: it seeds the
      fp32 master copy).
    mesh: default: all devices (of all processes) on one ``axis_name`` axis.
    coordinator_address, num_processes, process_id: join a multi-process
      runtime first (:func:`zero1_jax.distributed.initialize`); must come
      before anything touches the devices. ``heartbeat_timeout_seconds`` and
      ``initialization_timeout`` are passed on to it.

  Raises:
    TypeError: DeepSpeed's torch keywords (``model=``, ``model_parameters=``,
      ...), with what to pass instead.
  """
  unknown = set(deepspeed_kwargs) - set(ds_names.INITIALIZE_KWARGS)
  if unknown:
    raise TypeError(f"initialize() got an unexpected keyword argument "
                    f"{sorted(unknown)[0]!r}")
  if deepspeed_kwargs:
    raise ds_names.initialize_error(deepspeed_kwargs)
  missing = [n for n, v in (("config", config), ("loss_fn", loss_fn),
                            ("params", params)) if v is None]
  if missing:
    raise TypeError(f"initialize() needs {', '.join(missing)}: "
                    f"initialize(config=..., loss_fn=(params, batch) -> loss, "
                    f"params=..., mesh=...)")
  ds_log.show_info()
  distributed.initialize(coordinator_address, num_processes, process_id,
                         heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                         initialization_timeout=initialization_timeout)
  if mesh is None:
    mesh = jax.make_mesh((jax.device_count(),), (axis_name,))
  if axis_name not in mesh.axis_names:
    raise ValueError(f"mesh has axes {tuple(mesh.axis_names)}; initialize "
                     f"needs the data axis '{axis_name}' (pass axis_name=).")
  world = mesh.shape[axis_name]
  if isinstance(config, zconfig.DeepSpeedConfig):
    if config.world_size != world:
      raise zconfig.ConfigError(
          f"config was resolved for world_size {config.world_size} but the "
          f"mesh's '{axis_name}' axis has {world} devices.")
    cfg = config
  else:
    cfg = zconfig.load_config(config, world_size=world)
  engine = Engine(cfg, loss_fn, params, mesh, axis_name=axis_name,
                  has_aux=has_aux)
  memory_log.log(engine)   # DeepSpeed's Before/After lines, process 0
  return engine


def _overflow_line(tried: tuple | None, halved: bool, new_scale: float) -> str:
  """DeepSpeed's INFO line for a skipped step (runtime/fp16/loss_scaler.py
  273-285, 0.19.6): ``tried`` the dynamic scale and hysteresis the step
  ran with (None: no dynamic scale, the bare line)."""
  line = "OVERFLOW! Rank 0 Skipping step."
  if tried is None:
    return line
  scale, hysteresis = tried
  if halved:
    return f"{line} Attempted loss scale: {int(scale)}, reducing to {int(new_scale)}"
  return (f"{line} Attempted loss scale: {int(scale)}, but hysteresis is "
          f"{hysteresis}. Reducing hysteresis to {hysteresis - 1}")
