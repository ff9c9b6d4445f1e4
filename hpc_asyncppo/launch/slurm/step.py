"""The batch script's job step: run srun, and end it if it outlives its ranks.

    python -m hpc_asyncppo.launch.slurm.step RUN_DIR srun ... python -m hpc_asyncppo.rank RUN_DIR

Slurm 22.05's srun sometimes never exits after a heterogeneous step has ended: both
step daemons log "done with job", every task is gone, and srun waits on, holding both
allocations until the time limit (seen about once per full test suite on the local
cluster, after normal ends and after --kill-on-bad-exit alike). A hung srun also never
reaches the batch script's requeue line, so a preempted run would not come back.

This wrapper runs srun as a child, copies its stderr through (noting srun's reports of
dead tasks), and watches RUN_DIR/ranks/rank{i}.json of the current attempt (same job id
and restart count). Once the step has ended, because every rank wrote a final state or
a rank failed or died, srun gets ``timeouts.step_exit_s`` to exit; after that it is
terminated, and the wrapper exits 0 if every rank finished ("done"), 1 otherwise. When
srun exits by itself, which is the normal case, its exit status is passed on unchanged.

A rank that falls silent (its heartbeat stops for ``trainer.stall_timeout_s``:
``runtime/heartbeat.py``) is recorded as that rank's error and srun is ended at once.

A step that failed, without a stop signal or a preemption's checkpoint, is judged by
``launch/job_restarts.py`` as a local launcher judges a failed attempt: to start again, the
wrapper records the failure in goodput.jsonl, moves the ranks' error records aside,
leaves RUN_DIR/restart and exits 0, and the batch script requeues the job; Slurm's delay
before a requeued job may start again is the back-off. Otherwise it says why not and
passes the failure on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpc_asyncppo import goodput
from hpc_asyncppo.launch import job_restarts
from hpc_asyncppo.launch.rundir import rank_errors, write_rank_error
from hpc_asyncppo.paths import CONFIG, PREEMPTED, RANKS, RESTART
from hpc_asyncppo.runtime import heartbeat

POLL_S = 1.0
TERMINATE_WAIT_S = 15.0  # after SIGTERM, before SIGKILL
# Starts the line the wrapper writes to the job's stderr when it ends srun itself; srun's
# reports of tasks killed after it are the wrapper's doing, not deaths.
ENDING_SRUN = "hpc_asyncppo step: srun has not exited"
# Starts the line the wrapper writes to the job's stderr before it starts srun: the job's
# log holds every attempt of a requeued job, and what follows the last such line is this
# attempt's.
STARTING_SRUN = "hpc_asyncppo step: starting srun"

# srun's report of a task that died (not of those it then terminated itself), e.g.
# "srun: error: n1: task 1: Killed"; task numbers count within each het component.
TASK_DEATH = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")


def task_death(line: str) -> str | None:
    """A readable description of the task death ``line`` reports, or None."""
    match = TASK_DEATH.match(line.strip())
    if not match or match.group(3) == "Terminated":
        return None
    node, tasks, reason = match.groups()
    return f"task {tasks} of its het component on node {node}: {reason}"


@dataclass
class StepWatch:
    """What is known of the current attempt's ranks; ``ended()`` says whether the step is over."""

    run_dir: Path
    job_id: str | None
    restart_count: str | None
    expected_ranks: int | None  # from the batch environment; a rank's world_size wins
    deaths: list[str] = field(default_factory=list)
    heartbeats: heartbeat.Watch | None = None  # this attempt's (runtime/heartbeat.py)
    ending: bool = False  # the wrapper is ending srun: the task deaths after are its doing

    @classmethod
    def from_env(cls, run_dir: Path, env: Mapping[str, str]) -> StepWatch:
        groups = int(env.get("SLURM_HET_SIZE", "0") or 0)
        counts = [env.get(f"SLURM_NTASKS_HET_GROUP_{g}") for g in range(groups)]
        expected = sum(int(c) for c in counts if c) if groups and all(counts) else None
        return cls(
            run_dir,
            env.get("SLURM_JOB_ID"),
            env.get("SLURM_RESTART_COUNT", "0"),
            expected,
        )

    def ranks(self) -> list[dict]:
        """This attempt's rank records (earlier attempts of a requeued job are skipped)."""
        records = []
        for path in (self.run_dir / RANKS).glob("rank*.json"):
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being replaced right now; read again next poll
            if (
                info.get("slurm_job_id") == self.job_id
                and info.get("slurm_restart_count") == self.restart_count
            ):
                records.append(info)
        return records

    def silent(self) -> list[str]:
        """Lines naming the ranks that fell silent, each recorded as its rank's error."""
        lines = self.heartbeats.silent() if self.heartbeats is not None else {}
        for rank, line in lines.items():
            write_rank_error(self.run_dir, rank, line)
        return list(lines.values())

    def ended(self) -> tuple[str, bool] | None:
        """(why the step is over, whether every rank finished), or None while it runs."""
        ranks = self.ranks()
        failed = sorted(r["rank"] for r in ranks if r.get("state") == "failed")
        if failed:
            return f"rank {', '.join(map(str, failed))} failed", False
        if self.deaths:
            return f"srun reported {self.deaths[0]}", False
        world = max((r.get("world_size", 0) for r in ranks), default=0) or self.expected_ranks
        done = sum(r.get("state") == "done" for r in ranks)
        if world and done >= world:
            return f"all {world} ranks finished", True
        return None


