"""Start-up: from the launch of the default job to its first weight sync, and where the
seconds go, median over several runs; optionally side by side with another checkout.

Each run is ``python -m hpc_asyncppo.submit --cluster local`` with a few steps and no
checkpoints. The phases come from the ``start-up: PHASE at TIME (cpu SECONDS s)`` lines the
launcher writes into logs/mpirun.log and every rank into logs/rank{i}.log
(``hpc_asyncppo.runtime.startup``); a phase is the time from the previous line of the same
process (the first: from the line it follows on, e.g. a rank's Python start from mpirun's
start), in wall-clock seconds and in the CPU seconds the process used (steadier on a
shared machine; "-" where a line has none). The total is the first metrics row's
``time/unix - time/elapsed_s`` (when the trainer's clock started, right after the first
sync) minus the launch, as in bench_time_to_reward.py.

    python scripts/bench_startup.py                       # 3 runs
    python scripts/bench_startup.py --runs 5 model.tiny.num_layers=4
    python scripts/bench_startup.py --runs 5 --against ../before   # runs alternate

``--against DIR``: a checkout of other code (with the start-up lines), whose runs alternate
with this checkout's, so that drift on the machine hits both; the ratio of the medians last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpc_asyncppo.runtime.startup import PHASE  # noqa: E402

LAUNCHER = "launcher"
ROLLOUT, TRAINER = "rollout rank 0", "trainer rank 1"
Phases = dict[str, tuple[float, float | None]]  # "process: phase" -> (wall s, CPU s or None)


def run(code: Path, overrides: list[str], steps: int, run_dir: Path) -> dict:
    """One default job of the code in ``code``; its launch, first sync, end and start-up lines."""
    cmd = [sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local",
           "--run-dir", str(run_dir), f"trainer.total_steps={steps}",
           "checkpoint.save_every=0", "checkpoint.save_final=false", *overrides]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(code)}  # the ranks import from there too
    launched = time.time()
    subprocess.run(cmd, check=True, cwd=code, env=env, stdout=subprocess.DEVNULL)
    ended = time.time()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in metrics if "reward/mean" in r)
    marks = {
        LAUNCHER: read_marks(run_dir / "logs" / "mpirun.log"),
        ROLLOUT: read_marks(run_dir / "logs" / "rank0.log"),
        TRAINER: read_marks(run_dir / "logs" / "rank1.log"),
    }
    return {
        "launched": launched,
        "first_sync": first["time/unix"] - first["time/elapsed_s"],
        "ended": ended,
        "marks": marks,
    }


def read_marks(path: Path) -> dict[str, tuple[float, float | None]]:
    """phase -> (wall-clock time, CPU seconds used by then or None)."""
    marks = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        if m := PHASE.search(line):
            marks[m.group(1)] = (float(m.group(2)), float(m.group(3)) if m.group(3) else None)
    return marks


def phases(result: dict) -> Phases:
    """(wall, CPU) seconds per (process: phase), each from the previous mark of the same
    process; a rank's first from mpirun's start, the launcher's first from the launch (its
    CPU from the process's start)."""
    out: Phases = {}
    launcher = result["marks"][LAUNCHER]
    origin = {LAUNCHER: result["launched"]}
    origin[ROLLOUT] = origin[TRAINER] = launcher.get("mpirun started", (result["launched"],))[0]
    for proc, marks in result["marks"].items():
        previous, previous_cpu = origin[proc], 0.0
        for phase, (at, cpu) in sorted(marks.items(), key=lambda kv: kv[1][0]):
            out[f"{proc}: {phase}"] = (at - previous, None if cpu is None else cpu - previous_cpu)
            previous, previous_cpu = at, previous_cpu if cpu is None else cpu
    return out


def summarise(name: str, totals: list[float], runs: list[Phases]) -> float:
    """Print the medians of ``runs``; returns the median launch to the first sync."""
    print(f"{name}: median of {len(runs)} runs, each phase from the previous line of its process")
    print(f"  {'process: phase':52s}  wall s   cpu s")
    names = list(dict.fromkeys(n for r in runs for n in r))
    for phase in names:
        values = [r[phase] for r in runs if phase in r]
        wall = statistics.median(w for w, _ in values)
        cpus = [c for _, c in values if c is not None]
        cpu = f"{statistics.median(cpus):7.2f}" if len(cpus) == len(values) else "      -"
        print(f"  {phase:52s} {wall:7.2f} {cpu}")
    for proc in (LAUNCHER, ROLLOUT, TRAINER):  # the CPU of its last line: all it used
        cpu = statistics.median(
            sum(c or 0.0 for n, (_, c) in r.items() if n.startswith(proc)) for r in runs
        )
        print(f"  {proc}: CPU seconds in all {cpu:.2f}")
    total = statistics.median(totals)
    print(f"  launch to the first weight sync: {total:.2f} s (median)")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--against", type=Path, default=None, help="another checkout to compare")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    codes = {"this": REPO}
    if args.against is not None:
        codes["against"] = args.against.resolve()
    totals: dict[str, list[float]] = {name: [] for name in codes}
    runs: dict[str, list[Phases]] = {name: [] for name in codes}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            order = list(codes) if i % 2 == 0 else list(codes)[::-1]
            for name in order:
                result = run(codes[name], args.overrides, args.steps, Path(tmp) / f"{name}{i}")
                total = result["first_sync"] - result["launched"]
                totals[name].append(total)
                runs[name].append(phases(result))
                print(
                    f"{name:8s} run {i}: launch to the first weight sync {total:6.2f} s "
                    f"(whole run {result['ended'] - result['launched']:.2f} s)",
                    flush=True,
                )
    medians = {
        name: summarise(f"{name} ({codes[name]})", totals[name], runs[name]) for name in codes
    }
    if args.against is not None:
        print(
            f"launch to the first sync, against / this: {medians['against'] / medians['this']:.2f}x"
        )


if __name__ == "__main__":
    main()
