"""Heartbeats (runtime/heartbeat.py). The watch's bookkeeping on an injected clock, exactly;
then real processes that beat, one SIGSTOPped: the watch names it and only it, judged on
the beats the others made after the stop, not on how soon the machine scheduled them. The
launchers acting on it, in real runs: tests/integration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpc_asyncppo.runtime import heartbeat

STALL_S = 5.0
HANG_S = 60.0  # a bound for a hang, never a speed
ATTEMPT = 1000.0


def write_rank(run_dir: Path, rank: int, role: str, pid: int = 4242) -> None:
    (run_dir / "ranks").mkdir(exist_ok=True)
    record = {"rank": rank, "role": role, "host": "n1", "pid": pid}
    (run_dir / "ranks" / f"rank{rank}.json").write_text(json.dumps(record))


def beat(run_dir: Path, rank: int, count: int, doing: str, attempt: float = ATTEMPT) -> None:
    (run_dir / "heartbeats").mkdir(exist_ok=True)
    body = {"attempt": repr(attempt), "count": count, "doing": doing}
    (run_dir / "heartbeats" / f"rank{rank}.json").write_text(json.dumps(body))


def test_a_rank_is_silent_once_its_count_has_not_moved_for_the_timeout(tmp_path):
    for rank, role in enumerate(("rollout", "trainer", "trainer")):
        write_rank(tmp_path, rank, role)
    watch = heartbeat.Watch(tmp_path, ATTEMPT, STALL_S)
    beat(tmp_path, 0, 0, "generating under weights version 2")
    beat(tmp_path, 1, 0, "waiting for samples for step 5")
    beat(tmp_path, 2, 0, heartbeat.EXITED)
    beat(tmp_path, 3, 7, "old", attempt=ATTEMPT - 100)  # an earlier attempt's: not watched
    watch.poll(now=10.0)
    assert sorted(watch.seen) == [0, 1, 2]
    beat(tmp_path, 1, 1, "waiting for samples for step 5")
    assert watch.silent(now=14.0) == {}  # rank 1 seen beating at 14
    assert watch.silent(now=15.0) == {}  # rank 0: exactly the timeout, not past it
    lines = watch.silent(now=15.001)
    assert lines == {
        0: "rank 0 (rollout, n1, pid 4242) fell silent: no heartbeat for "
        "trainer.stall_timeout_s=5 s (stopped, its node frozen, or hung holding its "
        "interpreter); its last beat said it was generating under weights version 2; the "
        "trainer leader is waiting for samples for step 5"
    }
    # an exited rank is never named; the leader past its own timeout is, without itself
    assert set(watch.silent(now=1000.0)) == {0, 1}
    assert "the trainer leader" not in watch.silent(now=1000.0)[1]
    # a beat again clears it: the count moved
    beat(tmp_path, 0, 1, "generating under weights version 3")
    assert 0 not in watch.silent(now=1000.5)


BEATING = """
import sys, time
from pathlib import Path
from hpc_asyncppo.runtime import heartbeat
heartbeat.start(Path(sys.argv[1]), int(sys.argv[2]), {stall})
heartbeat.doing(sys.argv[3])
if sys.argv[3] == "finishing":
    time.sleep(0.5)
    heartbeat.stop()
time.sleep(120)
"""


def rank(run_dir: Path, index: int, role: str, doing: str, start: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", BEATING.format(stall=STALL_S), str(run_dir), str(index), doing],
        env={**os.environ, heartbeat.ATTEMPT_START: repr(start)},
    )
    write_rank(run_dir, index, role, proc.pid)
    return proc


def poll_until(watch: heartbeat.Watch, done, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while True:
        watch.poll()
        if done():
            return
        assert time.monotonic() < deadline, f"{what}: {watch.seen}"
        time.sleep(0.1)


def test_a_stopped_rank_is_named_with_what_it_and_the_leader_were_doing(tmp_path):
    start = time.time()
    procs = [
        rank(tmp_path, 0, "rollout", "generating under weights version 2", start),
        rank(tmp_path, 1, "trainer", "waiting for samples for step 5", start),
        rank(tmp_path, 2, "trainer", "finishing", start),  # ends its heartbeat: exited
    ]
    watch = heartbeat.Watch(tmp_path, start, STALL_S)
    try:
        saying = {0: "generating under weights version 2", 1: "waiting for samples for step 5"}
        saying[2] = heartbeat.EXITED
        poll_until(  # each rank's first beat says "starting"; its next one what it does
            watch,
            lambda: all(r in watch.seen and watch.seen[r].doing == d for r, d in saying.items()),
            "every rank's beat saying what it does",
        )
        os.kill(procs[0].pid, signal.SIGSTOP)
        # Rank 1 beats twice more after the stop: by then any beat rank 0 wrote before it
        # has been read, and rank 1 was seen beating after rank 0's last beat.
        after = watch.seen[1].count
        poll_until(watch, lambda: watch.seen[1].count >= after + 2, "rank 1's beats")
        stopped = watch.seen[0]
        assert watch.seen[1].at > stopped.at
        assert watch.silent(now=stopped.at + STALL_S) == {}  # not before the timeout
        lines = watch.silent(now=stopped.at + STALL_S + 0.001)
        assert lines == {
            0: f"rank 0 (rollout, n1, pid {procs[0].pid}) fell silent: no heartbeat for "
            "trainer.stall_timeout_s=5 s (stopped, its node frozen, or hung holding its "
            "interpreter); its last beat said it was generating under weights version 2; the "
            "trainer leader is waiting for samples for step 5"
        }
        assert watch.seen[0].count == stopped.count  # a stopped process wrote nothing since
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_no_timeout_means_no_heartbeat_and_no_watch(tmp_path):
    heartbeat.start(tmp_path, 0, 0)  # in this process: a no-op
    assert not (tmp_path / "heartbeats").exists()
    assert heartbeat.Watch(tmp_path, time.time(), 0).silent() == {}
