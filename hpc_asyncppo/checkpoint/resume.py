"""Which checkpoint a starting job resumes from, agreed by every rank.

A job always resumes when its run directory holds a valid checkpoint: that is how a
requeued Slurm job (same batch script) and ``submit --resume RUN_DIR`` both continue.
The trainer leader picks the newest checkpoint whose checksums verify (each bad one is
reported in one line naming the file) and broadcasts its path; every rank then reads its
own part of it from the shared filesystem (``CheckpointReader``), one value at a time: a
rollout rank its cursor and RNG, a trainer rank the model and optimizer state it shards.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from mpi4py import MPI

from hpc_asyncppo.checkpoint.store import (
    CheckpointError,
    latest_valid_checkpoint,
    list_checkpoints,
    read_meta,
)
from hpc_asyncppo.launch.topology import Topology, bcast_text

log = logging.getLogger(__name__)
_NONE_VALID = "\0none-valid"


def _warn(line: str) -> None:
    log.warning(line)
    print(f"warning: {line}", file=sys.stderr, flush=True)


def find_resume_checkpoint(run_dir: Path, topo: Topology) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start."""
    choice = ""
    if topo.is_leader:
        found = latest_valid_checkpoint(run_dir, _warn)
        if found is not None:
            choice = str(found)
        elif list_checkpoints(run_dir):
            choice = _NONE_VALID
    choice = bcast_text(MPI.COMM_WORLD, choice, root=topo.leader)
    if choice == _NONE_VALID:
        count = len(list_checkpoints(run_dir))
        raise CheckpointError(
            f"no valid checkpoint in {run_dir / 'checkpoints'}: all {count} failed verification "
            "(see the warnings); move them away to start over"
        )
    if not choice:
        return None
    path = Path(choice)
    meta = read_meta(path)
    if meta["rollout_ranks"] != topo.rollout_ranks:
        raise CheckpointError(
            f"checkpoint {path} was written by {meta['rollout_ranks']} rollout ranks, this job has "
            f"{topo.rollout_ranks}: resume with the same number (each rank's data cursor is in it)"
        )
    return path
