"""Which checkpoint a starting job resumes from, agreed by every rank.

A job always resumes when its run directory holds a valid checkpoint: that is how a
requeued Slurm job (same batch script) and ``submit --resume RUN_DIR`` both continue. The
ranks agree on the newest checkpoint whose parts they need are all present and verified
(``protocol.choose_checkpoint``: each rank verifies only its own parts, in parallel); each
role then reads its own part (``CheckpointReader``, ``protocol.ShardedReader``). Any
number of rollout and trainer ranks may resume a checkpoint: the data order is the
leader's, and trainer ranks read the overlapping rows of the old shards.
"""

from __future__ import annotations

from pathlib import Path

from mpi4py import MPI

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.runtime.topology import ROLLOUT, Topology


def parts_needed(topo: Topology, manifest: dict) -> list[str]:
    """The parts of a checkpoint this rank reads on resume."""
    if topo.role == ROLLOUT:  # its own part, and those of old ranks it takes cut groups from
        old = protocol.continued_parts(
            topo.world_rank, topo.rollout_ranks, manifest["rollout_ranks"]
        )
        return [protocol.rollout_part(o) for o in old]
    rank = topo.world_rank - topo.leader
    old = protocol.overlapping_parts(rank, topo.train_ranks, manifest["train_ranks"])
    names = [protocol.trainer_part(k) for k in old]
    return names + ([protocol.LEADER_PART] if topo.is_leader else [])


def find_resume_checkpoint(run_dir: Path, topo: Topology) -> Path | None:
    """The checkpoint folder to resume from, or None for a fresh start."""
    folder = protocol.choose_checkpoint(
        run_dir, MPI.COMM_WORLD, topo.leader, lambda manifest: parts_needed(topo, manifest)
    )
    return folder
