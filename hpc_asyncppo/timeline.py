"""When each rank was generating, waiting, sending, training, syncing weights, checkpointing.

Each rank appends to ``RUN_DIR/timeline/rank{i}.jsonl``, one span per line::

    {"span": "generate", "start": 1718000000.123456, "end": 1718000000.173456}
    {"span": "train", "start": ..., "end": ..., "step": 12, "phases": {"forward": 0.031, ...}}

Times are wall-clock (``time.time()``) so that ranks on different hosts line up on one
axis. Each process opens its file with a ``session`` marker (pid, role), so a resumed run's
restarted ranks append a new session to the same file. Writes are buffered and flushed
about once a second and at close: recording a span costs a list append on the hot path.
Back-to-back spans of the same kind with no fields (the rollout's 2 ms waits) are merged
into one, so a long wait is one line.

Spans by role (``SPANS``): rollout ranks ``generate``, ``send``, ``wait`` (no credits),
``sync`` (weights received), ``checkpoint`` (writing its part); trainer ranks ``wait``
(leader: for samples; followers: for their shard), ``train`` (one step: batch, PPO update,
logging; ``phases``: the update's seconds in each phase, ``policy.PhaseClock``), ``sync``
(leader: weights broadcast), ``checkpoint``.

The idle ratios logged in metrics.jsonl are recomputed from these spans by
:func:`idle_ratio` (one session) and :func:`trainer_idle_ratio` (the leader's, across
resumes); tests check they agree with the logged ones.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_asyncppo.paths import TIMELINE
from hpc_asyncppo.runlog import end_torn_line

SPANS = {
    "rollout": ("generate", "send", "wait", "sync", "checkpoint"),
    "trainer": ("wait", "train", "sync", "checkpoint"),
}
FLUSH_EVERY_S = 1.0
MERGE_GAP_S = 1.0  # consecutive same-kind spans closer than this are one (a wait loop's polls)


def timeline_path(run_dir: Path, rank: int) -> Path:
    return run_dir / TIMELINE / f"rank{rank}.jsonl"


class Timeline:
    """One rank's span recorder. Not thread-safe; one per process."""

    def __init__(self, run_dir: Path, rank: int, role: str):
        self.path = timeline_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        end_torn_line(self.path, self._file)
        self._rows: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        now = time.time()
        self._rows.append(
            {"span": "session", "start": now, "end": now, "pid": os.getpid(), "role": role}
        )
        self.flush()

    def record(self, span: str, start: float, end: float, **fields: Any) -> None:
        """A span from ``start`` to ``end`` (``time.time()`` values)."""
        last = self._rows[-1] if self._rows else None
        if (
            not fields
            and last is not None
            and last["span"] == span
            and len(last) == 3
            and 0 <= start - last["end"] < MERGE_GAP_S
        ):
            last["end"] = end
        else:
            self._rows.append({"span": span, "start": start, "end": end, **fields})
        # A checkpoint is on disk at once: a resume's idle ratios count from it.
        if span == "checkpoint" or time.monotonic() - self._last_flush >= FLUSH_EVERY_S:
            self.flush()

    @contextmanager
    def span(self, span: str, **fields: Any) -> Iterator[None]:
        """Record the ``with`` block as a span; on an exception also flush (the rank is dying)."""
        start = time.time()
        try:
            yield
        except BaseException:
            self.record(span, start, time.time(), **fields, error=True)
            self.flush()
            raise
        self.record(span, start, time.time(), **fields)

    def flush(self) -> None:
        # Keep the last row in memory when it may still grow by merging; it is written
        # when the next span arrives or at close.
        keep = self._rows[-1:] if self._rows and len(self._rows[-1]) == 3 else []
        rows = self._rows[: len(self._rows) - len(keep)]
        if rows:
            self._file.write("".join(_line(row) for row in rows))
            self._file.flush()
        self._rows = keep
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.write("".join(_line(row) for row in self._rows))
        self._rows = []
        self._file.close()


