"""Checkpoints on orbax: sharded save, restore at any data-parallel size,
exact resume, and export of the fp32 master weights.

:mod:`.manager` holds :class:`Checkpointer`, :mod:`.export` the fp32 export,
:mod:`.reshard` the manifest and the mapping of a saved layout onto a new one,
:mod:`.lifecycle` path resolution and the finishing of saves at exit,
:mod:`.steps` which steps a directory holds (committed or not),
:mod:`.step_files` a committed step's files, checked before a restore.
"""
from zero1_jax.checkpoint.export import export_params, load_params
from zero1_jax.checkpoint.manager import Checkpointer
from zero1_jax.checkpoint.steps import committed_steps
from zero1_jax.checkpoint.reshard import (CheckpointError,
                                          CheckpointMismatchError,
                                          CheckpointSaveError,
                                          UnreadableCheckpointError)

__all__ = ["CheckpointError", "CheckpointMismatchError", "CheckpointSaveError",
           "Checkpointer", "UnreadableCheckpointError", "committed_steps",
           "export_params", "load_params"]
