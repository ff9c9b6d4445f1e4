"""Goodput per attempt: where a run's wall time went, in RUN_DIR/goodput.jsonl.

An attempt is one start of the job's ranks: the first run, then each requeue under Slurm
(``SLURM_RESTART_COUNT``) or ``submit --resume``. The trainer leader writes one row per
attempt: when it starts (``begin``; the row has no end yet) and again when it ends
(``end``). A row still without an end when the next attempt begins belongs to an attempt
that was killed before it could say so: it is closed with the last time the run directory
shows activity (the newest metrics, timeline or log write).

Each row::

    attempt            0, 1, 2, ...
    slurm_restart_count  SLURM_RESTART_COUNT, when under Slurm
    start, end         wall times (the leader's process start; its last act)
    wall_s             end - start
    requeue_wait_s     start - the previous attempt's end (0 for the first)
    resumed_step       the checkpoint step it started from (0: a fresh start)
    lost_s             of the previous attempt, the time after its last checkpoint: work
                       thrown away (0 when it checkpointed just before it ended)
    end_step, reason   the step it reached, and how it ended (finished, a signal, failed,
                       killed)
    stop_latency_s     from the stop signal to the durable checkpoint (a signal's end)
    tokens_regenerated response tokens of cut groups generated again in this attempt

so that the attempts' ``wall_s + requeue_wait_s`` add up to the run's wall time, from the
first start to the last end. The file is rewritten whole (temporary name, rename) at each
change: a few rows.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hpc_asyncppo.paths import GOODPUT, LOGS, METRICS, TIMELINE
from hpc_asyncppo.runlog import read_jsonl


def process_start_time() -> float:
    """Wall time this process started (from /proc; now if unknown)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def read_attempts(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / GOODPUT)


def _write(run_dir: Path, rows: list[dict]) -> None:
    tmp = run_dir / (GOODPUT + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(run_dir / GOODPUT)


def last_activity(run_dir: Path) -> float | None:
    """The newest write among the run's logs of progress (for a killed attempt's end)."""
    paths = [run_dir / METRICS, *run_dir.glob(f"{TIMELINE}/*"), *run_dir.glob(f"{LOGS}/*")]
    times = [p.stat().st_mtime for p in paths if p.is_file()]
    return max(times) if times else None


class Attempt:
    """The trainer leader's record of the attempt it runs."""

    def __init__(self, run_dir: Path, resumed_step: int, checkpoint_time: float | None):
        """``checkpoint_time``: when the checkpoint resumed from was committed (None on a
        fresh start)."""
        self.run_dir = run_dir
        self.rows = read_attempts(run_dir)
        start = process_start_time()
        previous = self.rows[-1] if self.rows else None
        if previous is not None and previous.get("end") is None:
            end = last_activity(run_dir) or previous["start"]
            end = min(max(end, previous["start"]), start)
            previous.update(end=end, wall_s=end - previous["start"], reason="killed")
        lost = 0.0
        if previous is not None:
            # the previous attempt's work after the checkpoint this one starts from
            kept_until = max(previous["start"], checkpoint_time or previous["start"])
            lost = max(0.0, previous["end"] - kept_until)
        self.row = {
            "attempt": len(self.rows),
            "start": start,
            "end": None,
            "wall_s": None,
            "requeue_wait_s": max(0.0, start - previous["end"]) if previous else 0.0,
            "resumed_step": resumed_step,
            "lost_s": round(lost, 3),
            "end_step": resumed_step,
            "reason": "running",
            "stop_latency_s": None,
            "tokens_regenerated": 0,
        }
        if "SLURM_RESTART_COUNT" in os.environ or "SLURM_JOB_ID" in os.environ:
            self.row["slurm_restart_count"] = int(os.environ.get("SLURM_RESTART_COUNT", 0))
        self.rows.append(self.row)
        _write(run_dir, self.rows)

    def end(
        self,
        step: int,
        reason: str,
        tokens_regenerated: int = 0,
        stop_latency_s: float | None = None,
    ) -> None:
        end = time.time()
        self.row.update(
            end=end,
            wall_s=end - self.row["start"],
            end_step=step,
            reason=reason,
            tokens_regenerated=tokens_regenerated,
            stop_latency_s=None if stop_latency_s is None else round(stop_latency_s, 3),
        )
        _write(self.run_dir, self.rows)


def summary(rows: list[dict]) -> dict:
    """Totals over the attempts: wall, requeue wait, lost work, regenerated tokens."""
    ended = [r for r in rows if r.get("end") is not None]
    total = (ended[-1]["end"] - rows[0]["start"]) if ended else 0.0
    wall = sum(r["wall_s"] or 0.0 for r in rows)
    return {
        "attempts": len(rows),
        "run_wall_s": total,
        "attempts_wall_s": wall,
        "requeue_wait_s": sum(r["requeue_wait_s"] for r in rows),
        "lost_s": sum(r["lost_s"] for r in rows),
        "tokens_regenerated": sum(r["tokens_regenerated"] for r in rows),
        "goodput": (wall - sum(r["lost_s"] for r in rows)) / total if total > 0 else None,
    }