def run_step(
    command: list[str], watch: StepWatch, exit_grace_s: float, received: list[int] | None = None
) -> int:
    """Run ``command`` (srun); returns its exit status, or ours if it had to be ended.
    ``received``: the signals the wrapper forwarded to srun, appended as they come."""
    received = [] if received is None else received
    print(
        f"{STARTING_SRUN} (job {watch.job_id}, restart count {watch.restart_count})",
        file=sys.stderr,
        flush=True,
    )
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace")
    reader = threading.Thread(target=_copy_stderr, args=(proc, watch), daemon=True)
    reader.start()

    # A signal meant for the batch script (scancel --batch, a preemption) goes on to srun,
    # which passes it to the ranks; the wrapper itself keeps waiting for srun.
    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        _forward(proc, signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        return _wait(proc, reader, watch, exit_grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _wait(
    proc: subprocess.Popen, reader: threading.Thread, watch: StepWatch, exit_grace_s: float
) -> int:
    ended_at: float | None = None
    while proc.poll() is None:
        time.sleep(POLL_S)
        silent = watch.silent() if ended_at is None else []
        if silent:  # a stopped rank never exits: srun is ended now, not after a grace
            for line in silent:
                print(f"hpc_asyncppo step: {line}; ending the step", file=sys.stderr, flush=True)
            watch.ending = True
            _end(proc)
            reader.join(timeout=5.0)
            return 1
        if ended_at is None:
            ended = watch.ended()
            if ended is not None:
                ended_at, (reason, ok) = time.monotonic(), ended
        elif time.monotonic() - ended_at > exit_grace_s and proc.poll() is None:
            print(
                f"{ENDING_SRUN} {exit_grace_s:.0f} s after the step ended ({reason}); ending it "
                "(a known Slurm hang of heterogeneous steps; timeouts.step_exit_s)",
                file=sys.stderr,
                flush=True,
            )
            watch.ending = True
            _end(proc)
            reader.join(timeout=5.0)
            return 0 if ok else 1
    reader.join(timeout=5.0)
    rc = proc.returncode
    return 128 - rc if rc < 0 else rc  # killed by a signal: the shell's convention


def _copy_stderr(proc: subprocess.Popen, watch: StepWatch) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
        death = task_death(line)
        if death and not watch.ending:
            watch.deaths.append(death)


def _forward(proc: subprocess.Popen, signum: int) -> None:
    if proc.poll() is None:
        proc.send_signal(signum)


def _end(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=TERMINATE_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=TERMINATE_WAIT_S)


def after_failure(
    run_dir: Path, watch: StepWatch, code: int, start: float, max_restarts: int
) -> int:
    """Close a failed attempt's goodput row and requeue the job or not (``job_restarts.py``);
    the wrapper's exit status: 0 to requeue (RUN_DIR/restart left for the batch script),
    else ``code``."""
    lines = rank_errors(run_dir) + [f"srun reported {death}" for death in watch.deaths]
    failure = job_restarts.Failure.of(run_dir, lines or [f"the step failed (exit status {code})"])
    why_not = job_restarts.slurm_decision(
        failure, goodput.read_attempts(run_dir), start, watch.job_id, max_restarts
    )
    if why_not is None and watch.job_id:
        from hpc_asyncppo.launch.slurm.cluster import job_state

        state = job_state(watch.job_id)  # scancel ends the step without a signal to us
        if state not in ("RUNNING", "COMPLETING"):
            why_not = f"the job is {state}"
    goodput.close(run_dir, start, time.time(), failure=failure.record(why_not is None))
    if why_not is not None:
        print(f"hpc_asyncppo step: the job failed; not requeued: {why_not}", file=sys.stderr)
        return code
    job_restarts.archive_errors(run_dir, len(goodput.read_attempts(run_dir)) - 1)
    (run_dir / RESTART).write_text(json.dumps({"step": failure.step, "failure": lines}) + "\n")
    print(
        f"hpc_asyncppo step: the job failed at step {failure.step}; requeueing it to start "
        f"again from its newest checkpoint (trainer.max_restarts={max_restarts})",
        file=sys.stderr,
        flush=True,
    )
    return 0


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m hpc_asyncppo.launch.slurm.step RUN_DIR COMMAND...", file=sys.stderr)
        return 2
    from hpc_asyncppo.config import load_resolved

    run_dir = Path(argv[0]).resolve()
    cfg = load_resolved(run_dir / CONFIG)
    (run_dir / RESTART).unlink(missing_ok=True)  # the attempt before's request, now granted
    start = goodput.attempt_start()
    watch = StepWatch.from_env(run_dir, os.environ)
    watch.heartbeats = heartbeat.Watch(run_dir, start, cfg.trainer.stall_timeout_s)
    received: list[int] = []
    code = run_step(argv[1:], watch, cfg.timeouts.step_exit_s, received)
    if code != 0 and not received and not (run_dir / PREEMPTED).exists():
        return after_failure(run_dir, watch, code, start, cfg.trainer.max_restarts)
    goodput.close(run_dir, start, time.time())  # the attempt's end
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
