"""The checkpoint protocol: every rank writes its own part in parallel, the trainer leader
commits the set with a manifest, and on resume every rank verifies and reads only its part.

A checkpoint of step N is the folder ``RUN_DIR/checkpoints/step_<N>/``::

    trainer<k>.h5   trainer rank k's shards: its rows of every parameter and optimizer
                    state tensor (``layout``, JSON: each tensor's first row and whole
                    shape), the optimizer's hyperparameters, the LR schedule, its RNGs
    rollout<r>.h5   rollout rank r's RNGs and the groups it was generating, cut: their
                    tokens, log-probs and per-token versions so far (continued on resume
                    by rollout rank ``continuing_rank(r, R)``)
    leader.h5       the trainer leader's intake (``trainer/intake.py``): its sample queue
                    (every group received and not yet trained), the data order
                    (``tasks/order.py``) and how many cut groups each rollout rank kept
    manifest.json   the counters (``trainer/progress.py``), the groups trained
                    (``trainer/credits.py``), rank counts, which state object each file
                    holds (``states_held``), and every part with its size and checksum

Each part is an HDF5 file of ``checkpoint.store`` (written under a temporary name, fsynced,
renamed; a CRC-32 per dataset; no pickle). A part's checksum is the CRC-32 of its datasets'
CRC-32s, so verifying a part re-reads it once. The checkpoint exists only once the manifest
naming every part is durably in place: the leader writes it last (temporary name, fsync,
rename, fsync of the folder), after every rank reported its part written. A crash at any
moment leaves either the previous complete checkpoint or the new complete one; a folder
without a manifest is the litter of a checkpoint that never happened and is removed.

Saving, in order (the roles call these at one point of their loop each):
1. the leader tells the rollout ranks (CHECKPOINT, with the step) and the trainer followers;
2. each rollout rank cuts its groups in flight, writes ``rollout<r>.h5`` and reports
   (part, size, checksum, groups sent); the leader drains every group sent before it;
3. every trainer rank writes ``trainer<k>.h5``; the followers report their part;
4. the leader writes ``leader.h5`` (the queue, now complete) and the manifest.

Resuming: a job always resumes when its run directory holds a valid checkpoint; that is
how a requeued Slurm job (same batch script) and ``submit --resume RUN_DIR`` both continue.
``find_resume_checkpoint`` (collective over every rank): the leader proposes the newest
checkpoint with a manifest; every rank checks that the parts it needs (``parts_needed``)
exist with their sizes and verifies their checksums, in parallel; if any part is missing or
corrupt, each such part is named in one line and the next older checkpoint is tried. Each
role then reads its own part. Any number of rollout and trainer ranks may resume a
checkpoint: a trainer rank reads the rows of the old trainer parts that overlap its own
(``overlapping_parts``; with as many trainer ranks as before, exactly its own part), the
leader the intake (the data order is the leader's), a rollout rank its own part and the
cut groups of the old ranks it continues (``continued_parts``).

How state is collected: every object a checkpoint holds exposes ``state_dict()`` and
``load_state_dict`` (``state.py``), and each role hands this module its objects by name
(``{name: state}``); this module imports none of their classes. A file's tree is the union
of its states' trees (``tree_of``: each state's top-level keys at the file's root, which
keeps the layout above), ``states_held`` names the states each file holds, and on resume
each state loads its own keys from the file it was written to (``load_part``,
``load_states``; a part is read key by key, never whole). The trainer leader writes ``progress`` and ``credits``
into the manifest and ``intake`` into ``leader.h5``; a trainer rank writes ``policy``
(sharded: read back row by row through ``ShardedReader``, ``restore_trainer_part``) and
``rng``; a rollout rank writes ``rng`` and ``cut_groups``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from hpc_asyncppo.checkpoint.state import ShardedStateful, Stateful
from hpc_asyncppo.checkpoint.store import (
    CheckpointError,
    CheckpointReader,
    fsync_dir,
    fsync_file,
    save_checkpoint,
    verify_checkpoint,
)
from hpc_asyncppo.paths import CHECKPOINTS
from hpc_asyncppo.runtime import faults
from hpc_asyncppo.runtime.topology import ROLLOUT, Topology

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "hpc_asyncppo.checkpoint"
MANIFEST_FORMAT_VERSION = 2
LEADER_PART = "leader.h5"
SHARDED = "policy"  # the state split over the trainer ranks, read back row by row
_STEP_DIR = re.compile(r"step_(\d{8,})")
_LEGACY = re.compile(r"ckpt_(\d{8,})\.h5")


def trainer_part(rank: int) -> str:
    return f"trainer{rank}.h5"


def rollout_part(rank: int) -> str:
    return f"rollout{rank}.h5"


def states_held(train_ranks: int, rollout_ranks: int) -> dict[str, list[str]]:
    """Which state object each file of a checkpoint holds, by name (the manifest's
    ``states``, shown by ``inspect``): the counters (``trainer/progress.py``) and the
    groups trained (``trainer/credits.py``) in the manifest, the intake
    (``trainer/intake.py``: queue, data order, cut groups per rank) in the leader part,
    each trainer rank's shards of the policy and its RNGs in its part, each rollout rank's
    RNGs and cut groups (``rollout/cut_groups.py``) in its part."""
    trainers = [trainer_part(k) for k in range(train_ranks)]
    rollouts = [rollout_part(r) for r in range(rollout_ranks)]
    return {
        "progress": [MANIFEST],
        "credits": [MANIFEST],
        "intake": [LEADER_PART],
        "policy": trainers,
        "rng": trainers + rollouts,
        "cut_groups": rollouts,
    }


def step_dir(run_dir: str | Path, step: int) -> Path:
    """RUN_DIR/checkpoints/step_{step:08d}"""
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


# --- writing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartInfo:
    """What the manifest records of one part, and what a rank reports after writing it."""

    name: str
    bytes: int
    checksum: int

    def to_json(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "checksum": self.checksum}

    @classmethod
    def from_json(cls, d: dict) -> PartInfo:
        return cls(str(d["name"]), int(d["bytes"]), int(d["checksum"]))


def write_part(folder: Path, name: str, tree: dict) -> PartInfo:
    """Write one rank's part of a checkpoint (atomically, fsynced); returns its record."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    checksum = save_checkpoint(path, tree, {"part": name})
    faults.at("part_written", checkpoint_step(folder))  # a drill's moment: before the commit
    return PartInfo(name, path.stat().st_size, checksum)


