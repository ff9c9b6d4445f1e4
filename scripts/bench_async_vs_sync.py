"""Fully asynchronous vs synchronous (on-policy) training on the same ranks and samples.

Runs the default job in ``sync`` and ``fully_async`` mode, alternating, on the same number
of rollout and trainer ranks and the same number of samples, and prints the wall time of the
training phase (from the first weight sync to the last step; start-up excluded), the
speedup, each mode's trainer and rollouter idle ratios, and the ideal speedup
(gen + train) / max(gen, train) estimated from the sync run, where the trainer waits exactly
while the rollout generates and vice versa.

    python scripts/bench_async_vs_sync.py [--steps 200] [--repeats 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(
    mode: str, steps: int, ranks: tuple[int, int], extra: list[str], root: Path, i: int
) -> dict:
    run_dir = root / f"{mode}-{i}"
    cmd = [
        sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local", "--run-dir", str(run_dir),
        "--rollout-ranks", str(ranks[0]), "--train-ranks", str(ranks[1]),
        f"async_training.mode={mode}", f"trainer.total_steps={steps}", *extra,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rollout-ranks", type=int, default=1)
    parser.add_argument("--train-ranks", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    ranks = (args.rollout_ranks, args.train_ranks)
    results: dict[str, list[dict]] = {"sync": [], "fully_async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for mode in results:  # alternate, so drift on a shared machine hits both modes alike
                last = run(mode, args.steps, ranks, args.overrides, Path(tmp), i)
                results[mode].append(last)
                print(
                    f"{mode:12s} run {i}: {last['time/elapsed_s']:7.2f} s for {last['samples/total']} samples, "
                    f"trainer idle {last['trainer/idle_ratio']:.2f}, rollouter idle {last['rollouter/idle_ratio']:.2f}, "
                    f"final reward {last['reward/mean']:.3f}",
                    flush=True,
                )
    med = {m: statistics.median(r["time/elapsed_s"] for r in rs) for m, rs in results.items()}
    idle = {
        m: (
            statistics.median(r["trainer/idle_ratio"] for r in rs),
            statistics.median(r["rollouter/idle_ratio"] for r in rs),
        )
        for m, rs in results.items()
    }
    gen_share, train_share = idle[
        "sync"
    ]  # in sync mode the trainer waits while the rollout generates
    ideal = (gen_share + train_share) / max(gen_share, train_share)
    print(
        f"ranks: {ranks[0]} rollout + {ranks[1]} trainer, {args.steps} steps, median of {args.repeats}"
    )
    print(
        f"sync        {med['sync']:.2f} s  trainer idle {idle['sync'][0]:.2f}  rollouter idle {idle['sync'][1]:.2f}"
    )
    print(
        f"fully_async {med['fully_async']:.2f} s  trainer idle {idle['fully_async'][0]:.2f}  rollouter idle {idle['fully_async'][1]:.2f}"
    )
    print(f"speedup fully_async / sync: {med['sync'] / med['fully_async']:.2f}x")
    print(f"ideal (gen + train) / max(gen, train) from the sync run: {ideal:.2f}x")


if __name__ == "__main__":
    main()
