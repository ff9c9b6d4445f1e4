"""Time from a stop signal to a durable checkpoint, at the default response length and at
one long enough that a generation takes seconds, side by side in one run.

For each length: a local run of the default job (``rollout.ignore_eos=true``, so that
every response is as long as asked), SIGTERM to the launcher once a few steps are logged
and the rollout rank is mid-generation (the launcher forwards it to every rank as USR2,
as Slurm's warning signal), then ``checkpoint/stop_latency_s`` from the run's
``preempted`` marker and the mean time per step from its metrics (for scale).

    python scripts/bench_stop_latency.py                       # lengths 6 and 512
    python scripts/bench_stop_latency.py --lengths 6 1024 --repeats 2
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


def one_run(length: int, steps_before: int, root: Path) -> tuple[float, float]:
    """(stop latency s, mean s per step before the signal) of one interrupted run."""
    run_dir = root / f"len{length}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local",
           "--run-dir", str(run_dir), "trainer.total_steps=100000",
           f"rollout.response_length={length}", "rollout.ignore_eos=true",
           "checkpoint.save_every=0", "timeouts.sample_wait_s=600"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while len(read_jsonl(run_dir / "metrics.jsonl")) < steps_before:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"run at length {length} ended early: {proc.communicate()[1][-800:]}")
        time.sleep(0.1)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    # half a step after the last logged one: the rollout rank is generating
    per_step = (rows[-1]["time/unix"] - rows[0]["time/unix"]) / max(1, len(rows) - 1)
    time.sleep(per_step / 2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=600)
    marker = json.loads((run_dir / "preempted").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    return marker["checkpoint/stop_latency_s"], per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[6, 512])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps-before", type=int, default=4)
    args = parser.parse_args()
    results: dict[int, list[tuple[float, float]]] = {n: [] for n in args.lengths}
    with tempfile.TemporaryDirectory(
        dir=REPO / "runs" if (REPO / "runs").is_dir() else None
    ) as tmp:
        for repeat in range(args.repeats):
            order = args.lengths if repeat % 2 == 0 else args.lengths[::-1]
            for length in order:
                latency, per_step = one_run(length, args.steps_before, Path(tmp))
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