def write_own_part(folder: Path, name: str, tree: dict) -> dict:
    """A rank other than the leader writes its part: the report it sends the leader (JSON),
    with the part's record, or the error in one line if it could not be written (a full
    disk), so that the leader decides, not this rank's death."""
    try:
        return {"part": write_part(folder, name, tree).to_json(), "error": None}
    except (OSError, CheckpointError) as exc:
        (folder / name).unlink(missing_ok=True)
        return {"part": None, "error": " ".join(str(exc).split())}


def part_of_report(report: dict, who: str) -> PartInfo:
    """The part record of a rank's report; CheckpointError naming the rank if it failed."""
    if report.get("part") is None:
        raise CheckpointError(f"{who} could not write its checkpoint part: {report.get('error')}")
    return PartInfo.from_json(report["part"])


def commit(folder: Path, parts: list[PartInfo], meta: dict) -> None:
    """Write the manifest last: from this moment the checkpoint exists."""
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise CheckpointError(f"checkpoint {folder}: two parts named alike in {names}")
    manifest = {
        "format": FORMAT,
        "format_version": MANIFEST_FORMAT_VERSION,
        **meta,
        "parts": {p.name: {"bytes": p.bytes, "checksum": p.checksum} for p in parts},
    }
    tmp = folder / f".{MANIFEST}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        fsync_file(tmp)
        os.replace(tmp, folder / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(folder)


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest committed checkpoints, folders that never got a
    manifest (killed saves) and single-file checkpoints of the old format older than the
    kept ones. Only the leader calls it, after a commit."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    committed = list_checkpoints(run_dir)
    removed = committed[keep:]
    root = Path(run_dir) / CHECKPOINTS
    for path in sorted(root.glob("step_*")) if root.is_dir() else []:
        if path.is_dir() and not (path / MANIFEST).exists():
            removed.append(path)
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return removed


# --- finding and checking ------------------------------------------------------------------


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint ``list_checkpoints`` found."""
    m = _STEP_DIR.fullmatch(path.name) or _LEGACY.fullmatch(path.name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint of this project")
    return int(m.group(1))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Committed checkpoints (step folders with a manifest, and single files of the old
    format), newest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if (m := _STEP_DIR.fullmatch(path.name)) and (path / MANIFEST).is_file():
            found.append((int(m.group(1)), 1, path))
        elif m := _LEGACY.fullmatch(path.name):
            found.append((int(m.group(1)), 0, path))
    return [p for _, _, p in sorted(found, reverse=True)]


def read_manifest(folder: Path) -> dict:
    """The manifest of a checkpoint folder; CheckpointError (one line) if it is not one
    this code reads (a single file of the old format says what to do)."""
    if _LEGACY.fullmatch(folder.name):
        raise CheckpointError(
            f"checkpoint {folder} is a single file of an earlier format: resume it with the "
            "hpc_asyncppo version that wrote it, or move it away to start over"
        )
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder}: unreadable {MANIFEST}: {exc}") from None
    if (
        manifest.get("format") != FORMAT
        or manifest.get("format_version") != MANIFEST_FORMAT_VERSION
    ):
        raise CheckpointError(
            f"checkpoint {folder}: {MANIFEST} is not of {FORMAT} v{MANIFEST_FORMAT_VERSION}"
        )
    return manifest


def check_parts(folder: Path, manifest: dict, names: list[str], verify: bool) -> None:
    """Each named part is listed, present, of its recorded size, and (``verify``) matches
    its checksum. CheckpointError naming the first part that does not."""
    parts = manifest["parts"]
    for name in names:
        if name not in parts:
            raise CheckpointError(f"checkpoint {folder}: the manifest lists no part {name}")
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder}: part {name} is missing")
        size = path.stat().st_size
        if size != parts[name]["bytes"]:
            raise CheckpointError(
                f"checkpoint {folder}: part {name} has {size} bytes, the manifest says "
                f"{parts[name]['bytes']}"
            )
        if verify and verify_checkpoint(path) != parts[name]["checksum"]:
            raise CheckpointError(f"checkpoint {folder}: part {name} does not match its checksum")


def check_manifest(folder: Path) -> dict:
    """Every part present with its size (no data read): what ``submit --resume`` checks."""
    manifest = read_manifest(folder)
    check_parts(folder, manifest, list(manifest["parts"]), verify=False)
    return manifest


def verify_all(folder: Path) -> dict:
    """Every part present, of its size, and matching its checksum (reads everything)."""
    manifest = read_manifest(folder)
    check_parts(folder, manifest, list(manifest["parts"]), verify=True)
    return manifest


def overlapping_parts(rank: int, ranks: int, old_ranks: int) -> list[int]:
    """Old trainer parts whose rows may overlap rank's rows of any tensor (FSDP's chunking:
    ceil(rows / T) per rank), for ``ranks`` trainer ranks now and ``old_ranks`` before."""
    if ranks == old_ranks:
        return [rank]
    low = max(0, (rank * old_ranks) // ranks - 1)
    high = min(old_ranks - 1, -(-((rank + 1) * old_ranks) // ranks))
    return list(range(low, high + 1))


def continuing_rank(old: int, ranks: int) -> int:
    """The rollout rank, of ``ranks`` now, that continues old rollout rank ``old``'s cut
    groups: ``old mod ranks``, so that with fewer ranks than before none is orphaned."""
    return old % ranks


def continued_parts(rank: int, ranks: int, old_ranks: int) -> list[int]:
    """The old rollout parts rollout rank ``rank`` (of ``ranks``) continues."""
    return [old for old in range(old_ranks) if continuing_rank(old, ranks) == rank]


# --- choosing what to resume from (collective) ---------------------------------------------

_TEXT = 4096


def _bcast_text(comm: MPI.Intracomm, text: str, root: int) -> str:
    buf = np.zeros(_TEXT, dtype=np.uint8)
    if comm.Get_rank() == root:
        raw = text.encode()[:_TEXT]
        buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    comm.Bcast([buf, MPI.BYTE], root=root)
    return buf.tobytes().rstrip(b"\0").decode()


def warn(line: str) -> None:
    log.warning(line)
    print(f"warning: {line}", file=sys.stderr, flush=True)


def choose_checkpoint(
    run_dir: Path,
    comm: MPI.Intracomm,
    leader: int,
    needed_parts: Callable[[dict], list[str]],
) -> Path | None:
    """The newest checkpoint whose parts every rank needs are present and verified, agreed by
    every rank of ``comm``; None if the run has none. Each bad part is reported in one line
    by the leader and its checkpoint skipped; CheckpointError if every one is bad.

    ``needed_parts(manifest)``: the parts this rank will read (it verifies just those)."""
    rank = comm.Get_rank()
    candidates = [str(p) for p in list_checkpoints(run_dir)] if rank == leader else []
    count = np.array([len(candidates)], dtype=np.int64)
    comm.Bcast([count, MPI.INT64_T], root=leader)
    for i in range(int(count[0])):
        folder = Path(_bcast_text(comm, candidates[i] if rank == leader else "", leader))
        error = ""
        try:
            manifest = read_manifest(folder)
            check_parts(folder, manifest, needed_parts(manifest), verify=True)
        except CheckpointError as exc:
            error = str(exc)
        mine = np.zeros(_TEXT, dtype=np.uint8)
        raw = error.encode()[:_TEXT]
        mine[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        every = np.zeros((comm.Get_size(), _TEXT), dtype=np.uint8)
        comm.Allgather([mine, MPI.BYTE], [every, MPI.BYTE])
        errors = sorted({row.tobytes().rstrip(b"\0").decode() for row in every} - {""})
        if not errors:
            return folder
        if rank == leader:
            for line in errors:
                warn(f"{line}; trying an older checkpoint")
    if count[0]:
        raise CheckpointError(
            f"no valid checkpoint in {run_dir / CHECKPOINTS}: all {int(count[0])} failed "
            "verification (see the warnings); move them away to start over"
        )
    return None


# --- reading a trainer rank's rows -------------------------------------------------------


class ShardedReader:
    """A trainer rank's view of the trainer parts of one checkpoint: the rows it asks for of
    any tensor, read from the old parts that hold them (``rows``); small values from part 0
    (``get``, ``keys``). Keeps one tensor's old shards in memory at a time."""

    def __init__(self, folder: Path, manifest: dict, parts: list[int]):
        self.folder, self.manifest = folder, manifest
        self.source = str(folder)
        self.readers: dict[int, CheckpointReader] = {}
        self.layouts: dict[int, dict] = {}
        for k in sorted(set(parts) | {0}):
            reader = CheckpointReader(folder / trainer_part(k)).__enter__()
            self.readers[k] = reader
            layout = reader.get("layout")  # JSON text: {tensor path: [first row, *shape]}
            self.layouts[k] = json.loads(layout) if layout else {}

    def close(self) -> None:
        for reader in self.readers.values():
            reader.__exit__()

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, *path: str | int) -> Any:
        return self.readers[0].get(*path)

    def keys(self, *path: str | int) -> list[str | int] | None:
        return self.readers[0].keys(*path)

    def rows(self, path: tuple, rows: slice) -> torch.Tensor:
        """Rows [rows.start, rows.stop) of the whole tensor at ``path`` (its first dim)."""
        key = "/".join(str(p) for p in path)
        pieces = []
        for k, reader in self.readers.items():
            entry = self.layouts[k].get(key)
            if entry is None:
                continue
            start, local = entry[0], reader.get(*path)
            end = start + (local.shape[0] if local.dim() else 0)
            low, high = max(start, rows.start), min(end, rows.stop)
            if low < high:
                pieces.append((low, local[low - start : high - start]))
        pieces.sort(key=lambda item: item[0])
        got = sum(p.shape[0] for _, p in pieces)
        if got != rows.stop - rows.start:
            raise CheckpointError(
                f"checkpoint {self.folder}: rows {rows.start}:{rows.stop} of {key} are not "
                f"all in the trainer parts read ({sorted(self.readers)}); got {got}"
            )
        return torch.cat([p for _, p in pieces]) if pieces else torch.zeros(0)

    def shape(self, path: tuple) -> tuple[int, ...] | None:
        """The whole tensor's shape at ``path`` (from part 0's layout), or None."""
        entry = self.layouts[0].get("/".join(str(p) for p in path))
        return tuple(entry[1:]) if entry else None


