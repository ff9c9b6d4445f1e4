"""What a running rank uses: its place in the MPI and torch.distributed layout
(``topology``) and the stop signals it reacts to (``signals``). The job launchers that
start ranks live in ``launch/``; the per-rank entry point is ``hpc_asyncppo.rank``."""
