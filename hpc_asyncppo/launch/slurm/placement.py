"""Where a rank of a heterogeneous job step runs, from Slurm's environment.

In an ``srun --het-group=0,1`` step, ``SLURM_JOB_PARTITION`` is the same for every task
and is sometimes the wrong component's partition (seen on Slurm 22.05: rollout ranks told
"train"); the reliable source is ``SLURM_JOB_PARTITION_HET_GROUP_<k>`` of the task's own
component k. Emulated nodes may share a hostname, so the node is ``SLURMD_NODENAME``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def het_group_of(world_rank: int, env: Mapping[str, str]) -> int | None:
    """The component holding ``world_rank`` (components own consecutive ranks), or None outside a het step."""
    start = 0
    for group in range(int(env.get("SLURM_HET_SIZE", "0") or 0)):
        size = env.get(f"SLURM_NTASKS_HET_GROUP_{group}")
        if size is None:
            return None
        start += int(size)
        if world_rank < start:
            return group
    return None


def slurm_placement(
    world_rank: int, env: Mapping[str, str] | None = None
) -> dict[str, str | int | None]:
    """host, node, partition, job id and het group of this rank (None where not under Slurm)."""
    env = os.environ if env is None else env
    group = het_group_of(world_rank, env)
    suffix = f"_HET_GROUP_{group}" if group is not None else ""
    return {
        "host": socket.gethostname(),
        "slurm_node": env.get("SLURMD_NODENAME"),
        "slurm_partition": env.get(f"SLURM_JOB_PARTITION{suffix}", env.get("SLURM_JOB_PARTITION")),
        "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_het_group": group,
        # A requeued job keeps its id; the restart count tells its attempts apart.
        "slurm_restart_count": env.get("SLURM_RESTART_COUNT", "0")
        if "SLURM_JOB_ID" in env
        else None,
    }
