"""DeepSpeed's monitors: ``tensorboard``, ``csv_monitor`` and ``wandb``.

The sections are read as DeepSpeed 0.19.8 reads them (``monitor/config.py``:
extra keys refused; a section given as ``"auto"`` is dropped), and the
:class:`Monitors` write what DeepSpeed's engine writes after each optimizer
step (``runtime/pipe/engine.py`` ``train_batch``, ``runtime/engine.py``
``step``): ``Train/Samples/train_loss``, ``Train/Samples/lr`` and, with fp16,
``Train/Samples/loss_scale``, each at the number of samples trained so far.
Only process 0 writes. Files go where DeepSpeed puts them:
``<output_path>/<job_name>/`` (relative paths from the working directory).

- tensorboard: ``tensorboardX`` (the library ``torch.utils.tensorboard`` was
  derived from; needs neither torch nor TensorFlow; the HF Trainer falls
  back to it too). Its synchronous ``EventsWriter``, not ``SummaryWriter``,
  whose ``flush()`` leaves events queued for a thread: each step's events are
  on disk when ``write_events`` returns, as DeepSpeed means by flushing.
- csv_monitor: one ``<name with / as _>.csv`` per event, rows ``step,value``
  under a ``step,<last part of the name>`` header (``monitor/csv_monitor.py``).
- wandb: ``wandb.init(project, group, entity=team)`` in offline mode unless
  ``WANDB_MODE`` says otherwise; ``wandb sync`` uploads the run later. Without
  the wandb package: a warning, and nothing is sent.

Example::

  cfg = parse({"csv_monitor": {"enabled": True, "output_path": "logs"}})
  m = Monitors(cfg)
  m.write_events([("Train/Samples/train_loss", 2.5, 32)])
  # logs/DeepSpeedJobName/Train_Samples_train_loss.csv: step,train_loss / 32,2.5
"""
from __future__ import annotations

import csv
import dataclasses
import os
import time
from typing import Mapping, Sequence

from zero1_jax.deepspeed import log as ds_log
from zero1_jax.deepspeed.schema import ConfigError, NotHonouredWarning, extra_key

SECTIONS = ("tensorboard", "csv_monitor", "wandb")


@dataclasses.dataclass(frozen=True)
class TensorBoardConfig:
  enabled: bool = False
  output_path: str = ""
  job_name: str = "DeepSpeedJobName"


@dataclasses.dataclass(frozen=True)
class CSVConfig:
  enabled: bool = False
  output_path: str = ""
  job_name: str = "DeepSpeedJobName"


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  enabled: bool = False
  group: str | None = None
  team: str | None = None
  project: str = "deepspeed"


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
  """The three monitor sections (monitor/config.py defaults)."""
  tensorboard: TensorBoardConfig = TensorBoardConfig()
  csv_monitor: CSVConfig = CSVConfig()
  wandb: WandbConfig = WandbConfig()

  @property
  def enabled(self) -> bool:
    return (self.tensorboard.enabled or self.csv_monitor.enabled
            or self.wandb.enabled)


_CLASSES = {"tensorboard": TensorBoardConfig, "csv_monitor": CSVConfig,
            "wandb": WandbConfig}


def _one(key: str, d) -> object:
  cls = _CLASSES[key]
  if d is None or d == "auto":
    return cls()
  if not isinstance(d, Mapping):
    raise ConfigError(f"{key}={d!r}: Input should be a valid dictionary "
                      "(DeepSpeed 0.19.8 rejects it too)")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  for k, v in d.items():
    path = f"{key}.{k}"
    if k not in fields:
      raise extra_key(key, k, fields)
    if k == "enabled":
      if not (isinstance(v, bool) or (type(v) is int and v in (0, 1))):
        raise ConfigError(f"{path}={v!r}: Input should be a valid boolean "
                          "(DeepSpeed 0.19.8 rejects it too)")
    elif not isinstance(v, str) and not (v is None and fields[k].default is None):
      raise ConfigError(f"{path}={v!r}: Input should be a valid string "
                        "(DeepSpeed 0.19.8 rejects it too)")
  return cls(**{k: bool(v) if k == "enabled" else v for k, v in d.items()})


def parse(raw: Mapping) -> MonitorConfig:
  """The monitor sections of a DeepSpeed config dict."""
  return MonitorConfig(**{k: _one(k, raw.get(k)) for k in SECTIONS})


def log_dir(section) -> str:
  """Where DeepSpeed 0.19.8 writes a tensorboard / csv_monitor section's files
  (os.path.join(output_path, job_name): its ``output_path is not None``
  branch, taken for the default "" too)."""
  return os.path.join(section.output_path, section.job_name)


class Monitors:
  """The enabled monitors of a config; ``write_events`` on process 0 only.

  Raises:
    ConfigError: tensorboard is enabled and tensorboardX is not installed.
  """

  def __init__(self, cfg: MonitorConfig, process_index: int = 0):
    self.enabled = cfg.enabled and process_index == 0
    self._tb = self._csv_dir = self._wandb = None
    self._headers: set[str] = set()
    if not self.enabled:
      return
    if cfg.tensorboard.enabled:
      try:
        from tensorboardX import summary as tb_summary
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2
      except ImportError:
        raise ConfigError(
            "tensorboard.enabled is true but the tensorboardX package is not "
            "installed: pip install 'zero1_jax[monitor]' (or tensorboardX), "
            "or set tensorboard.enabled false") from None
      path = log_dir(cfg.tensorboard)
      os.makedirs(path, exist_ok=True)
      self._tb = EventsWriter(os.path.join(path, "events"))
      self._tb_event = lambda name, value, step: event_pb2.Event(
          wall_time=time.time(), step=int(step),
          summary=tb_summary.scalar(name, float(value)))
    if cfg.csv_monitor.enabled:
      self._csv_dir = log_dir(cfg.csv_monitor)
      os.makedirs(self._csv_dir, exist_ok=True)
    if cfg.wandb.enabled:
      try:
        import wandb
      except ImportError:
        ds_log.warn("wandb.enabled is true but the wandb package is not "
                    "installed: nothing is logged to W&B (pip install "
                    "'zero1_jax[wandb]' or wandb)", NotHonouredWarning)
      else:
        self._wandb = wandb
        wandb.init(project=cfg.wandb.project, group=cfg.wandb.group,
                   entity=cfg.wandb.team,
                   mode=os.environ.get("WANDB_MODE") or "offline")

  def write_events(self, events: Sequence[tuple[str, float, int]]) -> None:
    """``(name, value, samples)`` triples, as DeepSpeed's write_events."""
    if not self.enabled:
      return
    for name, value, step in events:
      if self._tb is not None:
        self._tb.write_event(self._tb_event(name, value, step))
      if self._csv_dir is not None:
        self._csv_row(name, value, step)
      if self._wandb is not None:
        self._wandb.log({name: value}, step=step)
    if self._tb is not None:
      self._tb.flush()

  def _csv_row(self, name: str, value: float, step: int) -> None:
    stem = name.replace("/", "_").replace(" ", "_")
    path = os.path.join(self._csv_dir, stem + ".csv")
    with open(path, "a+", newline="") as f:
      w = csv.writer(f)
      # DeepSpeed writes the header once per process; a resumed run's rows
      # go under the first run's header here instead of a second one.
      if stem not in self._headers and f.tell() == 0:
        w.writerow(["step", name.split("/")[-1]])
      self._headers.add(stem)
      w.writerow([step, value])

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None
