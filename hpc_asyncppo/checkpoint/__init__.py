"""Checkpoints (one HDF5 file per step, no pickle) and the trainer queue's overflow file."""

from hpc_asyncppo.checkpoint.overflow import SpillQueue
from hpc_asyncppo.checkpoint.store import (
    CheckpointError,
    CheckpointSummary,
    check_compatible,
    checkpoint_path,
    describe_checkpoint,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    prune_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointSummary",
    "SpillQueue",
    "check_compatible",
    "checkpoint_path",
    "describe_checkpoint",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_checkpoint",
    "prune_checkpoints",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
]
