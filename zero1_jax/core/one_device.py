"""The warning, said once per process, that nothing is sharded because the
process has a single CPU device.

A data axis of size 1 trains correctly, but each device then holds the whole
optimizer state: on a CPU it almost always means that the simulated devices
were never set up (JAX starts one CPU device unless told otherwise). On a
GPU or TPU with one device a one-device run is a legitimate choice, and a
user who picked one device of several chose it: both say nothing.

Example:
  >>> import jax
  >>> warn_if_one_device(8, "data")     # an 8-device axis: nothing to say
"""

from __future__ import annotations

import warnings

import jax


class OneDeviceWarning(UserWarning):
  """The data axis has one device and the process has only one CPU device."""


MESSAGE = (
    "zero1_jax: the data axis '{axis}' has 1 device, so nothing is sharded "
    "(that device holds the whole optimizer state), and this process has a "
    "single CPU device. To simulate N devices on CPU, set XLA_FLAGS="
    "--xla_force_host_platform_device_count=N before jax is imported")

_said = False   # once per process


def warn_if_one_device(n: int, axis: str, stacklevel: int = 2) -> None:
  """Warns (:class:`OneDeviceWarning`, once per process) when the data axis
  has ``n == 1`` device because the CPU backend has only one."""
  global _said
  if _said or n != 1:
    return
  if jax.default_backend() != "cpu" or jax.device_count() != 1:
    return
  _said = True
  warnings.warn(MESSAGE.format(axis=axis), OneDeviceWarning,
                stacklevel=stacklevel + 1)
