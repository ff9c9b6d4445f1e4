"""What a running rank uses: its place in the MPI and torch.distributed layout
(``topology``), the stop signals it reacts to (``signals``), its heartbeat, and the
faults a test or drill injects at a named moment (``faults``). The job launchers that
start ranks live in ``launch/``; the per-rank entry point is ``hpc_asyncppo.rank``."""
