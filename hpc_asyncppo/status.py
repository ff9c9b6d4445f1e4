"""Where a run stands, on one screen: ``python -m hpc_asyncppo.status RUN_DIR``.

Reads only the run directory (and asks Slurm for the job's state when the run was
submitted there): state, step, param version, last checkpoint, reward, throughput, idle
ratios, what each rank is doing (its heartbeat, while the run runs), the attempts, and
the last error. Works on a live, finished, failed, killed or resumed run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from hpc_asyncppo import goodput
from hpc_asyncppo.launch.rundir import error_line
from hpc_asyncppo.paths import (
    CONFIG,
    ERRORS,
    GATEWAY,
    HEARTBEATS,
    JOB_ID,
    METRICS,
    RANKS,
    SLURM,
    TIMELINE,
)
from hpc_asyncppo.rollout.gateway.addresses import TOKEN, read_addresses
from hpc_asyncppo.runlog import format_validation, read_jsonl, read_rank_info, split_metrics


@dataclass
class Checkpoint:
    path: Path
    step: int | None  # from the file name, when it has a number
    mtime: float


@dataclass
class RankError:
    rank: int
    line: str  # the message of errors/rank{i}.txt on one line (launch.rundir.error_line)
    current: bool  # False: written before this rank's latest (re)start, by an earlier attempt


@dataclass
class RunStatus:
    run_dir: Path
    state: str  # not started | starting | running | finished | failed | killed | unknown | <slurm state>
    total_steps: int | None
    rows: list[dict]  # metrics, one row per step (a resumed run's last attempt wins)
    attempts: int  # 1 + resumes
    ranks: list[dict]
    job_id: str | None = None
    job_state: str | None = None
    checkpoint: Checkpoint | None = None
    errors: list[RankError] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)  # validation rows, one per step
    gateways: list[dict] = field(default_factory=list)  # data.agent: each rollout rank's address

    @property
    def last(self) -> dict | None:
        return self.rows[-1] if self.rows else None


def metrics_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl, one row per step in step order: a resumed run re-runs the steps after
    its checkpoint, and the row its last attempt wrote for a step is the one that counts."""
    return split_metrics(read_jsonl(run_dir / METRICS))[0]


def validation_rows(run_dir: Path) -> list[dict]:
    """The validation rows of metrics.jsonl (``val/`` keys), one per step, in step order."""
    return split_metrics(read_jsonl(run_dir / METRICS))[1]


def attempts_of(run_dir: Path) -> int:
    """How many times the ranks were started (1 + resumes), from the timeline's sessions."""
    counts = [
        path.read_text().count('"span":"session"')
        for path in (run_dir / TIMELINE).glob("rank*.jsonl")
    ]
    return max(counts, default=0) or 1


def total_steps_of(run_dir: Path) -> int | None:
    try:
        return int(OmegaConf.select(OmegaConf.load(run_dir / CONFIG), "trainer.total_steps"))
    except Exception:  # noqa: BLE001 - a missing or foreign config only loses the total
        return None


