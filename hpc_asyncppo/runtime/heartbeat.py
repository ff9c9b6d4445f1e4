"""Each rank's heartbeat, and the launcher's watch for ranks that fell silent.

A rank that dies is seen at once (mpirun or srun report it). A rank that stops without
dying is not: SIGSTOPped, its node frozen, its interpreter held by a C call that never
returns. Its peers then wait in a collective or for its messages until their own
timeouts (``timeouts.*``, minutes), which cannot say who is missing. So every rank runs a
thread (``start``) that rewrites ``RUN_DIR/heartbeats/rank{i}.json`` every few seconds with
a count and what the rank is doing (``doing``: "waiting for samples for step 12"). The
launcher (locally ``launch/local.py``, under Slurm the step wrapper) reads those files at
each poll (``Watch``); a rank whose count has not moved for ``trainer.stall_timeout_s`` of
the launcher's own clock (no clock is compared across nodes) is silent. The launcher
records one line for it as the rank's error, naming what it and the trainer leader were
doing, and ends the attempt; ``launch/job_restarts.py`` then restarts the job.

A beat is one small write: with the default timeout (300 s) a rank writes every 10 s. The
file names this attempt (``goodput.ATTEMPT_START``), so an earlier attempt's files are not
read as this one's. A rank that ends writes "exited" (``stop``) and is no longer watched.

What a rank keeps: one thread and a string. What the watch keeps: per rank, the last
count seen and when.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_asyncppo.goodput import ATTEMPT_START
from hpc_asyncppo.paths import HEARTBEATS
from hpc_asyncppo.runlog import read_rank_info

EXITED = "exited"


def interval_s(stall_timeout_s: float) -> float:
    """Seconds between beats: five or more beats per timeout, at most one every 10 s."""
    return max(0.2, min(10.0, stall_timeout_s / 5))


class _Beat:
    def __init__(self) -> None:
        self.doing = "starting"
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.path: Path | None = None
        self.count = 0


_beat = _Beat()


def doing(what: str) -> None:
    """Say what this rank is doing now; the next beat carries it (a string assignment)."""
    _beat.doing = what


def start(run_dir: Path, rank: int, stall_timeout_s: float) -> None:
    """Start this rank's heartbeat thread (once per process; 0 turns heartbeats off)."""
    if stall_timeout_s <= 0 or _beat.thread is not None:
        return
    (run_dir / HEARTBEATS).mkdir(exist_ok=True)
    _beat.path = run_dir / HEARTBEATS / f"rank{rank}.json"
    every = interval_s(stall_timeout_s)
    attempt = os.environ.get(ATTEMPT_START, "")

    def run() -> None:
        while True:
            _write(_beat.path, attempt, _beat.count, _beat.doing)
            _beat.count += 1
            if _beat.stopped.wait(every):
                return

    _beat.thread = threading.Thread(target=run, name="heartbeat", daemon=True)
    _beat.thread.start()


def stop() -> None:
    """This rank ends: its last beat says so, and the launcher stops watching it."""
    if _beat.thread is None or _beat.path is None:
        return
    _beat.stopped.set()
    _beat.thread.join(timeout=5.0)
    _write(_beat.path, os.environ.get(ATTEMPT_START, ""), _beat.count, EXITED)


def _write(path: Path, attempt: str, count: int, what: str) -> None:
    try:
        path.write_text(json.dumps({"attempt": attempt, "count": count, "doing": what}))
    except OSError:
        pass  # a full or flaky filesystem: a missed beat; the watch tolerates several


@dataclass
class _Seen:
    count: int
    at: float  # the watch's monotonic clock
    doing: str


class Watch:
    """The launcher's view of this attempt's heartbeats; ``silent()`` names the ranks whose
    beats stopped for ``stall_timeout_s``."""

    def __init__(self, run_dir: Path, attempt_start: float, stall_timeout_s: float):
        self.run_dir, self.attempt_start, self.timeout_s = run_dir, attempt_start, stall_timeout_s
        self.seen: dict[int, _Seen] = {}

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for path in (self.run_dir / HEARTBEATS).glob("rank*.json"):
            try:
                beat = json.loads(path.read_text())
                rank = int(path.stem[4:])
                if abs(float(beat["attempt"]) - self.attempt_start) > 1e-3:
                    continue  # an earlier attempt's
            except (OSError, ValueError, KeyError):
                continue  # being rewritten, or not this attempt's
            last = self.seen.get(rank)
            if last is None or last.count != beat["count"] or beat["doing"] == EXITED:
                self.seen[rank] = _Seen(beat["count"], now, beat["doing"])

    def silent(self, now: float | None = None) -> dict[int, str]:
        """A line for each silent rank, by rank (empty while every watched rank beats)."""
        if self.timeout_s <= 0:
            return {}
        now = time.monotonic() if now is None else now
        self.poll(now)
        quiet = sorted(
            rank
            for rank, seen in self.seen.items()
            if seen.doing != EXITED and now - seen.at > self.timeout_s
        )
        if not quiet:
            return {}
        info = {record["rank"]: record for record in read_rank_info(self.run_dir)}
        leader = min((r for r, i in info.items() if i.get("role") == "trainer"), default=None)
        lines = {}
        for rank in quiet:
            i = info.get(rank, {})
            where = ", ".join(
                str(x) for x in (i.get("role", "?"), i.get("slurm_node") or i.get("host", "?"))
            )
            pid = f", pid {i['pid']}" if "pid" in i else ""
            line = (
                f"rank {rank} ({where}{pid}) fell silent: no heartbeat for "
                f"trainer.stall_timeout_s={self.timeout_s:g} s (stopped, its node frozen, or "
                f"hung holding its interpreter); its last beat said it was {self.seen[rank].doing}"
            )
            if leader is not None and leader != rank and leader in self.seen:
                line += f"; the trainer leader is {self.seen[leader].doing}"
            lines[rank] = line
        return lines
