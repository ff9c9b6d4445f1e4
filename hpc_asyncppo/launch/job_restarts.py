"""Which failed attempts the launcher starts again, and when it stops trying.

A job that fails for a reason the next attempt may not meet (a rank killed by the OOM
killer or a node, a crash in a library, a named hang) is started again from its newest
checkpoint, as a resume would be: every rank finds that checkpoint itself, and the
exactly-once audit holds across the attempts as it does across preemptions. Not retried:

- the input: a failure whose error is the config's, the data's, the GPU layout's, a
  checkpoint's (of another model, unreadable), user code that does not import, or an
  agent that fails every session (``AgentError``), a run stopped on a collapse sign
  (``CollapseError``, ``trainer.stop_on_collapse``). The same input fails the same way;
  the user must change it.
- a full disk or quota: it does not free itself in a back-off, and a retry would only
  lose the checkpoint the next stop writes.
- a crash loop: the same failure as the attempt before (a failed rank's line in common),
  with no checkpoint written in between (so the attempt redid the same steps and met the same end: a bug that a given
  batch triggers, a reward function that fails on some input), named, instead of
  spending every restart on it. Failures with progress saved between them are retried:
  a node lost twice in a day is not a loop.
- more than ``trainer.max_restarts`` restarts in one launcher (a ``submit`` locally, a
  Slurm job under Slurm).

Locally ``submit`` runs the attempts one after another (``launch/local.py``) and keeps the
failure of the attempt before in memory. Under Slurm each attempt is a new run of the batch
script: its step wrapper (``launch/slurm/step.py``) reads the attempts before from
goodput.jsonl (``slurm_decision``) and, to restart, leaves ``RUN_DIR/restart`` for the
script, which requeues the job as it does after a preemption.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from hpc_asyncppo.paths import ERRORS, METRICS
from hpc_asyncppo.runlog import read_jsonl

# Exception types, as a failed rank records them, that say the input is wrong
INPUT_ERRORS = frozenset({
    "ConfigError", "DatasetError", "GpuLayoutError", "CheckpointError", "ImportError",
    "ModuleNotFoundError", "SyntaxError", "AgentError", "CollapseError",
})  # fmt: skip
DISK_FULL = ("No space left on device", "Disk quota exceeded")

# "rank 1 (rollout, host): ConfigError: ..." (rank.py); "... died: killed by signal 9 (...)"
_RECORDED_ERROR = re.compile(r"^rank \d+ \([^)]*\): ([\w.]+): ")
_PID = re.compile(r", pid \d+")
_WRITE_FAILED = re.compile(r"CheckpointError: writing \S+ failed")  # checkpoint/store.py
_ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+(:\d+)?|\]:\d+")


@dataclass(frozen=True)
class Failure:
    """A failed attempt: one line per failed rank (``local.explain_failure``), the last
    step the run logged and the step of its newest committed checkpoint (0: none)."""

    lines: tuple[str, ...]
    step: int
    checkpoint: int

    @classmethod
    def of(cls, run_dir: Path, lines: list[str]) -> Failure:
        from hpc_asyncppo.checkpoint.protocol import checkpoint_step, list_checkpoints

        rows = read_jsonl(run_dir / METRICS)
        newest = list_checkpoints(run_dir)[:1]
        checkpoint = checkpoint_step(newest[0]) if newest else 0
        return cls(tuple(lines), int(rows[-1]["step"]) if rows else 0, checkpoint)

    @classmethod
    def from_row(cls, row: dict) -> Failure | None:
        """The failure a goodput.jsonl row recorded (``record``), or None."""
        if not row.get("failure"):
            return None
        return cls(
            tuple(row["failure"]), int(row.get("end_step") or 0), int(row["failure_checkpoint"])
        )

    def record(self, restarted: bool) -> dict:
        """Its fields for the attempt's goodput.jsonl row (``goodput.close``)."""
        return {
            "failure": list(self.lines),
            "failure_checkpoint": self.checkpoint,
            "restarted": restarted,
        }

    def signature(self) -> frozenset[str]:
        """The lines without what differs between two attempts failing the same way (pids,
        addresses)."""
        return frozenset(_ADDRESS.sub("ADDRESS", _PID.sub("", line)) for line in self.lines)

    def final_cause(self) -> str | None:
        """Why no attempt can go differently, or None."""
        if any(words in line for line in self.lines for words in DISK_FULL):
            return "the disk is full"
        for line in self.lines:
            match = _RECORDED_ERROR.match(line)
            if (
                match
                and match.group(1).rsplit(".", 1)[-1] in INPUT_ERRORS
                and not _WRITE_FAILED.search(line)  # the filesystem's, not the input's
            ):
                return f"the input is wrong ({match.group(1)})"
        return None


def why_not_restart(
    failure: Failure, previous: Failure | None, restarts_done: int, max_restarts: int
) -> str | None:
    """None to restart; else why not, for the error line."""
    cause = failure.final_cause()
    if cause is not None:
        return cause
    # The same failure: a line in common. The other ranks' lines vary with timing (a peer's
    # lost connection is recorded or not before mpirun ends the job), the cause does not.
    if (
        previous is not None
        and failure.checkpoint == previous.checkpoint
        and failure.signature() & previous.signature()
    ):
        newest = f"the newest is of step {failure.checkpoint}" if failure.checkpoint else "none yet"
        return (
            "a crash loop: the attempt before failed the same way, and no checkpoint was "
            f"written in between ({newest})"
        )
    if restarts_done >= max_restarts:
        return f"trainer.max_restarts={max_restarts} restarts made"
    return None


def slurm_decision(
    failure: Failure, rows: list[dict], start: float, job_id: str | None, max_restarts: int
) -> str | None:
    """``why_not_restart`` for the attempt of Slurm job ``job_id`` that started at ``start``,
    from goodput.jsonl's ``rows``: the restarts this job made, the attempt before's failure."""
    earlier = [row for row in rows if row["start"] < start - 1e-3]
    done = sum(1 for row in earlier if row.get("slurm_job_id") == job_id and row.get("restarted"))
    previous = Failure.from_row(earlier[-1]) if earlier and earlier[-1].get("restarted") else None
    return why_not_restart(failure, previous, done, max_restarts)


def backoff_s(base_s: float, restarts_done: int) -> float:
    """Seconds to wait before the next restart: ``base_s``, doubled each time, at most 10 min."""
    return min(600.0, base_s * 2**restarts_done)


def archive_errors(run_dir: Path, attempt: int) -> None:
    """Move a failed attempt's error records to ``errors/attempt{N}/``: the next attempt's
    failure, if any, is then told by its own ranks' records alone; these stay for a look."""
    errors = run_dir / ERRORS
    files = list(errors.glob("rank*.txt"))
    if not files:
        return
    into = errors / f"attempt{attempt}"
    into.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.move(path, into / path.name)