def last_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest committed checkpoint (``checkpoints/step_*/`` with a manifest)."""
    from hpc_asyncppo.checkpoint.protocol import list_checkpoints

    for path in list_checkpoints(run_dir):
        digits = re.findall(r"\d+", path.name)
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:  # pruned while we looked
            continue
        return Checkpoint(path, int(digits[-1]) if digits else None, mtime)
    return None


def rank_error_list(run_dir: Path, ranks: list[dict]) -> list[RankError]:
    started = {info["rank"]: info for info in ranks}
    errors = []
    for path in sorted((run_dir / ERRORS).glob("rank*.txt"), key=lambda p: int(p.stem[4:])):
        text = path.read_text().strip()
        if not text:
            continue
        rank = int(path.stem[4:])
        info = started.get(rank)
        current = info is None or info["state"] == "failed" or path.stat().st_mtime >= info["time"]
        errors.append(RankError(rank, error_line(text), current))
    return errors


def slurm_job_id(run_dir: Path, ranks: list[dict]) -> str | None:
    path = run_dir / SLURM / JOB_ID
    if path.exists() and path.read_text().strip():
        return path.read_text().strip()
    ids = [info.get("slurm_job_id") for info in ranks if info.get("slurm_job_id")]
    return ids[0] if ids else None


def slurm_job_state(job_id: str) -> str | None:
    if not (shutil.which("scontrol") or shutil.which("sacct")):
        return None
    from hpc_asyncppo.launch.slurm.cluster import job_state

    return job_state(job_id)


def process_alive(pid: int) -> bool:
    """True if ``pid`` runs here (a zombie, killed but not yet reaped, counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def run_state(ranks: list[dict], errors: list[RankError], job_state: str | None) -> str:
    """One word for the run, from the ranks' own records, Slurm, and (locally) their pids."""
    from hpc_asyncppo.launch.slurm.cluster import ACTIVE_STATES

    states = [info["state"] for info in ranks]
    if "failed" in states or any(e.current for e in errors):
        return "failed"
    if states and all(s == "done" for s in states):
        return "finished"
    if job_state not in (None, "UNKNOWN"):
        if job_state in ACTIVE_STATES:
            return "starting" if job_state in ("PENDING", "CONFIGURING") else "running"
        return job_state.lower()
    if not ranks:
        return "not started"
    here = socket.gethostname()
    local = [info for info in ranks if info.get("host") == here and info.get("pid")]
    if len(local) < len(ranks):
        return "unknown"
    if any(process_alive(info["pid"]) for info in local if info["state"] != "done"):
        return "starting" if "starting" in states else "running"
    return "killed"


def collect(run_dir: Path) -> RunStatus:
    run_dir = Path(run_dir)
    ranks = read_rank_info(run_dir) if (run_dir / RANKS).exists() else []
    rows = metrics_rows(run_dir)
    errors = rank_error_list(run_dir, ranks)
    job_id = slurm_job_id(run_dir, ranks)
    job = slurm_job_state(job_id) if job_id else None
    return RunStatus(
        run_dir=run_dir,
        state=run_state(ranks, errors, job),
        total_steps=total_steps_of(run_dir),
        rows=rows,
        attempts=attempts_of(run_dir),
        ranks=ranks,
        job_id=job_id,
        job_state=job,
        checkpoint=last_checkpoint(run_dir),
        errors=errors,
        validation=validation_rows(run_dir),
        gateways=read_addresses(run_dir),
    )


def ago(t: float, now: float | None = None) -> str:
    s = max(0.0, (time.time() if now is None else now) - t)
    if s < 120:
        return f"{s:.0f}s ago"
    if s < 7200:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def doing_lines(st: RunStatus) -> list[str]:
    """While the run runs: what each rank's last heartbeat said, and when (a rank whose
    beat is old is stopped or hung: runtime/heartbeat.py)."""
    if st.state not in ("running", "starting"):
        return []
    lines = []
    for info in st.ranks:
        path = st.run_dir / HEARTBEATS / f"rank{info['rank']}.json"
        try:
            doing = json.loads(path.read_text())["doing"]
            beat = path.stat().st_mtime
        except (OSError, ValueError, KeyError):
            continue
        lines.append(f"rank {info['rank']} ({info['role']}): {doing} (last beat {ago(beat)})")
    return [f"{'doing' if i == 0 else '':<12}{line}" for i, line in enumerate(lines)]


def goodput_lines(run_dir: Path, indent: str = "") -> list[str]:
    """Where the wall time went, attempt by attempt (RUN_DIR/goodput.jsonl), if recorded."""
    rows = goodput.read_attempts(run_dir)
    if not rows:
        return []
    total = goodput.summary(rows)
    share = f", goodput {total['goodput']:.0%}" if total["goodput"] is not None else ""
    lines = [
        f"{indent}goodput     {total['attempts']} attempt(s) in {total['run_wall_s']:.0f}s: "
        f"requeue waits {total['requeue_wait_s']:.0f}s, work lost {total['lost_s']:.1f}s, "
        f"{total['tokens_regenerated']} tokens regenerated{share}"
    ]
    t0 = rows[0]["start"]
    for r in rows:
        end = f"{r['end'] - t0:.0f}s" if r.get("end") is not None else "now"
        latency = f", stop latency {r['stop_latency_s']:.2f}s" if r.get("stop_latency_s") else ""
        restarted = ", restarted" if r.get("restarted") else ""
        engines = (
            f", {r['engine_restarts']} engine restart(s) ({r['engine_restart_s']:.1f}s)"
            if r.get("engine_restarts")
            else ""
        )
        lines.append(
            f"{indent}  attempt {r['attempt']}: {r['start'] - t0:.0f}s-{end}, steps "
            f"{r['resumed_step']}-{r['end_step']}, {r['reason']}{restarted}{engines}{latency}"
        )
    return lines


def format_status(st: RunStatus) -> str:
    lines = [f"run         {st.run_dir}"]
    roles = [info["role"] for info in st.ranks]
    where = f"{roles.count('rollout')} rollout + {roles.count('trainer')} trainer ranks"
    hosts = sorted({info.get("host", "?") for info in st.ranks})
    job = f"   slurm job {st.job_id}: {st.job_state or 'state unknown'}" if st.job_id else ""
    lines.append(f"state       {st.state}  ({where} on {', '.join(hosts) or '-'}){job}")
    last = st.last
    total = st.total_steps or "?"
    if last is None:
        lines.append(f"step        0/{total}  (no step logged yet)")
    else:
        pct = f" ({last['step'] / st.total_steps:.0%})" if st.total_steps else ""
        stamp = f", last logged {ago(last['time/unix'])}" if "time/unix" in last else ""
        resumed = f", resumed {st.attempts - 1}x" if st.attempts > 1 else ""
        lines.append(
            f"step        {last['step']}/{total}{pct}  param version {last['param_version']}{stamp}{resumed}"
        )
    if st.checkpoint is not None:
        step = f"step {st.checkpoint.step}, " if st.checkpoint.step is not None else ""
        lines.append(f"checkpoint  {st.checkpoint.path.name} ({step}{ago(st.checkpoint.mtime)})")
    else:
        lines.append("checkpoint  none")
    if last is not None:
        n = min(10, max(1, len(st.rows) // 2))
        reward = sum(r["reward/mean"] for r in st.rows[-n:]) / n
        start = sum(r["reward/mean"] for r in st.rows[:n]) / n
        lines.append(
            f"reward      {reward:.3f} (mean of the last {n} steps; first {n} steps: {start:.3f})"
        )
        lines.append(
            f"throughput  {last['throughput/samples_per_s']:.1f} samples/s   "
            f"staleness mean {last['staleness/mean']:.2f} max {last['staleness/max']}   "
            f"queue {last.get('queue/groups', 0)} groups"
        )
        lines.append(
            f"idle        trainer {last['trainer/idle_ratio']:.0%} (waiting for samples)   "
            f"rollout {last['rollouter/idle_ratio']:.0%} (waiting for credits)"
        )
        lines.append(
            f"samples     {last['samples/total']} trained, {last['samples/dropped']} dropped"
        )
    if st.validation:
        lines.append(f"validation  {format_validation(st.validation[-1])}")
    for g in st.gateways:  # where external agents call (Authorization: Bearer <token file>)
        token = st.run_dir / GATEWAY / TOKEN
        lines.append(f"gateway     rank {g['rank']}: {g['url']}   (bearer token in {token})")
    lines += doing_lines(st)
    lines += goodput_lines(st.run_dir)
    for err in st.errors[-3:]:
        tag = "error      " if err.current else "old error  "
        lines.append(f"{tag} {err.line}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m hpc_asyncppo.status") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Where a run stands, on one screen.")
    parser.add_argument("run_dir", type=Path, help="the run directory")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    print(format_status(collect(args.run_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
