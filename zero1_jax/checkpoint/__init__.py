"""Checkpoints on orbax: sharded save, restore at any data-parallel size,
exact resume, and export of the fp32 master weights.

:mod:`.manager` holds :class:`Checkpointer` and the export; :mod:`.reshard`
the manifest and the mapping of a saved layout onto a new one.
"""
from zero1_jax.checkpoint.manager import Checkpointer, export_params, load_params
from zero1_jax.checkpoint.reshard import (CheckpointError,
                                          CheckpointMismatchError,
                                          UnreadableCheckpointError)

__all__ = ["CheckpointError", "CheckpointMismatchError", "Checkpointer",
           "UnreadableCheckpointError", "export_params", "load_params"]
