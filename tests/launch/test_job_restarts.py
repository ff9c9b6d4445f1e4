"""What the launcher restarts and when it stops trying (launch/job_restarts.py), on run
directories laid out as a failed attempt leaves them. The restarts themselves, in real
runs under mpirun: tests/integration/test_local_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_asyncppo.launch.job_restarts import (
    Failure,
    archive_errors,
    backoff_s,
    slurm_decision,
    why_not_restart,
)
from hpc_asyncppo.launch.rundir import rank_errors, write_rank_error

KILLED = "rank 1 (rollout, n1, pid {pid}) died: killed by signal 9 (SIGKILL)"
CRASHED = "rank 3 (trainer, n2): RuntimeError: CUDA error: an illegal memory access"


def failed_run(root: Path, steps: int, checkpoints: list[int]) -> Path:
    """A run directory with ``steps`` metrics rows and committed checkpoints of ``checkpoints``."""
    run_dir = root / f"run{len(list(root.iterdir()))}"
    run_dir.mkdir()
    rows = "".join(json.dumps({"step": s, "reward/mean": 0.1}) + "\n" for s in range(1, steps + 1))
    (run_dir / "metrics.jsonl").write_text(rows)
    for step in checkpoints:
        folder = run_dir / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps({"step": step}))
    (run_dir / "checkpoints" / "step_00009999").mkdir(parents=True)  # uncommitted: no manifest
    return run_dir


def test_a_failure_records_its_last_step_and_newest_committed_checkpoint(tmp_path):
    failure = Failure.of(failed_run(tmp_path, 17, [5, 15, 10]), [KILLED.format(pid=7)])
    assert (failure.step, failure.checkpoint) == (17, 15)
    assert Failure.of(failed_run(tmp_path, 0, []), []).checkpoint == 0


@pytest.mark.parametrize(
    ("line", "cause"),
    [
        ("rank 2 (trainer, n2): ConfigError: actor.lr must be > 0", "the input is wrong (ConfigError)"),
        ("rank 0 (rollout, n1): DatasetError: row 3 has no prompt", "the input is wrong (DatasetError)"),
        ("rank 2 (trainer, n2): hpc_asyncppo.checkpoint.store.CheckpointError: tensor 'w' has shape (2,)",
         "the input is wrong (hpc_asyncppo.checkpoint.store.CheckpointError)"),
        ("rank 0 (rollout, n1): ModuleNotFoundError: No module named 'my_reward'",
         "the input is wrong (ModuleNotFoundError)"),
        ("rank 2 (trainer, n2): OSError: [Errno 28] No space left on device", "the disk is full"),
        ("rank 2 (trainer, n2): OSError: [Errno 122] Disk quota exceeded", "the disk is full"),
        ("rank 2 (trainer, n2): CheckpointError: writing /r/step_00000004/trainer0.h5 failed: "
         "[Errno 28] No space left on device", "the disk is full"),
        ("rank 2 (trainer, n2): CheckpointError: writing /r/step_00000004/trainer0.h5 failed: "
         "[Errno 5] Input/output error", None),
        (CRASHED, None),
        (KILLED.format(pid=4), None),
        ("rank 2 (trainer, n2): PeerTimeout: no samples from rollout rank 1 for 600 s", None),
    ],
)  # fmt: skip
def test_input_errors_and_a_full_disk_are_final_and_the_rest_retried(tmp_path, line, cause):
    failure = Failure(lines=(KILLED.format(pid=9), line), step=3, checkpoint=0)
    assert failure.final_cause() == cause
    assert (why_not_restart(failure, None, 0, 3) is None) == (cause is None)


def test_the_same_failure_without_a_checkpoint_between_is_a_crash_loop():
    first = Failure((KILLED.format(pid=100), CRASHED), step=12, checkpoint=10)
    # the same ranks failing the same way (other pids), having redone the same steps
    again = Failure((CRASHED, KILLED.format(pid=200)), step=11, checkpoint=10)
    why = why_not_restart(again, first, 1, 3)
    assert why is not None and "crash loop" in why and "step 10" in why
    # progress saved in between: a node lost twice in a day, not a loop
    later = Failure((KILLED.format(pid=300), CRASHED), step=23, checkpoint=20)
    assert why_not_restart(later, first, 1, 3) is None
    # the cause in common, the lines of its peers not (a lost connection recorded or not)
    peer = "rank 2 (trainer, n2): RuntimeError: Connection closed by peer [127.0.0.1]:40213"
    assert why_not_restart(Failure((KILLED.format(pid=5), peer), 9, 10), first, 1, 3)
    # another failure, no checkpoint in between: retried
    other = Failure(("rank 0 (rollout, n1, pid 7) died: killed by signal 9 (SIGKILL)",), 12, 10)
    assert why_not_restart(other, first, 1, 3) is None


def test_restarts_are_bounded_and_backed_off():
    failure = Failure((KILLED.format(pid=1),), step=5, checkpoint=0)
    assert why_not_restart(failure, None, 2, 3) is None
    assert why_not_restart(failure, None, 3, 3) == "trainer.max_restarts=3 restarts made"
    assert why_not_restart(failure, None, 0, 0) == "trainer.max_restarts=0 restarts made"
    assert [backoff_s(10, n) for n in range(8)] == [10, 20, 40, 80, 160, 320, 600, 600]


def test_a_failed_attempts_errors_are_kept_apart_from_the_next_ones(tmp_path):
    write_rank_error(tmp_path, 1, "rank 1 (rollout, n1): RuntimeError: first\n\nTraceback ...")
    archive_errors(tmp_path, 0)
    assert rank_errors(tmp_path) == []
    assert "first" in (tmp_path / "errors" / "attempt0" / "rank1.txt").read_text()
    write_rank_error(tmp_path, 2, "rank 2 (trainer, n2): RuntimeError: second")
    assert rank_errors(tmp_path) == ["rank 2 (trainer, n2): RuntimeError: second"]
    archive_errors(tmp_path, 1)
    archive_errors(tmp_path, 2)  # nothing recorded: nothing moved
    assert sorted(p.name for p in (tmp_path / "errors").iterdir()) == ["attempt0", "attempt1"]


def row(start: float, job: str, failure: Failure | None = None, restarted: bool = False) -> dict:
    """A goodput.jsonl row of a Slurm attempt, as goodput.close leaves a failed one."""
    out = {"start": start, "end": start + 50, "slurm_job_id": job, "end_step": 0}
    if failure is not None:
        out.update(failure.record(restarted), end_step=failure.step)
    return out


def test_a_slurm_attempt_is_judged_from_the_attempts_goodput_recorded():
    """Under Slurm every attempt is a new batch script: what the local launcher keeps in
    memory (the failure before, the restarts made) comes from goodput.jsonl's rows."""
    killed = Failure((KILLED.format(pid=1),), step=12, checkpoint=10)
    assert Failure.from_row(row(0, "7", killed, True)) == killed
    assert Failure.from_row(row(0, "7")) is None
    # this attempt (start 300) may already have its row (the leader's): not an earlier one
    rows = [row(0, "7", killed, True), row(100, "7"), row(300, "7")]
    again = Failure((KILLED.format(pid=2),), step=13, checkpoint=10)
    assert slurm_decision(again, rows, 300, "7", 3) is None  # a preemption came between
    rows = [row(0, "7", killed, True), row(300, "7")]
    assert "crash loop" in slurm_decision(again, rows, 300, "7", 3)
    moved_on = Failure((KILLED.format(pid=2),), step=25, checkpoint=20)
    assert slurm_decision(moved_on, rows, 300, "7", 3) is None
    assert slurm_decision(moved_on, rows, 300, "7", 1) == "trainer.max_restarts=1 restarts made"
    # restarts are counted per job: a resubmitted run (another job id) starts again from 0
    assert slurm_decision(moved_on, rows, 300, "8", 1) is None
    # a failure the launcher did not restart (stopped, final) is no loop's first half
    rows = [row(0, "7", killed, False), row(300, "7")]
    assert slurm_decision(again, rows, 300, "7", 3) is None


