"""The batch script's step wrapper (hpc_asyncppo.launch.slurm.step).

Every Slurm integration test runs real srun under this wrapper, so the normal path (srun
exits by itself) is covered there. What cannot be produced on demand is srun's hang after
a heterogeneous step has ended (Slurm 22.05, about once per full suite here). These tests
put a real long-running process in srun's place and write the rank records the real ranks
write; the wrapper under test is the real one, run as the batch script runs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_asyncppo.config import Config, to_yaml
from hpc_asyncppo.launch.slurm import step
from hpc_asyncppo.launch.slurm.step import StepWatch, run_step, task_death

HANG_S = 60  # a bound for a hang, never a speed
JOB_ENV = {
    "SLURM_JOB_ID": "41",
    "SLURM_RESTART_COUNT": "1",
    "SLURM_HET_SIZE": "2",
    "SLURM_NTASKS_HET_GROUP_0": "2",
    "SLURM_NTASKS_HET_GROUP_1": "1",
}


def write_rank(run_dir: Path, rank: int, state: str, restart: str = "1", world: int = 3) -> None:
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    info = {
        "rank": rank,
        "world_size": world,
        "state": state,
        "slurm_job_id": "41",
        "slurm_restart_count": restart,
    }
    (run_dir / "ranks" / f"rank{rank}.json").write_text(json.dumps(info))


def test_task_death_lines_are_recognised_and_terminations_are_not() -> None:
    assert task_death("srun: error: n1: task 1: Killed") == (
        "task 1 of its het component on node n1: Killed"
    )
    assert task_death("srun: error: n2: tasks 0-3: Exited with exit code 1") is not None
    # Tasks srun terminated itself after another died are not deaths of their own.
    assert task_death("srun: error: n2: task 0: Terminated") is None
    assert task_death("0: step 3 loss 0.1") is None


def test_expected_ranks_come_from_the_het_components(tmp_path: Path) -> None:
    watch = StepWatch.from_env(tmp_path, JOB_ENV)
    assert (watch.job_id, watch.restart_count, watch.expected_ranks) == ("41", "1", 3)
    assert StepWatch.from_env(tmp_path, {"SLURM_JOB_ID": "9"}).expected_ranks is None


def test_step_ends_only_when_every_rank_of_this_attempt_finished(tmp_path: Path) -> None:
    watch = StepWatch.from_env(tmp_path, JOB_ENV)
    # The previous attempt (restart count 0) finished: that says nothing about this one.
    for rank in range(3):
        write_rank(tmp_path, rank, "done", restart="0")
    assert watch.ended() is None
    write_rank(tmp_path, 0, "done")
    write_rank(tmp_path, 1, "done")
    write_rank(tmp_path, 2, "running")
    assert watch.ended() is None
    write_rank(tmp_path, 2, "done")
    assert watch.ended() == ("all 3 ranks finished", True)


def test_a_failed_rank_or_a_task_death_ends_the_step_as_a_failure(tmp_path: Path) -> None:
    watch = StepWatch.from_env(tmp_path, JOB_ENV)
    write_rank(tmp_path, 0, "running")
    watch.deaths.append("task 1 of its het component on node n1: Killed")
    assert watch.ended() == ("srun reported task 1 of its het component on node n1: Killed", False)
    write_rank(tmp_path, 2, "failed")
    assert watch.ended() == ("rank 2 failed", False)


def test_exit_status_and_stderr_of_srun_pass_through(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    watch = StepWatch.from_env(tmp_path, JOB_ENV)
    script = "echo 'srun: error: n1: task 1: Killed' >&2; echo out; exit 3"
    assert run_step(["sh", "-c", script], watch, exit_grace_s=60.0) == 3
    out, err = capfd.readouterr()
    assert "out" in out and "srun: error: n1: task 1: Killed" in err
    assert watch.deaths == ["task 1 of its het component on node n1: Killed"]


@pytest.mark.timeout(120)  # the command sleeps 600 s: only a wrapper that never ends it hits this
def test_a_command_outliving_its_finished_ranks_is_ended_with_success(tmp_path: Path) -> None:
    for rank in range(3):
        write_rank(tmp_path, rank, "done")
    watch = StepWatch.from_env(tmp_path, JOB_ENV)
    rc = run_step(["sleep", "600"], watch, exit_grace_s=1.0)
    assert rc == 0


def test_a_hung_command_after_a_failure_is_killed_even_if_it_ignores_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step, "TERMINATE_WAIT_S", 1.0)
    write_rank(tmp_path, 0, "failed")
    watch = StepWatch.from_env(tmp_path, JOB_ENV)
    pid_file = tmp_path / "pid"
    script = f"trap '' TERM; echo $$ > {pid_file}; while true; do sleep 0.2; done"
    assert run_step(["sh", "-c", script], watch, exit_grace_s=1.0) == 1
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_wrapper_forwards_sigterm_to_srun_and_returns_its_status(tmp_path: Path) -> None:
    """As in the batch script: a signal to the wrapper reaches srun, which ends the step."""
    (tmp_path / "config.yaml").write_text(to_yaml(Config()))
    got = tmp_path / "got"
    ready = tmp_path / "ready"
    script = f"trap 'echo TERM > {got}; exit 0' TERM; touch {ready}; while true; do sleep 0.1; done"
    env = {**os.environ, **JOB_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpc_asyncppo.launch.slurm.step", str(tmp_path), "sh", "-c", script],
        env=env,
    )
    deadline = time.monotonic() + HANG_S
    while not ready.exists():
        assert time.monotonic() < deadline, "the wrapped command never started"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG_S) == 0
    assert got.read_text().strip() == "TERM"


def test_a_failed_step_requeues_the_job_until_the_failure_repeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The wrapper as the batch script runs it, after a failed srun: the first failure
    leaves RUN_DIR/restart (the script then requeues) and exits 0; the same failure in the
    requeued attempt, with no checkpoint between, is a crash loop: passed on, no marker.
    The job's state is the one thing not asked of a real Slurm here (the requeue itself,
    on the local cluster: test_slurm_preemption.py)."""
    from hpc_asyncppo.goodput import read_attempts
    from hpc_asyncppo.launch.rundir import write_rank_error
    from hpc_asyncppo.launch.slurm import cluster
    from hpc_asyncppo.launch.slurm.submit import task_deaths

    (tmp_path / "config.yaml").write_text(to_yaml(Config()))
    (tmp_path / "slurm").mkdir()
    monkeypatch.setattr(cluster, "job_state", lambda job_id: "RUNNING")
    for key, value in JOB_ENV.items():
        monkeypatch.setenv(key, value)
    srun = ["sh", "-c", "echo 'srun: error: n2: task 0: Killed' >&2; exit 1"]
    log = tmp_path / "slurm" / "41_0_log.err"

    def attempt(restart_count: int) -> int:
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart_count))
        monkeypatch.setenv("HPC_ASYNCPPO_ATTEMPT_START", repr(time.time()))
        write_rank_error(tmp_path, 1, "rank 1 (rollout, n1): RuntimeError: CUDA error")
        code = step.main([str(tmp_path), *srun])
        log.open("a").write(capfd.readouterr().err)  # the job's log, one per attempt
        return code

    assert attempt(0) == 0
    assert (tmp_path / "restart").exists()
    assert "requeueing it to start again from its newest checkpoint" in log.read_text()
    assert (tmp_path / "errors" / "attempt0" / "rank1.txt").exists()
    [first] = read_attempts(tmp_path)
    assert first["reason"] == "failed" and first["restarted"] is True
    assert first["failure"] == [
        "rank 1 (rollout, n1): RuntimeError: CUDA error",
        "srun reported task 0 of its het component on node n2: Killed",
    ]
    time.sleep(0.01)
    assert attempt(1) == 1
    assert not (tmp_path / "restart").exists()
    assert "not requeued: a crash loop" in log.read_text()
    rows = read_attempts(tmp_path)
    assert [r["restarted"] for r in rows] == [True, False]
    assert [r["slurm_restart_count"] for r in rows] == [0, 1]
    # what submit --wait prints: the last attempt's deaths, not every attempt's
    assert task_deaths(tmp_path, "41") == ["task 0 of its het component on node n2: Killed"]
    # a job cancelled meanwhile (scancel ends the step, no signal reaches the wrapper); the
    # attempt before was not restarted, so this is no loop's second half
    monkeypatch.setattr(cluster, "job_state", lambda job_id: "CANCELLED")
    assert attempt(2) == 1
    assert "not requeued: the job is CANCELLED" in log.read_text()


