"""Follow a run from its metrics.jsonl and show progress to the user who launched it.

On a terminal: one line rewritten in place. Otherwise (batch logs, pipes): a plain line
every tenth of the run, so logs stay readable.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hpc_asyncppo.runlog import METRICS


def describe(row: dict, total_steps: int) -> str:
    return (
        f"step {row['step']}/{total_steps}  v{row['param_version']}  "
        f"reward {row['reward/mean']:.3f}  staleness {row['staleness/mean']:.2f} (max {row['staleness/max']})  "
        f"{row['throughput/samples_per_s']:.1f} samples/s  queue {row.get('queue/groups', 0)}  "
        f"idle trainer {row['trainer/idle_ratio']:.0%} rollout {row['rollouter/idle_ratio']:.0%}"
    )


def follow(
    run_dir: Path, is_running: Callable[[], bool], total_steps: int, poll_s: float = 1.0
) -> dict | None:
    """Print progress until ``is_running()`` is false; returns the last metrics row seen."""
    path = run_dir / METRICS
    tty = sys.stdout.isatty()
    offset, last, printed_step = 0, None, 0
    every = max(1, total_steps // 10)
    while True:
        running = is_running()
        if path.exists():
            with path.open() as f:
                f.seek(offset)
                for line in f:
                    if not line.endswith("\n"):
                        break  # a line still being written
                    offset += len(line.encode())
                    last = json.loads(line)
                    if not tty and (
                        last["step"] - printed_step >= every or last["step"] == total_steps
                    ):
                        print(describe(last, total_steps), flush=True)
                        printed_step = last["step"]
            if tty and last is not None:
                print("\r" + describe(last, total_steps) + "\033[K", end="", flush=True)
        if not running:
            break
        time.sleep(poll_s)
    if tty and last is not None:
        print()
    return last
