"""Where a sample's time goes: a run's wall time per rank split into its phases, and the
per-sample floor they imply on this machine.

    python scripts/profile_step.py                                   # the default job, 100 steps
    python scripts/profile_step.py --steps 200 -- data.task=long_tail rollout.response_length=56
    python scripts/profile_step.py --train-ranks 2                   # a leader and a follower
    python scripts/profile_step.py --run-dir RUN_DIR                 # a run already done

Every rank's ``timeline/`` spans (``timeline.py``), from the end of its first weight sync
to its last span: rollout ranks generate, send (transport to the trainer), wait (no
credits), sync (weights in), checkpoint; trainer ranks wait (for samples; followers for
their shard), train, sync (leader: weights out), checkpoint. Each trainer rank's train
spans are split further by the phases they carry (``policy.PhaseClock``): log_probs (old
and reference log-probs), forward, backward, optimizer, and the rest of the span as
``other`` (the leader: collate, sending the followers their shards, logging).

The floor: seconds of busy time per sample on the rollout side (generation and sending,
over the rollout ranks, which work in parallel) and on the trainer's (train and sync):
with perfect overlap a sample cannot come faster than the larger of the two, so
1 / max is the samples/s this machine can reach with these settings; the run's measured
samples/s is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpc_asyncppo.runlog import split_metrics  # noqa: E402
from hpc_asyncppo.timeline import SPANS, busy_seconds, read_timeline  # noqa: E402

PHASES = ("log_probs", "forward", "backward", "optimizer")


def run(steps: int, ranks: list[str], overrides: list[str], run_dir: Path) -> None:
    cmd = [sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local", *ranks,
           "--run-dir", str(run_dir), f"trainer.total_steps={steps}",
           "checkpoint.save_every=0", *overrides]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def profile(run_dir: Path) -> None:
    rows, _ = split_metrics(
        [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    )
    samples = rows[-1]["samples/total"]
    elapsed = rows[-1]["time/elapsed_s"]
    rollout_busy, train, sync, phases = [], 0.0, 0.0, {}  # rollout busy s; the leader's train
    print(
        f"{run_dir}: {len(rows)} steps, {samples} samples in {elapsed:.1f} s after the first sync"
    )
    print("rank  role      wall s  share of it in each span")
    timeline = read_timeline(run_dir)
    leader = min(r for r, s in timeline.items() if s[-1].role == "trainer")
    for rank, sessions in timeline.items():
        session = sessions[-1]
        start = session.first_sync_end() or session.started
        wall = session.end - start
        kinds = SPANS.get(session.role, ())
        seconds = {k: busy_seconds(session.spans, k, start, session.end) for k in kinds}
        cells = "  ".join(f"{k} {seconds[k] / wall:4.0%}" for k in kinds)
        print(f"{rank:4d}  {session.role:8s} {wall:7.1f}  {cells}")
        if session.role == "rollout":
            rollout_busy.append(seconds["generate"] + seconds["send"])
            continue
        spans = [s for s in session.of("train") if s["start"] >= start]
        split = {p: sum(s.get("phases", {}).get(p, 0.0) for s in spans) for p in PHASES}
        split["other"] = seconds["train"] - sum(split.values())
        print("      its training steps: " + ", ".join(
            f"{p} {s / max(seconds['train'], 1e-9):.0%}" for p, s in split.items()
        ) + f" of {seconds['train']:.1f} s")  # fmt: skip
        if rank == leader:
            train, sync, phases = seconds["train"], seconds["sync"], split
    per_sample = {
        "generation + send (per rollout rank, in parallel)": (
            max(rollout_busy) / samples if rollout_busy else 0.0
        ),
        **{f"train: {p}": s / samples for p, s in phases.items()},
        "sync (weights out)": sync / samples,
    }
    print("milliseconds per sample:")
    for name, s in per_sample.items():
        print(f"  {name:52s} {1000 * s:8.3f}")
    rollout = per_sample["generation + send (per rollout rank, in parallel)"]
    trainer = (train + sync) / samples
    floor = max(rollout, trainer)
    side = "rollout" if rollout >= trainer else "trainer"
    print(
        f"floor: {1000 * floor:.3f} ms per sample ({side} bound) = {1 / floor:.0f} samples/s "
        f"with perfect overlap; measured {samples / elapsed:.0f} samples/s "
        f"({samples / elapsed * floor:.0%} of it)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--run-dir", type=Path, help="profile this run instead of a new one")
    parser.add_argument("--rollout-ranks", type=int, default=1)
    parser.add_argument("--train-ranks", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="key=value for the new run")
    args = parser.parse_args()
    if args.run_dir:
        profile(args.run_dir)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [f"--rollout-ranks={args.rollout_ranks}", f"--train-ranks={args.train_ranks}"]
        run(args.steps, ranks, args.overrides, Path(tmp) / "run")
        profile(Path(tmp) / "run")


if __name__ == "__main__":
    main()
