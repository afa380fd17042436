"""The function :func:`zero1_jax.train_step` returns: its jitted step behind
a thin wrapper that first places what the step is handed.

Batch arrays committed to devices outside the mesh (e.g. one device) are
moved onto it, split over the data axis; params are placed where the step
keeps them (:mod:`.param_storage`), so one compiled program serves the first
step and the next. At most :data:`.inflight.STEPS_IN_FLIGHT` steps are
outstanding on simulated CPU devices (:mod:`.inflight`).
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import NamedSharding

from zero1_jax.core import inflight
from zero1_jax.core.batch import batch_size


class OnMesh:
  """The jitted step, first moving batch arrays that live on devices outside
  the mesh (e.g. committed to one device) onto it, split over the data axis.
  Host arrays and arrays already on the mesh pass straight through.
  ``lower``/``trace``/``eval_shape`` and the rest are the jitted function's."""

  def __init__(self, jitted, batch_sharding: NamedSharding, accum: int,
               n: int, axes_of: Callable, storage: Callable):
    self._jitted = jitted
    self._storage = storage
    self._bounded = inflight.Bounded(jitted)
    self._sharding = batch_sharding
    self._devices = set(batch_sharding.mesh.devices.flat)
    self._accum = accum
    self._n = n
    self._axes_of = axes_of

  def _place(self, batch):
    batch_size(batch, self._accum, self._n)

    def one(x):
      sharding = getattr(x, "sharding", None)
      if sharding is None or set(sharding.device_set) <= self._devices and \
          len(sharding.device_set) == len(self._devices):
        return x
      return jax.device_put(x, self._sharding)
    return jax.tree.map(one, batch)

  def _store(self, params, pa):
    """``params`` placed where the step keeps them (a local slice of
    replicated arrays: no communication), so that one compiled program
    serves the first step and the next; ShapeDtypeStructs given that
    sharding."""
    where = self._storage(params, pa)
    if where is None:
      return params

    def one(x, s):
      if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
      # Equal, spec and all: jit compiles again for P() where it returned
      # P(None,) (the same placement, another type on an Explicit mesh).
      return x if getattr(x, "sharding", None) == s else jax.device_put(x, s)
    return jax.tree.map(one, params, where)

  def __call__(self, params, opt_state, batch):
    # At most inflight.STEPS_IN_FLIGHT steps outstanding on CPU devices:
    # more deadlock XLA's CPU client (core/inflight.py).
    pa = self._axes_of(params)
    return self._bounded(self._store(params, pa), opt_state,
                         self._place(batch), pa)

  def lower(self, params, opt_state, batch):
    pa = self._axes_of(params)
    return self._jitted.lower(self._store(params, pa), opt_state,
                              self._place(batch), pa)

  def __getattr__(self, name):
    return getattr(self._jitted, name)