def read_full(folder: Path, section: str) -> dict[str, torch.Tensor]:
    """Every whole tensor of ``section`` (e.g. "model"), assembled from the trainer parts:
    for tools and tests (export, inspection); a running rank uses ``ShardedReader.rows``."""
    manifest = read_manifest(folder)
    parts = [int(n[len("trainer") : -3]) for n in manifest["parts"] if n.startswith("trainer")]
    with ShardedReader(folder, manifest, parts) as reader:
        out = {}
        for name in reader.keys(section) or []:
            shape = reader.shape((section, name))
            out[name] = reader.rows((section, name), slice(0, shape[0])).reshape(shape)
        return out


# --- each rank's part, and what it reads on resume ------------------------------------------


def tree_of(states: Mapping[str, Stateful | ShardedStateful]) -> dict:
    """The tree of a file holding ``states``: the union of their ``state_dict()`` trees, in
    the order given. ValueError if two states write the same key."""
    tree: dict = {}
    owner: dict[str, str] = {}
    for name, state in states.items():
        for key, value in state.state_dict().items():
            if key in owner:
                raise ValueError(f"states {owner[key]!r} and {name!r} both write {key!r}")
            owner[key], tree[key] = name, value
    return tree


def load_states(tree: Mapping[str, Any], states: Mapping[str, Stateful], source: str) -> None:
    """Each of ``states`` loads its keys from ``tree`` (a file's root); a key it needs and
    the file lacks is a CheckpointError naming ``source``."""
    for state in states.values():
        try:
            state.load_state_dict(tree)
        except KeyError as exc:
            raise CheckpointError(f"checkpoint {source} has no {exc}") from None


