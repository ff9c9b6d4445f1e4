"""Heartbeats (runtime/heartbeat.py): real processes beat, one is SIGSTOPped, the watch
names it and only it. The launchers acting on it, in real runs: tests/integration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpc_asyncppo.runtime import heartbeat

# Long enough that a beating process is not taken for a silent one on a loaded machine:
# at 2 s, one beating child went unscheduled (no beat) for 3 s during a full-suite run.
STALL_S = 5.0
BEATING = """
import sys, time
from pathlib import Path
from hpc_asyncppo.runtime import heartbeat
heartbeat.start(Path(sys.argv[1]), int(sys.argv[2]), {stall})
heartbeat.doing(sys.argv[3])
if sys.argv[3] == "finishing":
    time.sleep(0.5)
    heartbeat.stop()
time.sleep(60)
"""


def rank(run_dir: Path, index: int, role: str, doing: str, start: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", BEATING.format(stall=STALL_S), str(run_dir), str(index), doing],
        env={**os.environ, heartbeat.ATTEMPT_START: repr(start)},
    )
    record = {"rank": index, "role": role, "host": "n1", "pid": proc.pid}
    (run_dir / "ranks" / f"rank{index}.json").write_text(json.dumps(record))
    return proc


def test_a_stopped_rank_is_named_with_what_it_and_the_leader_were_doing(tmp_path):
    (tmp_path / "ranks").mkdir()
    start = time.time()
    # an earlier attempt's file, never updated: not this attempt's, not watched
    (tmp_path / "heartbeats").mkdir()
    (tmp_path / "heartbeats" / "rank3.json").write_text(
        json.dumps({"attempt": repr(start - 100), "count": 7, "doing": "old"})
    )
    procs = [
        rank(tmp_path, 0, "rollout", "generating under weights version 2", start),
        rank(tmp_path, 1, "trainer", "waiting for samples for step 5", start),
        rank(tmp_path, 2, "trainer", "finishing", start),  # ends its heartbeat: exited
    ]
    watch = heartbeat.Watch(tmp_path, start, STALL_S)
    try:
        deadline = time.monotonic() + 30
        while len(watch.seen) < 3:  # every rank's first beat (the interpreters start)
            watch.poll()
            assert time.monotonic() < deadline, watch.seen
            time.sleep(0.1)
        time.sleep(STALL_S + 1)
        assert watch.silent() == {}  # beating, or exited
        os.kill(procs[0].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while not (lines := watch.silent()):
            assert time.monotonic() - stopped_at < STALL_S + 5, "never named"
            time.sleep(0.1)
        # named within the timeout and a beat's interval, not before the timeout
        assert time.monotonic() - stopped_at >= STALL_S - heartbeat.interval_s(STALL_S)
        assert lines == {
            0: f"rank 0 (rollout, n1, pid {procs[0].pid}) fell silent: no heartbeat for "
            "trainer.stall_timeout_s=5 s (stopped, its node frozen, or hung holding its "
            "interpreter); its last beat said it was generating under weights version 2; the "
            "trainer leader is waiting for samples for step 5"
        }
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_no_timeout_means_no_heartbeat_and_no_watch(tmp_path):
    heartbeat.start(tmp_path, 0, 0)  # in this process: a no-op
    assert not (tmp_path / "heartbeats").exists()
    assert heartbeat.Watch(tmp_path, time.time(), 0).silent() == {}
