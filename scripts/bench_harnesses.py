"""Agent harnesses, unmodified, training a run: the lookup task (``data.task=tool_lookup``,
``data.agent=external``) with its groups driven in turn by the nine agents of
``examples/harnesses/`` (their own environment: ``bash scripts/install_harnesses.sh``),
for ``--steps`` steps. Prints the run's reward over its first and last 20 steps, and per
harness: sessions, calls and their statuses, the agents' own errors, and the mean reward
of its first and last quarter of sessions (in the order they ended).

    python scripts/bench_harnesses.py --steps 150 --seed 1

The suite runs the same with 6 steps (``tests/integration/test_harness_runs.py``), where
it checks the statuses and that what each harness got back is what was trained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=8, help="sessions the driver runs at once")
    parser.add_argument("--harnesses", nargs="+", help="a subset (run_harnesses.py's names)")
    parser.add_argument("overrides", nargs="*", help="more key=value for the run")
    args = parser.parse_args()
    subprocess.run(["bash", "scripts/install_harnesses.sh"], cwd=REPO, check=True)
    root = Path(tempfile.mkdtemp(prefix="bench_harnesses_", dir="/var/tmp"))
    run_dir, transcripts = root / "run", root / "harnesses.jsonl"
    run = subprocess.Popen(
        [sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local", "--run-dir",
         str(run_dir), "data.task=tool_lookup", "data.agent=external",
         "rollout.response_length=12", "data.max_prompt_length=4096",
         f"trainer.total_steps={args.steps}", f"trainer.seed={args.seed}",
         "actor.ppo_mini_batch_size=4", *args.overrides],  # overrides may set it again
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    driver = subprocess.run(
        [str(REPO / "build/harness-venv/bin/python"), "examples/harnesses/run_harnesses.py",
         str(run_dir), "--local", "--transcripts", str(transcripts),
         "--sessions", str(args.sessions), "--wait-s", "120",
         *(["--harnesses", *args.harnesses] if args.harnesses else [])],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    _, err = run.communicate()
    if run.returncode != 0:
        print(err[-2000:])
        return 1
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    metrics = [m for m in metrics if "reward/mean" in m]
    first, last = metrics[:20], metrics[-20:]
    mean = statistics.mean
    print(f"run {run_dir}: {len(metrics)} steps, seed {args.seed}")
    print(f"  reward/mean: first 20 steps {mean(m['reward/mean'] for m in first):.3f}, "
          f"last 20 {mean(m['reward/mean'] for m in last):.3f}; "
          f"wall {metrics[-1]['time/elapsed_s']:.0f} s")  # fmt: skip
    print("  " + driver.stdout.strip().splitlines()[-1])
    sessions = [json.loads(line) for line in transcripts.open()]
    by = defaultdict(list)
    for s in sessions:
        by[s["harness"]].append(s)
    print(
        f"  {'harness':30s} sessions  calls  statuses     agent errors         "
        "reward first/last quarter"
    )
    for name, rows in by.items():
        statuses = Counter(c["status"] for s in rows for c in s["calls"])
        errors = Counter(e.split(":")[0] for s in rows for e in s["agent_errors"]) + Counter(
            (s["error"] or "").split(":")[0] for s in rows if s["error"]
        )
        q = max(1, len(rows) // 4)
        rewards = [s["outcome"]["reward"] for s in rows]
        print(f"  {name:30s} {len(rows):8d} {sum(statuses.values()):6d}  "
              f"{dict(statuses)!s:12s} {dict(errors)!s:20s} "
              f"{mean(rewards[:q]):.3f} / {mean(rewards[-q:]):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
