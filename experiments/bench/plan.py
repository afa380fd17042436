"""Set-up of the ZeRO-1 benchmark (:mod:`experiments.bench`): what is measured.

The methods and their labels, the model sizes, the :class:`Plan` of one run
(and the ``QUICK`` preset), the mesh, the models and batches, the optimizer,
the compiled donating steps (:func:`build`) and the ZeRO paper's theory of
per-device bytes and ring traffic (the ``*_theory`` functions).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType

import zero1_jax as z1
from experiments import baselines as bl
from zero1_jax import data
from zero1_jax.models import bert

METHODS = ("zero1_rs", "zero1_ar", "ddp", "gspmd")
# The no-communication floor (fwd + bwd + local SGD): built by the overhead
# section only, since it trains nothing useful.
FLOOR = "floor"
LABELS = {"zero1_rs": "ZeRO-1 (reduce-scatter)", "zero1_ar": "ZeRO-1 (all-reduce)",
          "ddp": "DDP", "gspmd": "GSPMD", FLOOR: "floor (no communication)",
          "zero2": "ZeRO-2"}
COLORS = {"zero1_rs": "tab:blue", "zero1_ar": "tab:cyan", "ddp": "tab:red",
          "gspmd": "tab:green", FLOOR: "tab:gray", "zero2": "tab:purple"}
K = 12  # ZeRO paper: bytes of Adam state per parameter (fp32 master, mu, nu)

# Small BERTs (custom ``make_config`` overrides of bert-tiny; head_dim 64 or
# less, FFN 4x) so that eight simulated devices fit two CPU cores.
SIZES: dict[str, dict[str, int]] = {
    "xxs": dict(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=128),
    "xs": dict(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=256),
    "s": dict(hidden_size=128, num_layers=4, num_heads=2, intermediate_size=512),
    "m": dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024),
    "l": dict(hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1536),
    # standard sizes for a real accelerator
    "bert-small": dict(hidden_size=512, num_layers=4, num_heads=8, intermediate_size=2048),
    "bert-base": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072),
}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
DEFAULT_BUCKET = 1 << 26
DEFAULT_INPLACE = z1.Zero1Config("data").inplace_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one run measures."""

  ns: tuple[int, ...] = (1, 2, 4, 8)
  state_size: str = "s"              # model for the state and memory sections
  speed_sizes: tuple[str, ...] = ("xs", "s", "m")
  ratio_sizes: tuple[str, ...] = ("s", "m")   # headline step-time ratios
  bucket_size: str = "m"
  buckets: tuple[int, ...] = (1 << 18, 1 << 20, 1 << 22, 1 << 24, DEFAULT_BUCKET)
  seq_len: int = 64
  per_device_batch: int = 2          # memory section (weak scaling)
  global_batch: int = 16             # speed and bucket sections
  dtypes: tuple[str, ...] = ("fp32", "bf16")
  speed_budget_s: float = 45.0       # timing seconds per model size
  min_rounds: int = 7
  max_rounds: int = 41
  warmup: int = 2
  overhead_ns: tuple[int, ...] = (2, 8)   # overhead-above-the-floor section
  adam_bw_psi: int = 0               # 0: skip the Adam bandwidth section
  hbm_tb_s: float = 4.8              # roofline for adam_bw (H200: 4.8 TB/s)


QUICK = Plan(ns=(1, 8), overhead_ns=(2,), state_size="xxs", speed_sizes=("xxs", "xs"),
             ratio_sizes=("xxs", "xs"), bucket_size="xxs",
             buckets=(1 << 14, DEFAULT_BUCKET), seq_len=16, per_device_batch=1,
             global_batch=8, dtypes=("fp32",), speed_budget_s=2.0,
             min_rounds=3, max_rounds=7, warmup=1)


# ------------------------------------------------------------------ set-up


def make_mesh(n: int) -> jax.sharding.Mesh:
  """A 1-D ``data`` mesh over the first ``n`` devices, classic GSPMD (Auto)
  axis type so that the GSPMD baseline is what MaxText compiles."""
  if n > jax.device_count():
    raise ValueError(f"need {n} devices, have {jax.device_count()}")
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                       axis_types=(AxisType.Auto,))


@dataclasses.dataclass
class Model:
  size: str
  dtype: str
  cfg: bert.BertConfig
  params: Any            # host (numpy) copy; every method gets its own device copy
  loss_fn: Callable
  psi: int


_MODELS: dict[tuple, Model] = {}


def model(size: str, dtype: str, seq_len: int) -> Model:
  key = (size, dtype, seq_len)
  if key not in _MODELS:
    dt = DTYPES[dtype]
    cfg = bert.make_config("bert-tiny", vocab_size=data.VOCAB_SIZE, max_len=seq_len,
                           dtype=dt, **SIZES[size])
    params = jax.device_get(bert.init_params(cfg, jax.random.key(0), param_dtype=dt))
    _MODELS[key] = Model(size, dtype, cfg, params, bert.make_loss_fn(cfg),
                         bert.num_params(params))
  return _MODELS[key]


_CORPUS: list[bytes] = []


def batch(global_batch: int, seq_len: int, step: int = 0) -> dict[str, np.ndarray]:
  if not _CORPUS:
    _CORPUS.append(data.load_corpus(None, cap=1 << 20))
  return data.MLMBatches(_CORPUS[0], seq_len, global_batch, seed=0).batch_at(step)


def device_batch(b: dict, n: int) -> dict:
  """``b`` placed on the first ``n`` devices, split over ``data`` on dim 0
  (what every method's step is compiled for, so timing has no transfer)."""
  sharding = jax.sharding.NamedSharding(make_mesh(n), jax.sharding.PartitionSpec("data"))
  return {k: jax.device_put(np.asarray(v), sharding) for k, v in b.items()}


