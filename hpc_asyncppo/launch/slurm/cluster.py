"""What we ask a live Slurm: its partitions before submitting, a job's state afterwards.

Only the client commands every cluster has (``scontrol``, ``sacct`` as a fallback); no
accounting database is needed: ``scontrol`` keeps finished jobs for ``MinJobAge``.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass

# A job in one of these states may still run; any other state is final.
ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
    }
)


class SlurmError(RuntimeError):
    """Slurm is missing, unreachable, or refused a request; the message is one line for the user."""


@dataclass(frozen=True)
class Partition:
    name: str
    total_nodes: int
    max_nodes: int | None  # per-job node limit; None: unlimited
    default: bool
    state: str


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_client(command: list[str], timeout_s: float = 30.0) -> str:
    """Run a Slurm client command and return its stdout; SlurmError (one line) if it fails."""
    if shutil.which(command[0]) is None:
        raise SlurmError(
            f"{command[0]} not found on PATH: submit from a machine with the Slurm client "
            "commands (a login node), or run without Slurm (local mode)"
        )
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(command)} did not answer within {timeout_s:.0f}s") from None
    if proc.returncode:
        reason = last_line(proc.stderr) or last_line(proc.stdout) or f"exit {proc.returncode}"
        raise SlurmError(f"{' '.join(command[:3])} failed: {reason}")
    return proc.stdout


def _fields(line: str) -> dict[str, str]:
    """``Key=Value Key2=Value2`` (scontrol -o) into a dict; values hold no spaces here."""
    pairs = (item.split("=", 1) for item in line.split() if "=" in item)
    return {key: value for key, value in pairs}


def parse_partitions(text: str) -> dict[str, Partition]:
    """Partitions from ``scontrol show partition -o`` output."""
    partitions = {}
    for line in text.splitlines():
        f = _fields(line)
        if "PartitionName" not in f:
            continue
        max_nodes = f.get("MaxNodes", "UNLIMITED")
        partitions[f["PartitionName"]] = Partition(
            name=f["PartitionName"],
            total_nodes=int(f.get("TotalNodes", "0")),
            max_nodes=int(max_nodes) if max_nodes.isdigit() else None,
            default=f.get("Default") == "YES",
            state=f.get("State", "UP"),
        )
    return partitions


def query_partitions() -> dict[str, Partition]:
    return parse_partitions(run_client(["scontrol", "show", "partition", "-o"]))


def combine_states(states: list[str]) -> str:
    """One state for a heterogeneous job from its components' states.

    Active while any component is active; COMPLETED only when all completed; otherwise
    the first component's failure state (FAILED, CANCELLED, TIMEOUT, NODE_FAIL...).
    """
    if not states:
        return "UNKNOWN"
    for state in states:
        if state in ACTIVE_STATES:
            return state
    for state in states:
        if state != "COMPLETED":
            return state
    return "COMPLETED"


def parse_job_states(text: str) -> list[str]:
    """Each component's JobState from ``scontrol show job -o`` output."""
    return [_fields(line)["JobState"] for line in text.splitlines() if "JobState=" in line]


def job_state(job_id: str, tries: int = 3, pause_s: float = 2.0) -> str:
    """The job's state; UNKNOWN when neither scontrol nor sacct knows it any more.

    A controller too busy to answer (a timeout, a refused socket: seen under load on the
    local cluster, where a test's wait then ended with UNKNOWN while the job ran) is asked
    again, ``tries`` times in all; only a job it no longer knows goes to sacct."""
    for attempt in range(tries):
        try:
            return combine_states(
                parse_job_states(run_client(["scontrol", "show", "job", "-o", job_id]))
            )
        except SlurmError as exc:
            if "Invalid job id" in str(exc) or attempt + 1 == tries:
                break
            time.sleep(pause_s)
    try:
        out = run_client(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", job_id])
    except SlurmError:
        return "UNKNOWN"
    # sacct prints "CANCELLED by 0": the state is the first word.
    return combine_states(
        [line.split("|")[1].split()[0] for line in out.splitlines() if "|" in line]
    )