class _PartRoot(Mapping[str, Any]):
    """The root of a part as a mapping whose values are read (and verified) only when
    asked for: a state takes its own keys and nothing else of the file."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self.names = [str(k) for k in reader.keys() or []]

    def __getitem__(self, key: str) -> Any:
        if key not in self.names:
            raise KeyError(key)
        return self.reader.get(key)

    def __contains__(self, key: object) -> bool:  # without reading the value
        return key in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def load_part(path: Path, states: Mapping[str, Stateful]) -> int:
    """Restore ``states`` from the part at ``path``; returns the bytes read of it."""
    with CheckpointReader(path) as reader:
        load_states(_PartRoot(reader), states, str(path))
        return reader.bytes_read


def write_trainer_part(
    folder: Path, states: Mapping[str, Stateful | ShardedStateful], rank: int
) -> PartInfo:
    """Trainer rank ``rank``'s part, written (a CheckpointError or OSError if it cannot be)."""
    return write_part(folder, trainer_part(rank), tree_of(states))


def restore_trainer_part(
    folder: Path, states: Mapping[str, Stateful | ShardedStateful], rank: int, ranks: int
) -> dict:
    """A trainer rank's states: the sharded one (``SHARDED``, the policy) reads its rows
    from the old parts that hold them; the others (the RNGs) load from the part of this
    rank's number, when the checkpoint has one (not when resuming with more trainer
    ranks). Returns the checkpoint's manifest."""
    manifest = read_manifest(folder)
    old = overlapping_parts(rank, ranks, manifest["train_ranks"])
    with ShardedReader(folder, manifest, old) as reader:
        states[SHARDED].load_state_dict(reader)
    own = {name: state for name, state in states.items() if name != SHARDED}
    if rank < manifest["train_ranks"]:
        load_part(folder / trainer_part(rank), own)
    return manifest


def parts_needed(topo: Topology, manifest: dict) -> list[str]:
    """The parts of a checkpoint this rank reads on resume."""
    if topo.role == ROLLOUT:  # its own part, and those of old ranks it takes cut groups from
        old = continued_parts(topo.world_rank, topo.rollout_ranks, manifest["rollout_ranks"])
        return [rollout_part(o) for o in old]
    rank = topo.world_rank - topo.leader
    old = overlapping_parts(rank, topo.train_ranks, manifest["train_ranks"])
    names = [trainer_part(k) for k in old]
    return names + ([LEADER_PART] if topo.is_leader else [])


def find_resume_checkpoint(run_dir: Path, topo: Topology) -> Path | None:
    """The checkpoint folder to resume from, or None for a fresh start."""
    return choose_checkpoint(
        run_dir, MPI.COMM_WORLD, topo.leader, lambda manifest: parts_needed(topo, manifest)
    )
