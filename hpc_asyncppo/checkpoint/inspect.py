"""Print what a checkpoint holds and verify every byte of it.

    python -m hpc_asyncppo.checkpoint.inspect RUN_DIR      # every checkpoint, one line each
    python -m hpc_asyncppo.checkpoint.inspect RUN_DIR/checkpoints/step_00000010   # its parts
    python -m hpc_asyncppo.checkpoint.inspect RUN_DIR/checkpoints/step_00000010/trainer0.h5

Exit status 0 when every checkpoint shown is valid, 1 otherwise (one line per error).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.checkpoint.store import CheckpointError, CheckpointSummary, describe_checkpoint
from hpc_asyncppo.paths import CHECKPOINTS
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


def describe_folder(folder: Path) -> tuple[dict, list[CheckpointSummary]]:
    """Verify every part of a checkpoint folder against its manifest and summarise each."""
    manifest = protocol.verify_all(folder)
    return manifest, [describe_checkpoint(folder / name) for name in manifest["parts"]]


def one_line(folder: Path, manifest: dict, parts: list[CheckpointSummary]) -> str:
    queued = sum(len(items) for p in parts for items in p.buffers.values())
    tensors = sum(p.tensor_count for p in parts)
    size = sum(p.file_bytes for p in parts)
    return (
        f"{folder.name}  ok  step {manifest.get('step', '-')}  "
        f"param_version {manifest.get('param_version', '-')}  parts {len(parts)}  "
        f"queued {queued}  tensors {tensors} ({human_bytes(sum(p.tensor_bytes for p in parts))})  "
        f"files {human_bytes(size)}"
    )


def folder_report(folder: Path, manifest: dict, parts: list[CheckpointSummary]) -> str:
    """The manifest's counters, every state object the checkpoint collected with the files
    that hold it (checkpoints written before ``states`` existed: none listed), and each
    part's contents."""
    hidden = (*_HEADLINE, "parts", "format", "states")
    counters = {k: v for k, v in manifest.items() if k not in hidden}
    rows = [
        ("step", manifest.get("step", "-")),
        ("param version", manifest.get("param_version", "-")),
        ("counters", ", ".join(f"{k}={v}" for k, v in counters.items()) or "-"),
    ]
    rows += [
        (f"state {name}", ", ".join(where)) for name, where in manifest.get("states", {}).items()
    ]
    for part in parts:
        rows.append(
            (
                part.path.name,
                f"{part.tensor_count} tensors ({human_bytes(part.tensor_bytes)}), "
                f"{'; '.join(describe_buffers(part)) or 'no sample buffers'}, "
                f"file {human_bytes(part.file_bytes)}, checksums ok",
            )
        )
    return "\n".join([str(folder)] + [f"  {k:<15} {v}" for k, v in rows])


def inspect_run_dir(run_dir: Path) -> int:
    folders = protocol.list_checkpoints(run_dir)
    if not folders:
        print(f"{run_dir}: no checkpoints under {run_dir / CHECKPOINTS}", file=sys.stderr)
        return 1
    status = 0
    for folder in folders:
        try:
            print(one_line(folder, *describe_folder(folder)))
        except CheckpointError as exc:
            print(f"{folder.name}  BAD  {exc}")
            status = 1
    return status


def main(
    argv: list[str] | None = None, prog: str = "python -m hpc_asyncppo.checkpoint.inspect"
) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "path", type=Path, help="a run directory, a checkpoint folder, or one part file"
    )
    args = parser.parse_args(argv)
    if args.path.is_dir() and not (args.path / protocol.MANIFEST).exists():
        run_dir = args.path.parent if args.path.name == CHECKPOINTS else args.path
        return inspect_run_dir(run_dir)
    try:
        if args.path.is_dir():
            print(folder_report(args.path, *describe_folder(args.path)))
        else:
            print(report(describe_checkpoint(args.path)))
    except CheckpointError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
