"""Time from a stop signal to a durable checkpoint, at the default response length and at
one long enough that a generation takes seconds, side by side in one run.

For each length: a run of the default job (``rollout.ignore_eos=true``, so that every
response is as long as asked) is signalled once a few steps are logged, aimed at the middle
of the trainer's next update (``--during update``, the longest wait; the rollout rank is
generating all through it) or half a step after a logged one (``--during generation``);
``checkpoint/stop_latency_s`` comes from the run's ``preempted`` marker and the mean time
per step from its metrics (for scale). Each line says where the signal landed. Locally the signal is
SIGTERM to the launcher, which forwards it to every rank as USR2; with ``--cluster slurm``
(the local Slurm cluster, ``configs/local-slurm.yaml``) it is ``scancel --signal=USR2``,
which Slurm delivers to every process of the job step, and the job, requeued by its batch
script, is then cancelled.

    python scripts/bench_stop_latency.py                       # lengths 6 and 512
    python scripts/bench_stop_latency.py --lengths 6 1024 --repeats 2
    scripts/local_slurm.sh start && python scripts/bench_stop_latency.py --cluster slurm
    python scripts/bench_stop_latency.py --cluster slurm --token-budgets 0 2048

The trainer abandons its update at the next micro-batch boundary (``trainer/policy.py``), so
with one micro-batch per step the update in progress bounds the latency, and it grows with
the response length; ``--token-budgets`` runs every length with micro-batches of at most that
many tokens (``actor.use_dynamic_bsz``), as a long-response job runs anyway for memory.
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

from hpc_asyncppo import timeline as tl
from hpc_asyncppo.runlog import read_jsonl

REPO = Path(__file__).resolve().parents[1]


def leader_spans(run_dir: Path, kind: str) -> list[dict]:
    """The trainer leader's flushed spans of one kind (the lowest trainer rank's session)."""
    sessions = tl.read_timeline(run_dir)
    trainers = [r for r, s in sessions.items() if s and s[-1].role == "trainer"]
    return sessions[min(trainers)][-1].of(kind) if trainers else []


def one_run(
    length: int, steps_before: int, root: Path, cluster: str, overrides: list[str], during: str
) -> tuple[float, float, bool]:
    """(stop latency s, mean s per step before the signal, whether the signal came during
    an update) of one interrupted run."""
    run_dir = root / f"len{length}-{time.monotonic_ns()}"
    where = ["--config", "local-slurm"] if cluster == "slurm" else ["--cluster", "local"]
    cmd = [sys.executable, "-m", "hpc_asyncppo.submit", *where,
           "--run-dir", str(run_dir), "trainer.total_steps=100000",
           f"rollout.response_length={length}", "rollout.ignore_eos=true",
           "checkpoint.save_every=0", "timeouts.sample_wait_s=600", *overrides]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if cluster == "slurm":  # submit returns once the job is queued
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise SystemExit(f"submit failed: {err.decode()[-800:]}")
    job_id = None
    deadline = time.monotonic() + 600

    def logged() -> list[dict]:
        ended = proc.poll() is not None and cluster == "local"
        if ended or time.monotonic() > deadline:
            raise SystemExit(f"run at length {length} ended early or never started")
        return read_jsonl(run_dir / "metrics.jsonl")

    try:
        # enough steps, and their updates' spans flushed
        while len(logged()) < steps_before or len(leader_spans(run_dir, "train")) < 2:
            time.sleep(0.1)
        rows = logged()
        times = [r["time/unix"] for r in rows]
        per_step = statistics.median(b - a for a, b in zip(times[:-1], times[1:], strict=True))
        update = statistics.median(s["end"] - s["start"] for s in leader_spans(run_dir, "train"))
        while len(logged()) == len(rows):  # a step has just been logged
            time.sleep(0.01)
        last = logged()[-1]
        # the next update runs over the last `update` seconds of the next step; the rollout
        # rank generates all through it
        wait = per_step - update / 2 if during == "update" else per_step / 2
        time.sleep(max(0.0, last["time/unix"] + wait - time.time()))
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
        # In an update: one abandoned (the wait for the batch of the step after the last
        # trained one ended before the signal), or one that ran to its end because the
        # signal came during its last micro-batch (the signal inside the last step's train
        # span). The leader's last spans are written when its timeline is closed, a few
        # seconds after the checkpoint.
        received = marker["time"] - marker["checkpoint/stop_latency_s"]  # the leader's receipt
        step = marker["step"]
        in_update = False
        settled = time.monotonic() + 20
        while not in_update and time.monotonic() < settled:
            waits = [s for s in leader_spans(run_dir, "wait") if s["step"] == step + 1]
            trains = [s for s in leader_spans(run_dir, "train") if s["step"] == step]
            in_update = any(s["end"] <= received for s in waits) or any(
                s["start"] <= received <= s["end"] for s in trains
            )
            time.sleep(tl.FLUSH_EVERY_S)
    finally:
        if job_id is not None:
            subprocess.run(["scancel", job_id], check=False)
    shutil.rmtree(run_dir, ignore_errors=True)
    return marker["checkpoint/stop_latency_s"], per_step, in_update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[6, 512])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps-before", type=int, default=4)
    parser.add_argument("--cluster", choices=["local", "slurm"], default="local")
    parser.add_argument(
        "--token-budgets",
        type=int,
        nargs="+",
        default=[0],
        help="each: micro-batches of at most this many tokens (actor.use_dynamic_bsz; "
        "0: one micro-batch per step), at every length, side by side",
    )
    parser.add_argument(
        "--during",
        choices=["update", "generation"],
        default="update",
        help="aim the signal at the middle of the trainer's next update (the longest wait), "
        "or half a step after the last logged one",
    )
    args = parser.parse_args()
    cases = [(budget, length) for budget in args.token_budgets for length in args.lengths]
    results: dict[tuple[int, int], list[tuple[float, float, bool]]] = {c: [] for c in cases}
    if args.cluster == "slurm":  # the emulated nodes see a private /tmp: stay under the repo
        (REPO / "runs").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(
        dir=REPO / "runs" if (REPO / "runs").is_dir() else None
    ) as tmp:
        for repeat in range(args.repeats):
            for budget, length in cases if repeat % 2 == 0 else cases[::-1]:
                overrides = []
                if budget:
                    overrides = [
                        "actor.use_dynamic_bsz=true",
                        f"actor.ppo_max_token_len_per_gpu={budget}",
                    ]
                latency, per_step, in_update = one_run(
                    length, args.steps_before, Path(tmp), args.cluster, overrides, args.during
                )
                results[budget, length].append((latency, per_step, in_update))
                where = "during an update" if in_update else "outside an update"
                print(f"budget {budget:6d}  length {length:5d}  run {repeat}: stop latency "
                      f"{latency:6.2f} s   {per_step:6.2f} s per step   signal {where}",
                      flush=True)  # fmt: skip
    # A signal aimed at an update can land just before or after it; the latency it measures
    # is then the shorter one of a wait. Each length's median is over its runs that landed
    # during an update, if any (the worst case), else over all of them.
    print(
        f"budget  length  median stop latency  s per step  latency / length {args.lengths[0]}'s"
        "  (runs during an update)"
    )
    for budget, length in cases:
        medians = {}
        for n in (args.lengths[0], length):
            runs = results[budget, n]
            medians[n] = statistics.median(r[0] for r in [r for r in runs if r[2]] or runs)
        landed = sum(r[2] for r in results[budget, length])
        per_step = statistics.median(r[1] for r in results[budget, length])
        print(
            f"{budget:6d}  {length:6d}  {medians[length]:19.2f}  {per_step:10.2f}  "
            f"{medians[length] / medians[args.lengths[0]]:6.2f}x  ({landed} of "
            f"{len(results[budget, length])})"
        )


if __name__ == "__main__":
    main()