def test_a_backoff_a_stop_ends_belongs_to_the_failed_attempt(tmp_path):
    """The launcher closes a failed attempt, backs off, and is stopped before it restarts:
    the attempt's row ends when the launcher gave up (goodput adds up to the run's wall
    time, first start to last exit), and it was not restarted after all."""
    from hpc_asyncppo import goodput

    failure = Failure((KILLED.format(pid=1),), step=5, checkpoint=3)
    goodput.close(tmp_path, 100.0, 130.0, failure=failure.record(True))
    goodput.close(tmp_path, 100.0, 137.5, failure=failure.record(False))  # stopped at 137.5
    [row] = goodput.read_attempts(tmp_path)
    assert (row["end"], row["wall_s"], row["reason"]) == (137.5, 37.5, "failed")
    assert row["restarted"] is False and row["failure"] == [KILLED.format(pid=1)]
    assert goodput.summary([row])["run_wall_s"] == 37.5


def test_an_attempt_started_within_a_clock_tick_of_the_last_ones_end_begins_at_that_end(
    tmp_path, monkeypatch
):
    """The launcher's start is read from /proc in clock ticks: a resume right after a stop
    may seem to start before the stopped attempt ended. Its row starts at that end (no
    overlap, no negative wait), and the walls still add up to the run's."""
    from hpc_asyncppo import goodput

    monkeypatch.setenv(goodput.ATTEMPT_START, "100.0")
    first = goodput.Attempt(tmp_path, 0, None)
    with monkeypatch.context() as m:
        m.setattr(goodput.time, "time", lambda: 130.0)
        first.end(9, "signal SIGTERM")
    monkeypatch.setenv(goodput.ATTEMPT_START, "129.995")  # a tick early
    second = goodput.Attempt(tmp_path, 9, 129.0)
    assert second.row["start"] == 130.0 and second.row["requeue_wait_s"] == 0.0
    assert second.row["lost_s"] == 1.0  # the work after the checkpoint it resumed from
