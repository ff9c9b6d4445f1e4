"""Faults injected at a named moment, for tests and fault drills; never set in a real run.

A test that raced a ``kill`` against a running job found the job in whatever state the
machine's pace had put it (between two syncs, or inside one), and the outcome (which ranks
restart, how often) with it. A fault named here fires inside the code, at one moment:

``HPC_ASYNCPPO_FAULTS`` (in the launcher's environment; the ranks and the engine processes
they start inherit it) lists faults, comma-separated, each ``ACTION@MOMENT=N`` followed
by ``:KEY=N`` filters. For example ``kill_engine@bucket=3:rank=0:sync=2``: the weight
receiver of world rank 0 (a vLLM worker of that rollout rank, or the rank itself with
the HF engine), as the 3rd bucket of the 2nd weight sync it receives arrives (counted from
its engine's start), kills its engine: the engine dies mid-broadcast.

Actions: ``kill_engine`` (a vLLM worker SIGKILLs its engine core and itself; elsewhere
the process kills itself), ``kill_rank`` and ``stop_rank`` (SIGKILL or SIGSTOP the
process). Moments, each at a number:

    bucket=N        a weight receiver (``transport/weights.py``, both engines) as the N-th
                    bucket of a sync arrives; filters ``rank``, ``sync`` (the receiver's
                    count of syncs, from its engine's start)
    step=N          a trainer rank (the leader and the others) as it begins step N
    part_written=N  a rank once its part of the checkpoint of step N is written, before
                    the leader commits the checkpoint

``rank`` (world rank) filters every moment.

A fault fires once per run: before it acts it is appended to ``RUN_DIR/faults_fired.jsonl``
with its process and wall time (``RUN_DIR`` from ``HPC_ASYNCPPO_RUN_DIR``, which each rank
sets for its children), and a fault listed there never fires again, in this attempt, a restarted engine or a resumed
attempt. What a process keeps: nothing (the list is read where a moment comes).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_asyncppo.paths import FAULTS_FIRED

FAULTS_ENV = "HPC_ASYNCPPO_FAULTS"
RUN_DIR_ENV = "HPC_ASYNCPPO_RUN_DIR"
RANK_ENV = "HPC_ASYNCPPO_WORLD_RANK"
ACTIONS = ("kill_engine", "kill_rank", "stop_rank")
MOMENTS = {"bucket": ("rank", "sync"), "step": ("rank",), "part_written": ("rank",)}


@dataclass(frozen=True)
class Fault:
    spec: str  # as written: its name in the record of fired faults
    action: str
    moment: str
    count: int
    filters: tuple[tuple[str, int], ...]


def parse(text: str) -> list[Fault]:
    """The faults of ``HPC_ASYNCPPO_FAULTS``; ValueError names a malformed one."""
    faults = []
    for spec in (s.strip() for s in text.split(",")):
        if not spec:
            continue
        try:
            head, *filters = spec.split(":")
            action, when = head.split("@")
            moment, count = when.split("=")
            pairs = tuple((k, int(v)) for k, v in (f.split("=") for f in filters))
            fault = Fault(spec, action, moment, int(count), pairs)
        except ValueError:
            raise ValueError(f"{FAULTS_ENV}: {spec!r} is not ACTION@MOMENT=N[:KEY=N...]") from None
        if action not in ACTIONS or moment not in MOMENTS:
            raise ValueError(
                f"{FAULTS_ENV}: {spec!r}: actions are {', '.join(ACTIONS)}; "
                f"moments are {', '.join(MOMENTS)}"
            )
        unknown = {k for k, _ in pairs} - set(MOMENTS[moment])
        if unknown:
            raise ValueError(
                f"{FAULTS_ENV}: {spec!r}: {moment} takes the filters "
                f"{', '.join(MOMENTS[moment])}, not {', '.join(sorted(unknown))}"
            )
        faults.append(fault)
    return faults


def arm(run_dir: Path, rank: int) -> None:
    """A rank's start: its faults are checked now (a malformed one fails the rank at once),
    and the processes it starts learn its run directory and world rank."""
    parse(os.environ.get(FAULTS_ENV, ""))
    os.environ[RUN_DIR_ENV] = str(run_dir)
    os.environ[RANK_ENV] = str(rank)


def at(moment: str, count: int, **where: int) -> None:
    """Fire the faults due at ``moment`` number ``count`` here (``where``: the filters'
    values at this point); nothing when none is set (one environment lookup)."""
    text = os.environ.get(FAULTS_ENV)
    if not text:
        return
    rank = int(os.environ.get(RANK_ENV, "-1"))
    values = {"rank": rank, **where}
    for fault in parse(text):
        if fault.moment != moment or fault.count != count:
            continue
        if any(values.get(key) != value for key, value in fault.filters):
            continue
        if _fired_before(fault):
            continue
        _record(fault)
        _act(fault.action)


def _log() -> Path:
    return Path(os.environ[RUN_DIR_ENV]) / FAULTS_FIRED


def _fired_before(fault: Fault) -> bool:
    try:
        rows = [json.loads(line) for line in _log().read_text().splitlines() if line]
    except FileNotFoundError:
        return False
    return any(row["fault"] == fault.spec for row in rows)


def _record(fault: Fault) -> None:
    with _log().open("a") as f:
        f.write(json.dumps({"fault": fault.spec, "pid": os.getpid(), "time": time.time()}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _act(action: str) -> None:
    if action == "kill_engine":
        parent = Path(f"/proc/{os.getppid()}/comm").read_text()
        if parent.startswith("VLLM::EngineCor"):  # a worker's engine core
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "kill_rank":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        os.kill(os.getpid(), signal.SIGSTOP)
