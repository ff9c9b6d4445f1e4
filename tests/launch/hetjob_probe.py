"""A tiny MPI program for the Slurm hetjob tests: one world over both components.

Run as ``srun --het-group=0,1 python hetjob_probe.py OUT_DIR``. Ranks [0, R) are the
first component (R = SLURM_NTASKS_HET_GROUP_0), the rest the second; the two sides join
through Split + Create_intercomm, each rollout-side rank sends its rank to the trainer
leader, and every rank writes OUT_DIR/rank{i}.json with where it ran.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI


def main(out_dir: Path) -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    n_rollout = int(os.environ.get("SLURM_NTASKS_HET_GROUP_0", size // 2))
    role = "rollout" if rank < n_rollout else "trainer"
    local = world.Split(0 if role == "rollout" else 1, rank)
    remote_leader = n_rollout if role == "rollout" else 0
    inter = local.Create_intercomm(0, world, remote_leader, tag=7)
    received: list[int] = []
    if role == "rollout":
        inter.Send(np.array([rank], dtype=np.int64), dest=0, tag=1)
    elif local.Get_rank() == 0:
        buf = np.zeros(1, dtype=np.int64)
        for _ in range(inter.Get_remote_size()):
            inter.Recv(buf, source=MPI.ANY_SOURCE, tag=1)
            received.append(int(buf[0]))
    if os.environ.get("PROBE_FAIL_RANK") == str(rank):
        (out_dir / f"error{rank}.txt").write_text(f"rank {rank} failed on purpose\n")
        world.Abort(3)
    world.Barrier()
    record = {
        "rank": rank,
        "role": role,
        "size": size,
        "host": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "slurm_partition": os.environ.get("SLURM_JOB_PARTITION", ""),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
        "het_job_id": os.environ.get("SLURM_HET_JOB_ID", ""),
        "received": sorted(received),
        "env": {k: v for k, v in os.environ.items() if k.startswith("SLURM")},
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    if os.environ.get("PROBE_SLEEP_S"):
        import time

        time.sleep(float(os.environ["PROBE_SLEEP_S"]))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
