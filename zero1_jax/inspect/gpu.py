"""Compile a step for NVIDIA GPUs on a machine without one.

jax's compile-only topologies run XLA's real GPU compiler for GPUs that are
not there: :func:`mesh` gives a mesh of 8 H100s (or H200s, on 1 to n hosts)
whose devices exist only for compiling, and :func:`compile` compiles a
lowered step for it and reads XLA's latency-hiding schedule of the result
(:mod:`zero1_jax.inspect.schedule`): an estimate of the step on those GPUs,
from XLA's cost model, and which collectives run under compute.

Needs jax's CUDA plugin at jax's own version, without the CUDA libraries:
``pip install "jax[cuda12-local]==$(python -c 'import jax; print(jax.__version__)')"``
(or the ``gpu-aot`` extra). Where no GPU is present, set
``jax.config.update("jax_platforms", "cpu")`` (or ``JAX_PLATFORMS=cpu``)
before jax starts a backend, so that it does not try to open one.

Example (not run by the doctests: it needs the plugin)::

    import jax
    jax.config.update("jax_platforms", "cpu")
    import zero1_jax as z1
    mesh = z1.inspect.gpu.mesh(8)                    # 8 x H100 SXM, one host
    lowered = step.lower(*abstract_args_on(mesh))    # ShapeDtypeStructs with shardings
    compiled, schedule = z1.inspect.gpu.compile(lowered)
    est = z1.inspect.schedule.summary(schedule)
    print(est.step_us, est.exposed_by_kind)
"""

from __future__ import annotations

import contextlib
import importlib.resources
import shutil
import tempfile
import warnings
from typing import Any, Sequence

import jax

from zero1_jax.inspect import schedule as sched

GPUS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
# jaxlib 0.10.2's GpuTargetConfigProto predates this field of XLA's specs.
_NEWER_FIELDS = ("collective_memory_granularity",)


def target_config(gpu: str = "h100") -> str:
  """The text of XLA's target config for ``gpu`` ('h100' SXM or 'h200'),
  shipped with zero1_jax (copied from openxla/xla's published specs)."""
  if gpu not in GPUS:
    raise ValueError(f"unknown gpu {gpu!r}; one of {sorted(GPUS)}")
  return (importlib.resources.files("zero1_jax.inspect") / "gpu_specs"
          / GPUS[gpu]).read_text()


def _without(text: str, fields: Sequence[str]) -> str:
  return "".join(line for line in text.splitlines(keepends=True)
                 if line.strip().split(":")[0] not in fields)


_STRIP: list[bool] = []   # learnt once a process: this jaxlib rejects _NEWER_FIELDS


def _jaxlib() -> tuple[int, ...]:
  import jaxlib
  return tuple(int(x) for x in jaxlib.__version__.split(".")[:2] if x.isdigit())


def topology(gpu: str = "h100", *, hosts: int = 1, gpus_per_host: int = 8):
  """jax's compile-only topology of ``hosts`` x ``gpus_per_host`` GPUs."""
  try:
    from jax.experimental import topologies
  except ImportError as e:   # pragma: no cover
    raise RuntimeError(_NO_PLUGIN) from e
  text = target_config(gpu)
  shape = f"1x{int(hosts)}x{int(gpus_per_host)}"

  def get(t):
    try:
      return topologies.get_topology_desc(platform="cuda", target_config=t,
                                          topology=shape)
    except Exception as e:   # noqa: BLE001 - jaxlib raises its own types
      if "cuda" in str(e).lower() and "parse" not in str(e).lower():
        raise RuntimeError(_NO_PLUGIN + f" ({e})") from e
      raise
  if not _STRIP and _jaxlib() < (0, 11):   # known to reject it: no error line
    _STRIP.append(True)
  if not _STRIP:
    try:
      return get(text)
    except Exception as e:   # noqa: BLE001
      if "GpuTargetConfigProto" not in str(e):
        raise
      _STRIP.append(True)   # jaxlib 0.10.2: XLA's spec is newer than its parser
  return get(_without(text, _NEWER_FIELDS))


_NO_PLUGIN = (
    "zero1: compiling for GPUs without one needs jax's CUDA plugin at jax's "
    "version: pip install \"jax[cuda12-local]==<jax.__version__>\" (the "
    "gpu-aot extra), and JAX_PLATFORMS=cpu where no GPU is present.")


def mesh(axis_shapes: int | Sequence[int] = 8,
         axis_names: Sequence[str] = ("data",), *, gpu: str = "h100",
         hosts: int = 1, axis_types: Any = None) -> jax.sharding.Mesh:
  """A compile-only mesh of ``prod(axis_shapes)`` GPUs, 8 per host (fewer
  on one host if fewer are asked for). Arrays cannot be placed on it; lower
  on ``jax.ShapeDtypeStruct``s carrying its ``NamedSharding``s.

  ``axis_types``: as ``jax.make_mesh``'s (default: Auto axes, as
  ``jax.experimental.topologies.make_mesh`` makes them)."""
  from jax.experimental import topologies
  shape = (axis_shapes,) if isinstance(axis_shapes, int) else tuple(axis_shapes)
  total = 1
  for s in shape:
    total *= int(s)
  per_host = total // int(hosts)
  if per_host * int(hosts) != total:
    raise ValueError(f"{total} GPUs do not split over {hosts} hosts")
  topo = topology(gpu, hosts=hosts, gpus_per_host=per_host)
  kw = {} if axis_types is None else {"axis_types": tuple(axis_types)}
  return topologies.make_mesh(topo, shape, tuple(axis_names), **kw)


def compile(lowered: Any, compiler_options: dict | None = None, *,
            dump_to: str | None = None) -> tuple[Any, sched.Schedule]:
  """``lowered.compile()`` with XLA's latency-hiding schedule dumped and read.

  Returns the compiled step (``.as_text()``, ``.memory_analysis()``) and its
  :class:`zero1_jax.inspect.schedule.Schedule` (:func:`~zero1_jax.inspect.
  schedule.summary` gives the step's estimate): XLA's cost model of one step
  on the GPUs of the mesh it was lowered for, not a measurement.
  ``dump_to``: an empty directory where XLA's dump of the compile (the optimized
  HLO, its buffer assignment and live ranges) stays; by default a temporary
  one, removed.

  jax's persistent compilation cache, where one is set, is left out: an
  executable compiled for devices that exist only for compiling cannot be
  loaded back from it (jax would warn "PjRtCompiler must be constructed with
  a Client" and compile again), so none is written, and an entry another
  program wrote for the same key is passed over without that warning."""
  where = dump_to or tempfile.mkdtemp(prefix="zero1_schedule_")
  try:
    options = {**(compiler_options or {}), "xla_dump_to": where,
               "xla_dump_latency_hiding_schedule": True}
    with _outside_the_persistent_cache():
      compiled = lowered.compile(compiler_options=options)
    return compiled, sched.read(where)
  finally:
    if dump_to is None:
      shutil.rmtree(where, ignore_errors=True)


@contextlib.contextmanager
def _outside_the_persistent_cache():
  """No cache entry written (jax writes none for a compile quicker than
  ``jax_persistent_cache_min_compile_time_secs``), and the failed read of one
  written elsewhere not warned of: jax then compiles, as with no entry."""
  key = "jax_persistent_cache_min_compile_time_secs"
  before = getattr(jax.config, key)
  jax.config.update(key, float("inf"))
  try:
    with warnings.catch_warnings():
      warnings.filterwarnings(
          "ignore", message=r"(?s).*PjRtCompiler must be constructed with a Client")
      yield
  finally:
    jax.config.update(key, before)
