"""Print what a checkpoint holds and verify its checksums.

    python -m hpc_asyncppo.checkpoint.inspect RUN_DIR/checkpoints/ckpt_00000010.h5
    python -m hpc_asyncppo.checkpoint.inspect RUN_DIR      # every checkpoint, one line each

Exit status 0 when every checkpoint shown is valid, 1 otherwise (one line per error).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from hpc_asyncppo.checkpoint.store import (
    CHECKPOINT_DIR,
    CheckpointError,
    CheckpointSummary,
    describe_checkpoint,
    list_checkpoints,
)
from hpc_asyncppo.transport.arrays import WireError, unpack_arrays

_HEADLINE = ("step", "param_version")


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def count_responses(items: list[np.ndarray]) -> int | None:
    """Responses in a list of encoded sample groups; None if they are not sample groups."""
    try:
        return sum(int(unpack_arrays(buf)[0]["rewards"].shape[0]) for buf in items)
    except (WireError, KeyError, ValueError):
        return None


def describe_buffers(summary: CheckpointSummary) -> list[str]:
    lines = []
    for where, items in summary.buffers.items():
        responses = count_responses(items)
        extra = f", {responses} responses" if responses is not None else ""
        size = human_bytes(sum(b.nbytes for b in items))
        lines.append(f"{where}: {len(items)} items ({size}){extra}")
    return lines


def report(summary: CheckpointSummary) -> str:
    meta = summary.meta
    counters = {k: v for k, v in meta.items() if k not in _HEADLINE}
    rows = [
        ("format version", summary.format_version),
        ("step", meta.get("step", "-")),
        ("param version", meta.get("param_version", "-")),
        ("counters", ", ".join(f"{k}={v}" for k, v in counters.items()) or "-"),
        ("sample buffers", "; ".join(describe_buffers(summary)) or "none"),
        ("tensors", f"{summary.tensor_count} ({human_bytes(summary.tensor_bytes)})"),
        ("file size", human_bytes(summary.file_bytes)),
        ("checksums", "ok"),
    ]
    return "\n".join([str(summary.path)] + [f"  {k:<15} {v}" for k, v in rows])


def one_line(summary: CheckpointSummary) -> str:
    queued = sum(len(items) for items in summary.buffers.values())
    return (
        f"{summary.path.name}  ok  step {summary.meta.get('step', '-')}  "
        f"param_version {summary.meta.get('param_version', '-')}  queued {queued}  "
        f"tensors {summary.tensor_count} ({human_bytes(summary.tensor_bytes)})  "
        f"file {human_bytes(summary.file_bytes)}"
    )


def inspect_run_dir(run_dir: Path) -> int:
    paths = list_checkpoints(run_dir)
    if not paths:
        print(f"{run_dir}: no checkpoints under {run_dir / CHECKPOINT_DIR}", file=sys.stderr)
        return 1
    status = 0
    for path in paths:
        try:
            print(one_line(describe_checkpoint(path)))
        except CheckpointError as exc:
            print(f"{path.name}  BAD  {exc}")
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpc_asyncppo.checkpoint.inspect", description=__doc__.splitlines()[0]
    )
    parser.add_argument("path", type=Path, help="a checkpoint file, or a run directory")
    args = parser.parse_args(argv)
    if args.path.is_dir():
        run_dir = args.path.parent if args.path.name == CHECKPOINT_DIR else args.path
        return inspect_run_dir(run_dir)
    try:
        print(report(describe_checkpoint(args.path)))
    except CheckpointError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
