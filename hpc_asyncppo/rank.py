"""Per-rank entry point, the same under mpirun and srun: ``python -m hpc_asyncppo.rank RUN_DIR``.

Each rank finds its role from its world rank (rollout ranks first), builds the topology
and runs its role's loop. On any error it records one line in RUN_DIR/errors/rank{i}.txt
and aborts the MPI job, so the other ranks are ended at once instead of waiting for it.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import traceback
from pathlib import Path

from hpc_asyncppo.paths import CONFIG, LOGS


def exit_now(mpi) -> None:
    """End a rank whose work is durable: logs flushed, MPI finalised, and out without the
    interpreter's teardown. With torch and transformers loaded the teardown took 2 s per
    rank on an idle machine and 10 s on a busy one (measured from the rank's "done" to
    mpirun's exit), time every attempt and every resume paid after its last act, and it
    tore down gloo's threads in an order that can abort. Every file this process wrote is
    closed by its role before this (metrics, timeline, TensorBoard, queue, checkpoints)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    mpi.Finalize()
    os._exit(0)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m hpc_asyncppo.rank RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).resolve()
    from hpc_asyncppo.runtime import startup

    python_started = startup.process_started_at()
    startup.pause_collection()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # the openai client's response types are built at import, not at first use: built
    # lazily, data.agent's threads race on it and a call fails with pydantic's
    # "BaseModel cannot be instantiated directly" (openai reads this when imported)
    os.environ.setdefault("DEFER_PYDANTIC_BUILD", "false")
    from mpi4py import MPI

    from hpc_asyncppo.launch.rundir import write_rank_error, write_rank_info
    from hpc_asyncppo.runtime import heartbeat
    from hpc_asyncppo.runtime.signals import install_stop_handlers
    from hpc_asyncppo.runtime.topology import ROLLOUT, role_of, rollout_rank_count

    install_stop_handlers()  # first: a warning signal during start-up must not kill the rank
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    from hpc_asyncppo.runtime import faults

    role = "unknown"
    logging.basicConfig(
        filename=run_dir / LOGS / f"rank{rank}.log",
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s",
    )
    startup.mark("python started", python_started)
    startup.mark("MPI initialised, torch imported")
    gpus: list[int | str] | None = None
    try:
        role = role_of(rank, rollout_rank_count())
        write_rank_info(run_dir, rank, size, role, "starting")
        faults.arm(run_dir, rank)  # faults injected by a test or a drill (none in a real run)
        from hpc_asyncppo.config import load_resolved
        from hpc_asyncppo.launch.gpus import bind_gpus

        cfg = load_resolved(run_dir / CONFIG)
        heartbeat.start(run_dir, rank, cfg.trainer.stall_timeout_s)
        # Before anything initialises CUDA (transformers may, on import) and before vLLM
        # starts: torch and vLLM's workers read CUDA_VISIBLE_DEVICES only once.
        gpus = bind_gpus(
            cfg.slurm, cfg.rollout.tensor_parallel_size, rank, size, rollout_rank_count()
        )
        write_rank_info(run_dir, rank, size, role, "starting", gpus)
        import transformers

        transformers.utils.logging.disable_progress_bar()
        startup.mark("transformers imported")
        # Every import before the first collective: a rank waits for the others once, not
        # at each step of the start-up.
        if role == ROLLOUT:
            from hpc_asyncppo.rollout.rollouter import run_rollouter as run_role
        else:
            from hpc_asyncppo.trainer.trainer import run_trainer as run_role
        from hpc_asyncppo.checkpoint.protocol import find_resume_checkpoint
        from hpc_asyncppo.runtime.topology import build_topology, close_topology

        startup.resume_collection()
        startup.mark(f"{role} modules imported")
        workers = cfg.rollout.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1
        topo = build_topology(
            rollout_rank_count(), cfg.timeouts.weight_sync_s, workers, cfg.timeouts.start_s
        )
        startup.mark("topology built")
        logging.getLogger(__name__).info(
            "%s rank on %s; weights travel over %s", role, topo.device, topo.weights.backend
        )
        checkpoint = find_resume_checkpoint(run_dir, topo)
        write_rank_info(run_dir, rank, size, role, "running", gpus)
        startup.mark("checkpoint found")
        run_role(cfg, topo, run_dir, checkpoint)
        close_topology(topo)
        heartbeat.stop()
        write_rank_info(run_dir, rank, size, role, "done", gpus)
        exit_now(MPI)
    except BaseException as exc:  # noqa: BLE001 - every failure must end the whole job
        logging.getLogger(__name__).error("rank %d failed:\n%s", rank, traceback.format_exc())
        host = (
            os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        )  # emulated nodes share a hostname
        message = f"rank {rank} ({role}, {host}): {type(exc).__name__}: {exc}"
        write_rank_error(run_dir, rank, message + "\n\n" + traceback.format_exc())
        print(message, file=sys.stderr, flush=True)
        write_rank_info(run_dir, rank, size, role, "failed", gpus)
        MPI.COMM_WORLD.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