@pytest.mark.timeout(120)  # the command loops: only a wrapper that never ends it hits this
def test_a_silent_rank_ends_the_step_at_once_and_is_recorded_as_its_error(tmp_path: Path) -> None:
    """A stopped rank never exits: its heartbeat stops (runtime/heartbeat.py), and the
    wrapper records the rank's line and ends srun without waiting for the step's end."""
    from hpc_asyncppo.launch.rundir import rank_errors
    from hpc_asyncppo.runtime import heartbeat

    start = time.time()
    write_rank(tmp_path, 1, "running")
    (tmp_path / "heartbeats").mkdir()
    beat = {"attempt": repr(start), "count": 3, "doing": "generating under weights version 2"}
    (tmp_path / "heartbeats" / "rank1.json").write_text(json.dumps(beat))  # and no more beats
    watch = StepWatch.from_env(tmp_path, JOB_ENV)
    watch.heartbeats = heartbeat.Watch(tmp_path, start, stall_timeout_s=1.0)
    # srun, ended, reports the tasks it killed: the wrapper's doing, not deaths to record
    srun = "trap 'echo \"srun: error: n2: task 0: Killed\" >&2; exit 1' TERM; while true; do sleep 0.1; done"
    assert run_step(["sh", "-c", srun], watch, exit_grace_s=600.0) == 1
    [line] = rank_errors(tmp_path)
    assert line.startswith("rank 1 (") and "fell silent" in line and "version 2" in line
    assert watch.deaths == []
