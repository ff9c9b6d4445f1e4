"""Goodput per attempt: where a run's wall time went, in RUN_DIR/goodput.jsonl.

An attempt is one start of the job: the first run, then each requeue under Slurm
(``SLURM_RESTART_COUNT``) or ``submit --resume``. It starts when its launcher starts (local:
the ``submit`` process; Slurm: the batch script), which passes that time on to the ranks
(``ATTEMPT_START``), and ends when its launcher is done (``close``, its last act). The
trainer leader writes the attempt's row when it starts (``begin``; the row has no end
yet) and when it ends (``end``: how, at which step); the launcher then sets the row's end
to its own, and the reason to the signal it received (it forwards a stop to the ranks as
SIGUSR2) or "failed" where the leader never said. A row still without an end when the next
attempt begins belongs to an attempt whose launcher was killed too: it is closed with the
last time the run directory shows activity (the newest metrics, timeline or log write).

Each row::

    attempt            0, 1, 2, ...
    slurm_job_id, slurm_restart_count  SLURM_JOB_ID and SLURM_RESTART_COUNT, when under Slurm
    start, end         wall times (the launcher's start; its last act)
    wall_s             end - start
    requeue_wait_s     start - the previous attempt's end (0 for the first)
    resumed_step       the checkpoint step it started from (0: a fresh start)
    lost_s             of the previous attempt, the time after its last checkpoint: work
                       thrown away (0 when it checkpointed just before it ended)
    end_step, reason   the step it reached, and how it ended (finished, a signal, failed,
                       killed)
    failure            a failed attempt's failed ranks, one line each, as the launcher tells them
    failure_checkpoint the step of the newest checkpoint when it failed (0: none yet)
    restarted          whether its launcher started the job again after the failure
                       (launch/job_restarts.py)
    stop_latency_s     from the stop signal to the durable checkpoint (a signal's end)
    tokens_regenerated response tokens of cut groups generated again in this attempt
    engine_restarts    rollout engines restarted inside their ranks in this attempt, and
    engine_restart_s   their time, from each death to the weights loaded again (summed
                       over the ranks: the generation lost, not the run's wall time)

so that the attempts' ``wall_s + requeue_wait_s`` add up to the run's wall time, from the
first launcher's start to the last one's exit. The file is rewritten whole (temporary name,
rename) at each change: a few rows.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hpc_asyncppo.paths import GOODPUT, LOGS, METRICS, TIMELINE
from hpc_asyncppo.runlog import read_jsonl
from hpc_asyncppo.runtime.startup import process_started_at

ATTEMPT_START = "HPC_ASYNCPPO_ATTEMPT_START"  # the launcher's start, time.time(), for the ranks


def attempt_start() -> float:
    """When this attempt's launcher started (``ATTEMPT_START``), else this process did."""
    value = os.environ.get(ATTEMPT_START)
    try:
        return float(value) if value else process_started_at()
    except ValueError:
        return process_started_at()


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
        start = attempt_start()
        previous = self.rows[-1] if self.rows else None
        if previous is not None and previous.get("end") is None:
            end = last_activity(run_dir) or previous["start"]
            end = min(max(end, previous["start"]), start)
            previous.update(end=end, wall_s=end - previous["start"], reason="killed")
        if previous is not None:
            # the launcher's start, read in clock ticks since boot, may fall a tick before
            # the previous attempt's end when it was started right after: never before it
            start = max(start, previous["end"])
        lost = 0.0
        if previous is not None:
            # the previous attempt's work after the checkpoint this one starts from
            kept_until = max(previous["start"], checkpoint_time or previous["start"])
            lost = max(0.0, previous["end"] - kept_until)
        self.row = _new_row(self.rows, start, resumed_step, "running", round(lost, 3))
        self.rows.append(self.row)
        _write(run_dir, self.rows)

    def end(
        self,
        step: int,
        reason: str,
        tokens_regenerated: int = 0,
        stop_latency_s: float | None = None,
        engine_restarts: int = 0,
        engine_restart_s: float = 0.0,
    ) -> None:
        end = time.time()
        self.row.update(
            end=end,
            wall_s=end - self.row["start"],
            end_step=step,
            reason=reason,
            tokens_regenerated=tokens_regenerated,
            stop_latency_s=None if stop_latency_s is None else round(stop_latency_s, 3),
            engine_restarts=engine_restarts,
            engine_restart_s=round(engine_restart_s, 3),
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
        "engine_restarts": sum(r.get("engine_restarts", 0) for r in rows),
        "goodput": (wall - sum(r["lost_s"] for r in rows)) / total if total > 0 else None,
    }


def _new_row(
    rows: list[dict], start: float, resumed_step: int | None, reason: str, lost_s: float = 0.0
) -> dict:
    """The row of an attempt that starts at ``start``, after ``rows``; no end yet."""
    previous = rows[-1] if rows else None
    waited = start - previous["end"] if previous and previous.get("end") is not None else 0.0
    slurm = {}
    if "SLURM_JOB_ID" in os.environ:
        slurm = {
            "slurm_job_id": os.environ["SLURM_JOB_ID"],
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
        }
    return {
        "attempt": len(rows),
        **slurm,
        "start": start,
        "end": None,
        "wall_s": None,
        "requeue_wait_s": max(0.0, waited),
        "resumed_step": resumed_step,
        "lost_s": lost_s,
        "end_step": resumed_step,
        "reason": reason,
        "stop_latency_s": None,
        "tokens_regenerated": 0,
        "engine_restarts": 0,
        "engine_restart_s": 0.0,
    }


def close(
    run_dir: Path,
    start: float,
    end: float,
    stopped_by: str | None = None,
    failure: dict | None = None,
) -> None:
    """The launcher's last act for an attempt: the attempt it started at ``start`` ends at
    ``end``. Its row takes that end; a stop signal's name (``stopped_by``, the one the
    launcher received, not the USR2 it forwarded); "failed" if the leader never ended it,
    with the last step logged and ``failure``'s fields (``job_restarts.Failure.record``: the
    failed ranks' lines, the newest checkpoint, whether it was restarted). An attempt
    whose leader never wrote a row (the job failed before) gets one. Closed again (a
    stop that ended the back-off before a restart), the row takes the later end."""
    rows = read_attempts(run_dir)
    row = rows[-1] if rows else None
    if row is None or abs(row["start"] - start) > 1e-3:  # not this attempt's
        row = _new_row(rows, start, None, "failed")
        rows.append(row)
    if row.get("end") is None:
        row["reason"] = "failed"
        steps = read_jsonl(run_dir / METRICS)
        if steps and (row["end_step"] is None or steps[-1]["step"] > row["end_step"]):
            row["end_step"] = steps[-1]["step"]
    elif stopped_by and str(row["reason"]).startswith("signal "):
        row["reason"] = f"signal {stopped_by}"
    if failure is not None:
        row.update(failure)
    row.update(end=end, wall_s=end - row["start"])
    _write(run_dir, rows)
