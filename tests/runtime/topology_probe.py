"""An MPI program for test_topology.py: the job's ranks build the topology, one of them late.

Run as ``mpirun -np 2 python -m tests.runtime.topology_probe OUT_DIR LATE_S TIMEOUT_S``.
Rank 1 starts building ``LATE_S`` seconds after rank 0 (a rank still importing), the
ranks waiting for each other at most ``TIMEOUT_S`` (``timeouts.start_s``); each rank writes
OUT_DIR/rank{i}.json with the CPU seconds its ``build_topology`` took, or the error it
raised.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from mpi4py import MPI

from hpc_asyncppo.runtime.topology import build_topology, close_topology

GROUP_TIMEOUT_S = 600.0  # the process groups' own timeout: a hang limit


def main(out_dir: Path, late_s: float, timeout_s: float) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 1:
        time.sleep(late_s)
    cpu = time.process_time()
    try:
        topo = build_topology(1, GROUP_TIMEOUT_S, start_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - the error is the record
        record = {"error": f"{type(exc).__name__}: {exc}"}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
        MPI.COMM_WORLD.Abort(1)
    record = {"cpu_s": time.process_time() - cpu, "role": topo.role}
    close_topology(topo)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
