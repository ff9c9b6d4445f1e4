"""Preemption and a crash on the real local Slurm cluster: the job requeues itself.

A fully asynchronous run is interrupted three times: by ``scancel --signal=USR2`` (what
Slurm sends before the time limit: the ranks checkpoint, exit, and the batch script
requeues the job), by ``scontrol requeue`` (what a preempting scheduler does: SIGTERM, then
the job starts again), and by a SIGKILL of the trainer leader (a crash: the step fails,
its wrapper judges it worth a restart and the batch script requeues the job,
``launch/job_restarts.py``). Each time the job resumes on its own, and at the end every sample
was trained at most once, none was lost, and the run trained as many as an uninterrupted
one.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_asyncppo.launch.slurm.cluster import ACTIVE_STATES, job_state
from hpc_asyncppo.runlog import read_jsonl
from hpc_asyncppo.tasks.order import PromptOrder
from tests.harness import HANG_S, REPO

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("local_slurm")]
STEPS, PROMPTS = 40, 64


def diagnosis(run_dir: Path) -> str:
    """The end of the job's error log and of the trainer leader's log, for a failure message."""
    parts = []
    for path in [*sorted((run_dir / "slurm").glob("*.err")), run_dir / "logs" / "rank2.log"]:
        if path.exists():
            parts.append(
                f"--- {path.name}:\n"
                + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
            )
    return "\n".join(parts)


def wait_for(predicate, what: str, timeout_s: float = HANG_S, run_dir: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{diagnosis(run_dir) if run_dir else ''}")
        time.sleep(0.5)


def steps_logged(run_dir: Path) -> int:
    return len(read_jsonl(run_dir / "metrics.jsonl"))


def restarts(run_dir: Path) -> int:
    """How many times a trainer leader resumed (one log line each)."""
    log = run_dir / "logs" / "rank2.log"
    return log.read_text().count("resumed from") if log.exists() else 0


def start_now(job_id: str) -> None:
    """A requeued job waits for a begin time Slurm sets minutes ahead; the test skips the wait.
    Not at once: a job started in the same second its previous attempt's credential was
    revoked (at the requeue) is killed ("Job credential revoked"), which Slurm's delay avoids.
    (An update made while the requeue is still settling can be lost: repeat it.)"""
    wait_for(lambda: job_state(job_id) == "PENDING", f"job {job_id} to be pending again")
    time.sleep(2)

    def started() -> bool:
        if job_state(job_id) != "PENDING":
            return True
        subprocess.run(
            ["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True
        )
        time.sleep(2)
        return False

    wait_for(started, f"job {job_id} to start again")


def interrupt_three_times(run_dir: Path) -> str:
    """Submit, interrupt by the warning signal, by a requeue, then by a crash; the job id."""
    cmd = [
        sys.executable, "-m", "hpc_asyncppo.submit", "--config", "local-slurm", "--run-dir", str(run_dir),
        f"trainer.total_steps={STEPS}", "checkpoint.save_every=6", "actor.ppo_mini_batch_size=4",
        f"data.num_prompts={PROMPTS}", "async_training.staleness_threshold=0.5",
        "data.reward_fn=tests.integration.faults:slower",
        # Slurm 22.05's srun can hang after the step; the batch script then ends it (and
        # requeues) this long after the ranks exit, instead of the default 60 s.
        "timeouts.step_exit_s=20",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = (run_dir / "slurm" / "job_id").read_text().strip()
    try:
        wait_for(lambda: steps_logged(run_dir) >= 8, "the first steps")
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
        wait_for(lambda: (run_dir / "preempted").exists(), "a checkpoint on the warning signal")
        start_now(job_id)
        wait_for(
            lambda: restarts(run_dir) >= 1, "the job to requeue itself and resume", run_dir=run_dir
        )
        resumed_at = steps_logged(run_dir)
        wait_for(lambda: steps_logged(run_dir) >= resumed_at + 8, "progress after the first resume")
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        start_now(job_id)
        wait_for(lambda: restarts(run_dir) >= 2, "the requeued job to resume", run_dir=run_dir)
        resumed_at = steps_logged(run_dir)
        wait_for(
            lambda: steps_logged(run_dir) >= resumed_at + 7, "progress after the second resume"
        )
        leader = json.loads((run_dir / "ranks" / "rank2.json").read_text())
        os.kill(leader["pid"], signal.SIGKILL)
        wait_for(lambda: (run_dir / "restart").exists(), "the step wrapper to ask for a requeue")
        start_now(job_id)
        wait_for(lambda: restarts(run_dir) >= 3, "the crashed job to resume", run_dir=run_dir)
        wait_for(lambda: job_state(job_id) not in ACTIVE_STATES, "the job to finish", timeout_s=300)
    finally:
        if job_state(job_id) in ACTIVE_STATES:
            subprocess.run(["scancel", job_id])
    return job_id


def test_warning_signal_and_requeue_resume_with_every_sample_once(shared_dir: Path) -> None:
    run_dir = shared_dir / "run"
    job_id = interrupt_three_times(run_dir)
    assert job_state(job_id) == "COMPLETED"
    attempts = read_jsonl(run_dir / "goodput.jsonl")
    # (each attempt's reason and failure lines in the message, in full: pytest's shortened
    # repr of the rows would hide why an attempt failed)
    if [a["reason"] for a in attempts] != [
        "signal SIGUSR2",
        "signal SIGTERM",
        "failed",
        "finished",
    ]:
        why = [
            (a["attempt"], a["reason"], a.get("failure"), a.get("resumed_step")) for a in attempts
        ]
        logs = "".join(p.read_text()[-4000:] for p in (run_dir / "slurm").glob("*_log.err"))
        pytest.fail(f"attempts (attempt, reason, failure, resumed step): {why}\n{logs}")
    assert [a["slurm_restart_count"] for a in attempts] == [0, 1, 2, 3]
    # the crash: srun's report names the killed task, the wrapper restarted the job, which
    # resumed from a checkpoint and lost the work after it
    crashed = attempts[2]
    assert crashed["restarted"] is True, crashed
    assert "srun reported task 0 of its het component on node n2: Killed" in crashed["failure"]
    assert attempts[3]["resumed_step"] == crashed["failure_checkpoint"] > 0
    assert attempts[3]["lost_s"] > 0
    assert not (run_dir / "restart").exists()

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[-1]["samples/total"] == STEPS * 4 * 8
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    dropped = read_jsonl(run_dir / "dropped_samples.jsonl")
    uids = [r["uid"] for r in trained]
    assert len(uids) == len(set(uids)) == STEPS * 32
    assert not set(uids) & {r["uid"] for r in dropped}
    responses = collections.Counter()
    for row in trained + dropped:
        _, epoch, prompt, _ = row["uid"].split("-")
        responses[(int(epoch[1:]), int(prompt[1:]))] += 1
    assert set(responses.values()) == {8}
    # every prompt handed out is a prefix of the run's data order: none lost, none twice
    order = PromptOrder(PROMPTS, seed=1)
    assert set(responses) == {order.split(order.take()) for _ in range(len(responses))}
    assert json.loads((run_dir / "launch.json").read_text())["cluster"] == "slurm"
