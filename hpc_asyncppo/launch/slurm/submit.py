"""Submit a prepared run as one heterogeneous Slurm job, and optionally follow it to the end."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hpc_asyncppo.config import Config
from hpc_asyncppo.launch.progress import follow
from hpc_asyncppo.launch.rundir import rank_errors
from hpc_asyncppo.launch.slurm.cluster import ACTIVE_STATES, SlurmError, job_state
from hpc_asyncppo.launch.slurm.executor import HetJobExecutor
from hpc_asyncppo.launch.slurm.script import batch_script
from hpc_asyncppo.launch.slurm.step import ENDING_SRUN, STARTING_SRUN, task_death
from hpc_asyncppo.paths import JOB_ID, METRICS, SLURM

POLL_S = 2.0
# After the last task ends Slurm needs a moment (COMPLETING) before the final state shows.
SETTLE_S = 60.0


def submit_slurm(cfg: Config, run_dir: Path, args: argparse.Namespace) -> int:
    """sbatch the run in ``run_dir`` (already prepared); returns the CLI's exit code.

    ``--dry-run``: print the script only. ``--wait``: follow progress until the job ends,
    exit 0 only if it completed, else print each failed rank's error and exit 1.
    """
    run_dir = run_dir.resolve()
    script = batch_script(cfg.slurm, str(run_dir))
    if getattr(args, "dry_run", False):
        print(script, end="")
        return 0
    ranks = cfg.slurm.rollout.ranks + cfg.slurm.train.ranks
    try:
        job = HetJobExecutor(run_dir / SLURM, script, ranks).submit_script()
    except SlurmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    (run_dir / SLURM / JOB_ID).write_text(job.job_id + "\n")
    print(
        f"submitted job {job.job_id}: {cfg.slurm.rollout.ranks} rollout + {cfg.slurm.train.ranks} trainer ranks"
    )
    if not getattr(args, "wait", False):
        print(
            f"  follow:  tail -f {run_dir / METRICS}   (job output: {log_path(run_dir, job.job_id)})"
        )
        print(f"  status:  squeue -j {job.job_id}     stop: scancel {job.job_id}")
        return 0
    return wait_for_job(job.job_id, run_dir, cfg.trainer.total_steps,
                        "console" in cfg.trainer.logger)  # fmt: skip


def wait_for_job(job_id: str, run_dir: Path, total_steps: int, console: bool = True) -> int:
    """Follow the job's progress until Slurm says it ended; exit code for the CLI."""
    try:
        follow(run_dir, _state_watcher(job_id), total_steps, poll_s=POLL_S, console=console)
    except KeyboardInterrupt:
        print(
            f"\nstopped following; job {job_id} keeps running (scancel {job_id} to stop it)",
            file=sys.stderr,
        )
        return 130
    state = final_state(job_id)
    errors = rank_errors(run_dir) or task_deaths(run_dir, job_id)
    if state == "COMPLETED" and not errors:
        print(f"job {job_id} completed; run directory: {run_dir}")
        return 0
    err = log_path(run_dir, job_id).with_suffix(".err")
    print(
        f"error: job {job_id} ended {state}; job output: {log_path(run_dir, job_id)}, {err.name}",
        file=sys.stderr,
    )
    for line in errors:
        print(f"  {line}", file=sys.stderr)
    return 1


def _state_watcher(job_id: str) -> Callable[[], bool]:
    """is_running() for ``follow``; says when the job changes state (pending, running...).

    A job whose srun outlives its ranks (a Slurm 22.05 hang) is ended by the batch script's
    step wrapper (``launch/slurm/step.py``), so following Slurm's state is enough."""
    last = ""

    def is_running() -> bool:
        nonlocal last
        state = job_state(job_id)
        if state != last and state in ACTIVE_STATES:
            print(f"job {job_id}: {state.lower()}", flush=True)
        last = state
        return state in ACTIVE_STATES

    return is_running


def task_deaths(run_dir: Path, job_id: str) -> list[str]:
    """Ranks that died without recording an error (killed, segfault), as srun saw them."""
    err = log_path(run_dir, job_id).with_suffix(".err")
    if not err.exists():
        return []
    deaths: list[str] = []
    ended_by_wrapper = False
    for line in err.read_text(errors="replace").splitlines():
        if line.startswith(STARTING_SRUN):  # an attempt: only the last one's deaths count
            deaths, ended_by_wrapper = [], False
        elif line.startswith(ENDING_SRUN):
            ended_by_wrapper = True  # tasks killed from here on were ended with srun
        elif not ended_by_wrapper and (death := task_death(line)):
            deaths.append(death)
    return deaths


def log_path(run_dir: Path, job_id: str) -> Path:
    """The job's output: both components' ranks, each line prefixed with its world rank."""
    return run_dir / SLURM / f"{job_id}_0_log.out"


def final_state(job_id: str) -> str:
    deadline = time.monotonic() + SETTLE_S
    state = job_state(job_id)
    while state in ACTIVE_STATES and time.monotonic() < deadline:
        time.sleep(1.0)
        state = job_state(job_id)
    return state
