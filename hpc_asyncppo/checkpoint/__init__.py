"""Checkpoints: a folder per step of per-rank HDF5 parts committed by a manifest
(``protocol``), each part a file of ``store`` (no pickle); ``resume`` picks the one a job
continues from, ``inspect`` verifies them."""

from hpc_asyncppo.checkpoint.store import (
    CheckpointError,
    CheckpointReader,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
]
