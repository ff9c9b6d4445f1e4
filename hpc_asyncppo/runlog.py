"""What a run writes into its run directory, and how to read it back.

- ``metrics.jsonl``: one JSON object per trainer step (written by the trainer leader).
- ``trained_samples.jsonl``: one line per response trained on (uid, step, versions,
  staleness, reward); ``dropped_samples.jsonl`` likewise with a ``reason``. Together the
  audit trail for staleness bounds and exactly-once accounting.
- ``weights/rank{i}.jsonl`` (with ``trainer.record_weight_digests``): a digest of each
  rank's weights at every sync, so tests can check every rollout rank holds the trainer's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

METRICS = "metrics.jsonl"
TRAINED = "trained_samples.jsonl"
DROPPED = "dropped_samples.jsonl"


class JsonlWriter:
    """Appends one JSON object per line, flushed after every write (readable while running)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a JSONL file (a torn last line of a live or killed run is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def weights_digest(named: list[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def record_weight_digest(
    run_dir: Path, rank: int, version: int, named: list[tuple[str, torch.Tensor]]
) -> None:
    writer = JsonlWriter(run_dir / "weights" / f"rank{rank}.jsonl")
    writer.write([{"version": version, "digest": weights_digest(named)}])
    writer.close()