def optimizer() -> optax.GradientTransformation:
  return optax.adamw(1e-4, weight_decay=0.01)


@dataclasses.dataclass
class Built:
  """A compiled, donating step and the live (params, state) it updates."""

  method: str
  n: int
  compiled: Any
  params: Any
  state: Any
  compile_s: float

  def run(self, b) -> Any:
    self.params, self.state, metrics = self.compiled(self.params, self.state, b)
    return metrics

  def block(self) -> None:
    jax.block_until_ready((self.params, self.state))


_BUILT: dict[tuple, Built] = {}


def _key(method, m: Model, n, b, bucket_bytes, inplace_bytes):
  shapes = tuple(sorted((k, np.shape(v)) for k, v in b.items()))
  return (method, m.size, m.dtype, m.cfg.max_len, n, shapes, bucket_bytes, inplace_bytes)


def build(method: str, m: Model, n: int, b, bucket_bytes: int = DEFAULT_BUCKET,
          keep: bool = False, inplace_bytes: int | None = DEFAULT_INPLACE) -> Built:
  """Initialises ``method`` for model ``m`` on N devices and compiles its step.

  ``keep``: remember the result so a later section with the same model, N and
  batch shape reuses it (its params and state have moved on; shapes have not).
  ``bucket_bytes`` / ``inplace_bytes``: ZeRO's, see
  :func:`zero1_jax.core.layout.plan_buckets`.
  """
  key = _key(method, m, n, b, bucket_bytes, inplace_bytes)
  if key in _BUILT:
    return _BUILT[key]
  built = _build(method, m, n, b, bucket_bytes, inplace_bytes)
  if keep:
    _BUILT[key] = built
  return built


def _build(method: str, m: Model, n: int, b, bucket_bytes: int,
           inplace_bytes: int | None) -> Built:
  mesh = make_mesh(n)
  t0 = time.perf_counter()
  if method in ("zero1_rs", "zero1_ar"):
    tx = z1.zero1(optimizer(), axis_name="data", bucket_bytes=bucket_bytes,
                  inplace_bytes=inplace_bytes,
                  reduce="reduce_scatter" if method == "zero1_rs" else "all_reduce")
    p, s = z1.init(tx, m.params, mesh)
    step = z1.train_step(m.loss_fn, tx, mesh)
  elif method == "ddp":
    p, s = bl.ddp_init(optimizer(), m.params, mesh)
    step = bl.ddp_train_step(m.loss_fn, optimizer(), mesh)
  elif method == "gspmd":
    p, s = bl.gspmd_init(optimizer(), m.params, mesh)
    step = bl.gspmd_train_step(m.loss_fn, optimizer(), mesh, m.params)
  elif method == "zero2":
    tx = z1.zero2(optimizer(), axis_name="data", bucket_bytes=bucket_bytes,
                  inplace_bytes=inplace_bytes)
    p, s = z1.init(tx, m.params, mesh)
    step = z1.train_step(m.loss_fn, tx, mesh)
  elif method == FLOOR:
    p, s = bl.floor_init(m.params, mesh)
    step = bl.floor_train_step(m.loss_fn, mesh)
  else:
    raise ValueError(f"unknown method {method!r}; one of {METHODS + (FLOOR,)}")
  compiled = step.lower(p, s, b).compile()
  return Built(method, n, compiled, p, s, time.perf_counter() - t0)


# ------------------------------------------------------------------ theory


def state_master_theory(method: str, psi: int, n: int, dtype: str) -> float:
  """Bytes of optimizer state + fp32 master weights one device holds.

  With fp32 params every method uses the (replicated) params as the master
  copy (ZeRO-1 too: it keeps no copy of params already in fp32); with bf16
  params the master is a separate fp32 copy, sharded by ZeRO-1 and GSPMD.
  """
  if method == "ddp":
    return K * psi
  return (4 * psi + 8 * psi / n) if dtype == "fp32" else K * psi / n


def sharded_state_theory(psi: int, n: int, dtype: str) -> float:
  """ZeRO-1's sharded state per device: Adam's moments (8 Psi / N), plus the
  fp32 master shard for bf16 params (12 Psi / N)."""
  return (8 if dtype == "fp32" else K) * psi / n


def model_state_theory(method: str, psi: int, n: int, dtype: str) -> float:
  """The ZeRO paper's per-device model-state bytes: params + grads + state.

  ``(2 + 2 + K/N) Psi`` for ZeRO-1 in 16-bit, ``(4 + 4 + 8/N) Psi`` in fp32
  (the fp32 params are the master).
  DDP holds ``K Psi`` (fp32: ``8 Psi`` of moments; the params are the master);
  GSPMD holds the moments sharded and, in fp32, the replicated params are its
  master copy.
  """
  w = 4 if dtype == "fp32" else 2
  if method == "ddp":
    return (2 * w + (8 if dtype == "fp32" else K)) * psi
  return (2 * w + (8 if dtype == "fp32" else K) / n) * psi


def traffic_theory(method: str, psi: int, itemsize: int) -> dict[str, float]:
  """Per-device ring traffic of one step in the ZeRO paper's units."""
  b = psi * itemsize
  if method == "zero1_rs":
    return {"reduce-scatter": b, "all-gather": b, "total": 2 * b}
  if method == "zero1_ar":
    return {"all-reduce": 2 * b, "all-gather": b, "total": 3 * b}
  if method == "ddp":
    return {"all-reduce": 2 * b, "total": 2 * b}
  return {"total": float("nan")}   # GSPMD: whatever the partitioner picks
