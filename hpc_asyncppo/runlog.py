"""What a run writes into its run directory, and how to read it back.

- ``metrics.jsonl``: one JSON object per trainer step (written by the trainer leader),
  each with ``time/unix``, the wall-clock time it was written. A resumed run appends rows
  from its checkpoint's step on: readers keep the last row of each step. A validation
  adds a row of its own for its step, with only ``val/`` keys (``is_validation_row``),
  written when the rollout ranks' results are in (after later steps' rows, often).
- ``tensorboard/``: the same metrics as TensorBoard event files, when the ``tensorboard``
  package is installed (nothing is written without it).
- ``trained_samples.jsonl``: one line per response trained on (uid, step, versions,
  staleness, reward); ``dropped_samples.jsonl`` likewise with a ``reason``. Together the
  audit trail for staleness bounds and exactly-once accounting.
- ``weights/rank{i}.jsonl`` (with ``trainer.record_weight_digests``): a digest of each
  rank's weights at every sync, so tests can check every rollout rank holds the trainer's.
- ``sent/rank{i}.jsonl`` (with ``rollout.record_sent_groups``): one line per group a rollout
  rank sent: its uid prefix and the weights version it was generated under, written by
  the rollout rank itself: the record tests check the trainer's staleness against.
- ``ranks/rank{i}.json``: where each rank runs and in what state (written by the rank,
  ``launch/rundir.py:write_rank_info``); ``read_rank_info`` reads them all, for the
  heartbeat watcher and ``status``.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from hpc_asyncppo.paths import DROPPED, METRICS, RANKS, SENT, TENSORBOARD, TRAINED, WEIGHTS

if TYPE_CHECKING:  # not imported: the launcher reads metrics without torch (seconds to import)
    import torch


class JsonlWriter:
    """Appends one JSON object per line, flushed after every write (readable while running)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")
        end_torn_line(path, self._file)

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MetricsWriter:
    """metrics.jsonl; the same scalars to TensorBoard when it is installed (and
    ``tensorboard``); and the rows to each of ``sinks`` (an object with ``write(rows)``:
    the trainer's experiment trackers)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, sinks: tuple[Any, ...] = ()):
        self._jsonl = JsonlWriter(run_dir / METRICS)
        self._tensorboard_dir = run_dir / TENSORBOARD
        self._tensorboard: Any = None
        self._tensorboard_opened = not tensorboard
        self._sinks = sinks

    def write(self, rows: list[dict[str, Any]]) -> None:
        now = time.time()
        rows = [{**row, "time/unix": row.get("time/unix", now)} for row in rows]
        self._jsonl.write(rows)
        if not self._tensorboard_opened:
            # At the first row, not before the first weight sync: importing tensorboard
            # takes ~0.3 s, which in fully_async mode the rollout ranks spend generating.
            self._tensorboard = _tensorboard_writer(self._tensorboard_dir)
            self._tensorboard_opened = True
        if self._tensorboard is not None:
            for row in rows:
                for key, value in row.items():
                    if key not in ("step", "time/unix") and isinstance(value, (int, float)):
                        self._tensorboard.add_scalar(key, value, row["step"], row["time/unix"])
        for sink in self._sinks:
            sink.write(rows)

    def close(self) -> None:
        self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def is_validation_row(row: dict[str, Any]) -> bool:
    """A metrics row of a validation (``val/`` keys), not of a trainer step."""
    return "val/param_version" in row


def format_validation(row: dict[str, Any]) -> str:
    """One validation row in words: reward, pass@k, each data_source's reward, version."""
    passes = [k for k in row if k.startswith("val/pass@")]
    text = f"reward {row.get('val/reward/mean', float('nan')):.3f}"
    if passes:
        text += f"  {passes[0][4:]} {row[passes[0]]:.2f}"
    sources = [
        k[4 : -len("/reward/mean")]
        for k in row
        if k.endswith("/reward/mean") and k != "val/reward/mean"
    ]
    if sources:
        text += " (" + ", ".join(f"{s} {row[f'val/{s}/reward/mean']:.3f}" for s in sources) + ")"
    return text + f"  at step {row['step']} (v{row['val/param_version']})"


def split_metrics(rows: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """(trainer step rows, validation rows), each the last row of each step, in step order."""
    steps: dict[int, dict] = {}
    vals: dict[int, dict] = {}
    for row in rows:
        (vals if is_validation_row(row) else steps)[row["step"]] = row
    return [steps[s] for s in sorted(steps)], [vals[s] for s in sorted(vals)]


def _tensorboard_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    # Flushed every few seconds so a live or killed run's curves are there to look at.
    return SummaryWriter(str(log_dir), flush_secs=5)


def end_torn_line(path: Path, file: TextIO) -> None:
    """A killed run may have left half a line: end it, so that a resumed run's first row
    is not glued to it (readers skip the torn line alone)."""
    with path.open("rb") as f:
        if f.seek(0, 2) == 0:  # empty
            return
        f.seek(-1, 2)
        torn = f.read(1) != b"\n"
    if torn:
        file.write("\n")


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


class WeightDigest:
    """A digest of a set of named tensors that does not depend on the order they come in:
    each tensor is hashed as it is seen (so a stream needs no copy), then the names and
    their hashes are hashed in name order."""

    def __init__(self) -> None:
        self.parts: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        import torch

        raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self.parts[name] = hashlib.sha256(raw.tobytes()).hexdigest()

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.parts):
            h.update(f"{name}:{self.parts[name]};".encode())
        return h.hexdigest()


def weights_digest(named: list[tuple[str, torch.Tensor]]) -> str:
    digest = WeightDigest()
    for name, tensor in named:
        digest.add(name, tensor)
    return digest.hexdigest()


def record_weight_digest(run_dir: Path, rank: int, version: int, digest: str) -> None:
    writer = JsonlWriter(run_dir / WEIGHTS / f"rank{rank}.jsonl")
    writer.write([{"version": version, "digest": digest}])
    writer.close()


def sent_groups_writer(run_dir: Path, rank: int) -> JsonlWriter:
    return JsonlWriter(run_dir / SENT / f"rank{rank}.jsonl")


def read_rank_info(run_dir: Path) -> list[dict]:
    """Every rank's ``ranks/rank{i}.json`` record, in file-name order."""
    return [json.loads(p.read_text()) for p in sorted((run_dir / RANKS).glob("rank*.json"))]


def truncate_to_step(run_dir: Path, step: int) -> None:
    """Keep only the rows of steps <= ``step`` in the metrics and sample logs (a resume from
    the checkpoint of ``step`` trains the later steps again and logs them anew)."""
    for name in (METRICS, TRAINED, DROPPED):
        path = run_dir / name
        if not path.exists():
            continue
        kept = [row for row in read_jsonl(path) if row["step"] <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        tmp.replace(path)
