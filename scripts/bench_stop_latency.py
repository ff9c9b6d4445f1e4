"""Time from a stop signal to a durable checkpoint, at the default response length and at
one long enough that a generation takes seconds, side by side in one run.

For each length: a run of the default job (``rollout.ignore_eos=true``, so that every
response is as long as asked) is signalled once a few steps are logged and the rollout rank
is mid-generation, then ``checkpoint/stop_latency_s`` comes from the run's ``preempted``
marker and the mean time per step from its metrics (for scale). Locally the signal is
SIGTERM to the launcher, which forwards it to every rank as USR2; with ``--cluster slurm``
(the local Slurm cluster, ``configs/local-slurm.yaml``) it is ``scancel --signal=USR2``,
which Slurm delivers to every process of the job step, and the job, requeued by its batch
script, is then cancelled.

    python scripts/bench_stop_latency.py                       # lengths 6 and 512
    python scripts/bench_stop_latency.py --lengths 6 1024 --repeats 2
    scripts/local_slurm.sh start && python scripts/bench_stop_latency.py --cluster slurm
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpc_asyncppo.runlog import read_jsonl

REPO = Path(__file__).resolve().parents[1]


def one_run(length: int, steps_before: int, root: Path, cluster: str) -> tuple[float, float]:
    """(stop latency s, mean s per step before the signal) of one interrupted run."""
    run_dir = root / f"len{length}-{time.monotonic_ns()}"
    where = ["--config", "local-slurm"] if cluster == "slurm" else ["--cluster", "local"]
    cmd = [sys.executable, "-m", "hpc_asyncppo.submit", *where,
           "--run-dir", str(run_dir), "trainer.total_steps=100000",
           f"rollout.response_length={length}", "rollout.ignore_eos=true",
           "checkpoint.save_every=0", "timeouts.sample_wait_s=600"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if cluster == "slurm":  # submit returns once the job is queued
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise SystemExit(f"submit failed: {err.decode()[-800:]}")
    job_id = None
    deadline = time.monotonic() + 600
    try:
        while len(read_jsonl(run_dir / "metrics.jsonl")) < steps_before:
            ended = proc.poll() is not None and cluster == "local"
            if ended or time.monotonic() > deadline:
                raise SystemExit(f"run at length {length} ended early or never started")
            time.sleep(0.1)
        rows = read_jsonl(run_dir / "metrics.jsonl")
        # half a step after the last logged one: the rollout rank is generating
        per_step = (rows[-1]["time/unix"] - rows[0]["time/unix"]) / max(1, len(rows) - 1)
        time.sleep(per_step / 2)
        if cluster == "slurm":
            job_id = (run_dir / "slurm" / "job_id").read_text().strip()
            subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
            while not (run_dir / "preempted").exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"no checkpoint after the signal: {run_dir}")
                time.sleep(0.1)
        else:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=600)
        marker = json.loads((run_dir / "preempted").read_text())
    finally:
        if job_id is not None:
            subprocess.run(["scancel", job_id], check=False)
    shutil.rmtree(run_dir, ignore_errors=True)
    return marker["checkpoint/stop_latency_s"], per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[6, 512])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps-before", type=int, default=4)
    parser.add_argument("--cluster", choices=["local", "slurm"], default="local")
    args = parser.parse_args()
    results: dict[int, list[tuple[float, float]]] = {n: [] for n in args.lengths}
    if args.cluster == "slurm":  # the emulated nodes see a private /tmp: stay under the repo
        (REPO / "runs").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(
        dir=REPO / "runs" if (REPO / "runs").is_dir() else None
    ) as tmp:
        for repeat in range(args.repeats):
            order = args.lengths if repeat % 2 == 0 else args.lengths[::-1]
            for length in order:
                latency, per_step = one_run(length, args.steps_before, Path(tmp), args.cluster)
                results[length].append((latency, per_step))
                print(f"length {length:5d}  run {repeat}: stop latency {latency:6.2f} s"
                      f"   {per_step:6.2f} s per step")  # fmt: skip
    base = statistics.median(r[0] for r in results[args.lengths[0]])
    print(f"length  median stop latency  s per step  latency / length {args.lengths[0]}'s")
    for length in args.lengths:
        latency = statistics.median(r[0] for r in results[length])
        per_step = statistics.median(r[1] for r in results[length])
        print(f"{length:6d}  {latency:19.2f}  {per_step:10.2f}  {latency / base:6.2f}x")


if __name__ == "__main__":
    main()