def _line(row: dict[str, Any]) -> str:
    row = {**row, "start": round(row["start"], 6), "end": round(row["end"], 6)}
    return json.dumps(row, separators=(",", ":")) + "\n"


# --- reading ------------------------------------------------------------------------------


@dataclass
class Session:
    """One process's spans on one rank (a resumed run has several sessions per rank)."""

    rank: int
    role: str
    pid: int | None
    started: float
    spans: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["span"] == kind]

    @property
    def end(self) -> float:
        return max((s["end"] for s in self.spans), default=self.started)

    def first_sync_end(self) -> float | None:
        syncs = self.of("sync")
        return syncs[0]["end"] if syncs else None


def read_rank(run_dir: Path, rank: int) -> list[Session]:
    """The sessions of one rank, oldest first; torn last lines (live or killed run) skipped."""
    path = timeline_path(run_dir, rank)
    sessions: list[Session] = []
    if not path.exists():
        return sessions
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row["span"] == "session":
            sessions.append(Session(rank, row.get("role", "?"), row.get("pid"), row["start"]))
        elif sessions:
            sessions[-1].spans.append(row)
    return sessions


def read_timeline(run_dir: Path) -> dict[int, list[Session]]:
    """Every rank's sessions, by world rank."""
    ranks = sorted(int(p.stem[4:]) for p in (run_dir / TIMELINE).glob("rank*.jsonl"))
    return {rank: read_rank(run_dir, rank) for rank in ranks}


def busy_seconds(spans: list[dict[str, Any]], kind: str, start: float, end: float) -> float:
    """Seconds of ``kind`` spans inside [start, end] (spans cut at the window's edges)."""
    total = 0.0
    for s in spans:
        if s["span"] == kind:
            total += max(0.0, min(s["end"], end) - max(s["start"], start))
    return total


def trainer_idle_ratio(sessions: list[Session], at: float | None = None) -> float | None:
    """The trainer leader's idle ratio over a run that may have been resumed, as logged:
    a resumed leader carries on the waiting and training time its checkpoint recorded.

    Each session counts from its first weight sync; a session resumed from the checkpoint
    of step ``c`` (its first step is ``c + 1``) adds to the totals as they were at that
    checkpoint (when it started), one that started over adds to nothing. Sessions that
    started after ``at`` or trained no step (logged nothing) are left out.
    """
    sessions = [s for s in sessions if at is None or s.started <= at]
    while sessions and not sessions[-1].of("train"):
        sessions = sessions[:-1]
    at_checkpoint: dict[int, tuple[float, float]] = {}  # step -> (waited s, elapsed s)
    waited = elapsed = 0.0
    for i, session in enumerate(sessions):
        start = session.first_sync_end()
        trains = session.of("train")
        if start is None or not trains:
            continue
        waited, elapsed = at_checkpoint.get(trains[0]["step"] - 1, (0.0, 0.0))
        for ckpt in session.of("checkpoint"):
            at_checkpoint[ckpt["step"]] = (
                waited + busy_seconds(session.spans, "wait", start, ckpt["start"]),
                elapsed + ckpt["start"] - start,
            )
        if i == len(sessions) - 1:
            end = session.end if at is None else at
            waited += busy_seconds(session.spans, "wait", start, end)
            elapsed += end - start
    return waited / elapsed if elapsed > 0 else None


def idle_ratio(session: Session, at: float | None = None) -> float | None:
    """Fraction of time waiting, from the session's first weight sync to ``at`` (default: its end).

    The same definition as the logged ``trainer/idle_ratio`` (leader: waiting for samples)
    and ``rollouter/idle_ratio`` (a rollout rank: waiting for credits), both counted from
    the first weight sync. None before that sync.
    """
    start = session.first_sync_end()
    end = session.end if at is None else at
    if start is None or end <= start:
        return None
    return busy_seconds(session.spans, "wait", start, end) / (end - start)
