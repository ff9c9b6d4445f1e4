"""Follow a run from its metrics.jsonl and show progress to the user who launched it.

On a terminal: a progress bar over the steps with reward, throughput, staleness, queue
depth and who waits. Otherwise (batch logs, pipes): a plain line every tenth of the run,
so logs stay readable. A resumed run's earlier rows set the starting point silently.
Validation rows (``val/`` keys, logged when the rollout ranks' results are in) get a line of
their own in the plain display, and the latest one sits beside the bar on a terminal. A
collapse sign the trainer named at a step (``trainer/collapse.py``) gets a line of its own
in both.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from hpc_asyncppo.paths import METRICS
from hpc_asyncppo.runlog import format_validation, is_validation_row


def describe(row: dict, total_steps: int) -> str:
    """One plain line: where the run is and how it is doing."""
    return f"step {row['step']}/{total_steps}  v{row['param_version']}  " + postfix(row)


def postfix(row: dict) -> str:
    """The metrics part of a progress line (beside the bar on a terminal)."""
    return (
        f"reward {row['reward/mean']:.3f}  staleness {row['staleness/mean']:.2f} (max {row['staleness/max']})  "
        f"{row['throughput/samples_per_s']:.1f} samples/s  queue {row.get('queue/groups', 0)}  "
        f"idle trainer {row['trainer/idle_ratio']:.0%} rollout {row['rollouter/idle_ratio']:.0%}"
    )


class MetricsTail:
    """The complete rows appended to metrics.jsonl since the last read.

    A resume rewrites the file without the steps after its checkpoint (``runlog.
    truncate_to_step``: a new file): the tail then reads it again from the start, skipping
    the steps up to ``skip_through`` (the checkpoint's step when the caller knows it,
    else the last step it returned), and goes on with the steps trained anew."""

    def __init__(self, path: Path, skip_through: int | None = None):
        self.path, self.offset, self.skip_through = path, 0, skip_through
        self.file_id: tuple[int, int] | None = None
        self.last_step = 0

    def new_rows(self) -> list[dict]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return []
        skip = -1
        file_id = (stat.st_dev, stat.st_ino)
        if self.file_id is not None and (file_id != self.file_id or stat.st_size < self.offset):
            self.offset = 0  # rewritten by a resume
            skip = self.last_step if self.skip_through is None else self.skip_through
        self.file_id = file_id
        rows = []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a line still being written
                self.offset += len(line)
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("step", 0) > skip:
                    rows.append(row)
        for row in rows:
            if not is_validation_row(row):
                self.last_step = row["step"]
        return rows


class PlainLines:
    """A line every tenth of the run and at the last step."""

    def __init__(self, total_steps: int, stream: TextIO):
        self.total, self.stream = total_steps, stream
        self.every = max(1, total_steps // 10)
        self.printed_step = 0

    def start(self, last: dict | None) -> None:
        if last is not None:
            self.printed_step = last["step"]
            print(f"resuming at step {last['step']}/{self.total}", file=self.stream, flush=True)

    def update(self, row: dict) -> None:
        if abs(row["step"] - self.printed_step) >= self.every or row["step"] == self.total:
            print(describe(row, self.total), file=self.stream, flush=True)
            self.printed_step = row["step"]

    def validation(self, row: dict) -> None:
        print(f"validation {format_validation(row)}", file=self.stream, flush=True)

    def warn(self, line: str) -> None:
        print(f"warning: {line}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class Silent:
    """Nothing shown (``console`` not in trainer.logger): the run's files say it all."""

    def start(self, last: dict | None) -> None:
        pass

    def update(self, row: dict) -> None:
        pass

    def validation(self, row: dict) -> None:
        pass

    def warn(self, line: str) -> None:
        pass

    def close(self) -> None:
        pass


class Bar:
    """A tqdm bar over the steps, the latest metrics beside it."""

    def __init__(self, total_steps: int, stream: TextIO):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total_steps, unit="step", file=stream, dynamic_ncols=True, smoothing=0.1
        )
        self.bar.set_postfix_str("waiting for the first step (ranks starting)")
        self.val = ""

    def start(self, last: dict | None) -> None:
        if last is not None:
            self.bar.n = self.bar.initial = last["step"]
            self.update(last)

    def update(self, row: dict) -> None:
        self.bar.n = row["step"]
        self.bar.set_postfix_str(
            f"v{row['param_version']}  " + postfix(row) + self.val, refresh=False
        )
        self.bar.refresh()

    def validation(self, row: dict) -> None:
        self.val = "  val " + format_validation(row).split("  at step")[0]

    def warn(self, line: str) -> None:
        self.bar.write(f"warning: {line}")

    def close(self) -> None:
        self.bar.close()


def follow(
    run_dir: Path,
    is_running: Callable[[], bool],
    total_steps: int,
    poll_s: float = 1.0,
    stream: TextIO | None = None,
    resume_step: int | None = None,
    console: bool = True,
) -> dict | None:
    """Show progress until ``is_running()`` is false; returns the last metrics row seen.
    ``resume_step``: the step of the checkpoint the run resumes from, if known (the
    rows after it, of an attempt that failed, are not where the run resumes).
    ``console``: false, nothing is shown (trainer.logger without ``console``)."""
    stream = sys.stdout if stream is None else stream
    tail = MetricsTail(run_dir / METRICS, resume_step)
    history = [  # a resumed run's
        r
        for r in tail.new_rows()
        if not is_validation_row(r) and (resume_step is None or r["step"] <= resume_step)
    ]
    last = history[-1] if history else None
    display = Bar(total_steps, stream) if stream.isatty() else PlainLines(total_steps, stream)
    if not console:
        display = Silent()
    display.start(last)
    try:
        while True:
            running = is_running()
            for row in tail.new_rows():
                if is_validation_row(row):
                    display.validation(row)
                    continue
                display.update(row)
                if "collapse/line" in row:
                    display.warn(row["collapse/line"])
                last = row
            if not running:
                break
            time.sleep(poll_s)
    finally:
        display.close()
    return last
