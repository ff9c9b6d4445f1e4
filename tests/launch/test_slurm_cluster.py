"""Integration tests against the real local Slurm cluster (scripts/local_slurm.sh).

Two emulated nodes: partition "rollout" is node n1, partition "train" node n2. Every test
submits a real heterogeneous job; they run in well under a minute each on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_asyncppo.config import load_config, load_resolved
from hpc_asyncppo.launch.slurm.cluster import ACTIVE_STATES, job_state
from hpc_asyncppo.launch.slurm.executor import HetJobExecutor
from hpc_asyncppo.launch.slurm.placement import slurm_placement
from hpc_asyncppo.launch.slurm.script import TEMPLATE_PATH, sbatch_lines
from tests.harness import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("local_slurm")]

PROBE = Path(__file__).with_name("hetjob_probe.py")
LONG_RUN = "trainer.total_steps=100000"


def wait_until_done(job_id: str, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state not in ACTIVE_STATES:
            return state
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    pytest.fail(f"job {job_id} still {state} after {timeout_s}s")


def wait_until_done_or_srun_hung(job_id: str, outputs: list[Path], grace_s: float = 10) -> str:
    """The job's end state; or "SRUN HUNG" (the job cancelled) when every rank wrote its
    output and exited but srun has not ended ``grace_s`` later: Slurm 22.05's srun
    sometimes never exits after a heterogeneous step that finished (both slurmd logs say
    "done with job"). Real runs go through launch/slurm/step.py, which ends such an srun
    (tested in test_slurm_step.py); this raw-srun probe only waits it out."""
    deadline = time.monotonic() + 180
    written_at = None
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state not in ACTIVE_STATES:
            return state
        if written_at is None and all(p.exists() for p in outputs):
            written_at = time.monotonic()
        if written_at is not None and time.monotonic() - written_at > grace_s:
            subprocess.run(["scancel", job_id])
            return "SRUN HUNG"
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    pytest.fail(f"job {job_id} still {state} after 180 s, its ranks' outputs not all written")


def submit(run_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "hpc_asyncppo.submit", "--config", "local-slurm",
        "--partition-rollout", "rollout", "--partition-train", "train",
        "--run-dir", str(run_dir), *args,
    ]  # fmt: skip


def ranks_in_state(run_dir: Path, state: str, count: int, timeout_s: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = []
        for path in sorted((run_dir / "ranks").glob("rank*.json")):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError):
                break  # being rewritten
        if len(records) == count and all(r["state"] == state for r in records):
            return records
        time.sleep(0.5)
    pytest.fail(f"ranks of {run_dir} never all reached state {state!r}")


def processes_of(run_dir: Path) -> list[int]:
    """Pids of processes whose command line names the run directory (the ranks)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run_dir).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def assert_no_processes_left(run_dir: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_of(run_dir), "ranks left running after the job ended"


def test_one_mpi_world_across_both_partitions(shared_dir: Path) -> None:
    """The hetjob layer alone: our sbatch lines, one srun step, Split + Create_intercomm."""
    cfg = load_config("local-slurm")
    out = shared_dir / "out"
    out.mkdir()
    srun = f"srun --mpi={cfg.slurm.mpi} --het-group=0,1 --kill-on-bad-exit=1 --label {sys.executable} {PROBE} {out}"
    script = "\n".join(
        ["#!/bin/bash", *sbatch_lines(cfg.slurm, str(shared_dir)), *cfg.slurm.setup, srun]
    )
    job = HetJobExecutor(shared_dir, script + "\n", num_tasks=3).submit_script()
    state = wait_until_done_or_srun_hung(job.job_id, [out / f"rank{i}.json" for i in range(3)])
    assert state in ("COMPLETED", "SRUN HUNG"), (shared_dir / f"{job.job_id}_0_log.err").read_text()
    records = [json.loads((out / f"rank{i}.json").read_text()) for i in range(3)]
    assert [r["role"] for r in records] == ["rollout", "rollout", "trainer"]
    assert {r["size"] for r in records} == {3}
    assert records[2]["received"] == [0, 1]  # both rollout ranks reached the trainer leader
    placements = [slurm_placement(r["rank"], r["env"]) for r in records]
    assert [(p["slurm_node"], p["slurm_partition"]) for p in placements] == [
        ("n1", "rollout"),
        ("n1", "rollout"),
        ("n2", "train"),
    ]
    assert {p["slurm_job_id"] for p in placements} == {job.job_id}


# Steps of the tiny run: two syncs past the first. That it learns is the ranks' doing, the
# same under Slurm as under mpirun (tests/integration/test_validation_runs.py); these ranks'
# learning over five seeds: BENCHMARKS.md "The Slurm tiny run's learning at 100 steps".
TINY_RUN_STEPS = 12


def test_tiny_run_completes_with_ranks_on_their_partitions(shared_dir: Path) -> None:
    run_dir = shared_dir / "run"
    proc = subprocess.run(
        submit(run_dir, "--wait", f"trainer.total_steps={TINY_RUN_STEPS}"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "submitted job" in proc.stdout and "completed" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    total_steps = load_resolved(run_dir / "config.yaml").trainer.total_steps
    assert [r["step"] for r in rows] == list(range(1, total_steps + 1))
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank*.json"))]
    where = [(r["role"], r["slurm_node"], r["slurm_partition"], r["state"]) for r in ranks]
    assert where == [
        ("rollout", "n1", "rollout", "done"),
        ("rollout", "n1", "rollout", "done"),
        ("trainer", "n2", "train", "done"),
    ]
    assert [r["gpus"] for r in ranks] == [[], [], []]  # no GPUs requested: CPU ranks, unbound
    # Both components' output lands in the run directory, labelled by rank.
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    assert (run_dir / "slurm" / f"{job_id}_0_log.out").exists()
    assert sorted(p.name for p in (run_dir / "logs").glob("rank*.log")) == [
        "rank0.log",
        "rank1.log",
        "rank2.log",
    ]


def test_scancel_ends_the_job_cleanly(shared_dir: Path) -> None:
    run_dir = shared_dir / "run"
    waiter = subprocess.Popen(
        submit(run_dir, "--wait", LONG_RUN, "timeouts.step_exit_s=5"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ranks_in_state(run_dir, "running", 3)
        job_id = (run_dir / "slurm" / "job_id").read_text().strip()
        subprocess.run(["scancel", job_id], check=True)
        out, err = waiter.communicate(timeout=120)
    finally:
        waiter.kill()
    assert waiter.returncode == 1 and f"job {job_id} ended CANCELLED" in err, out + err
    assert "Traceback" not in err
    assert job_state(job_id) == "CANCELLED"
    # A rank killed at scancel leaves no record, and Slurm 22.05's srun may then hang: the
    # step wrapper ends it step_exit_s (5 s here) after srun reports the deaths, SIGKILL 15 s
    # later (launch/slurm/step.py). Bounded: the hang limit covers it.
    assert_no_processes_left(run_dir)


def test_a_failing_rank_ends_the_whole_job(shared_dir: Path) -> None:
    """Not restarted here (trainer.max_restarts=0): a killed rank that requeues the job is
    test_slurm_preemption.py's third interruption."""
    run_dir = shared_dir / "run"
    proc = subprocess.run(
        # srun can hang after the step (Slurm 22.05): the step wrapper ends it, here after
        # 5 s, not the default 60 s (the error line below comes from the rank's own record)
        submit(
            run_dir,
            "--wait",
            LONG_RUN,
            "timeouts.step_exit_s=5",
            "trainer.max_restarts=0",
            "data.reward_fn=tests.launch.faulty_reward:fail_on_rank1",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("  rank ")]
    assert (
        len(errors) == 1
        and "rank 1 (rollout" in errors[0]
        and "injected failure on rank 1" in errors[0]
    )
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    assert job_state(job_id) == "FAILED"
    log = (run_dir / "slurm" / f"{job_id}_0_log.err").read_text()
    assert "not requeued: trainer.max_restarts=0 restarts made" in log, log
    assert_no_processes_left(run_dir)


def test_a_rank_that_never_exits_after_finishing_does_not_hold_the_job(shared_dir: Path) -> None:
    """Every rank done but the step never ends (here a rank's process lingers; in Slurm
    22.05 srun itself sometimes hangs): the batch script ends srun after
    timeouts.step_exit_s and the job completes."""
    run_dir = shared_dir / "run"
    proc = subprocess.run(
        submit(
            run_dir,
            "--wait",
            "trainer.total_steps=10",
            "timeouts.step_exit_s=5",
            "data.reward_fn=tests.launch.faulty_reward:linger_on_rank1",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    assert job_state(job_id) == "COMPLETED"
    err = (run_dir / "slurm" / f"{job_id}_0_log.err").read_text()
    assert "srun has not exited 5 s after the step ended (all 3 ranks finished)" in err, err
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == load_resolved(run_dir / "config.yaml").trainer.total_steps
    assert_no_processes_left(run_dir)


def test_standalone_template_runs_with_sbatch(shared_dir: Path) -> None:
    """slurm/hetjob.sbatch, submitted by hand with the documented variables."""
    run_dir = shared_dir / "run"
    setup = "\n".join(load_config("local-slurm").slurm.setup)
    env = {
        **os.environ,
        "HPC_ASYNCPPO_RUN_DIR": str(run_dir),
        # srun can hang after the step (Slurm 22.05): ended after 5 s, not the default 60 s
        "HPC_ASYNCPPO_ARGS": "trainer.total_steps=3 timeouts.step_exit_s=5",
        "HPC_ASYNCPPO_PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),  # the package need not be installed
    }
    proc = subprocess.run(
        ["bash", "-c", f"{setup}\nexec sbatch --parsable {TEMPLATE_PATH}"],
        cwd=shared_dir,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = proc.stdout.strip().split(";")[0]
    state = wait_until_done(job_id)
    output = shared_dir / f"hpc_asyncppo-{job_id}.out"
    assert state == "COMPLETED", output.read_text() if output.exists() else state
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3
    assert json.loads((run_dir / "ranks" / "rank2.json").read_text())["slurm_node"] == "n2"
