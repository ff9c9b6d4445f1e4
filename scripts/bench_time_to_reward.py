"""Time to reward: sync against fully_async (default, and any configuration given), on the
same ranks, task and sample budget, several seeds, runs alternated.

Per run it reads ``metrics.jsonl``: the first step whose rolling mean reward (over
``--window`` steps) reaches ``--target``, and when that step was logged, counted from the
launch of ``submit`` (start-up included) and from the first weight sync (training only,
``time/elapsed_s``); the start-up (launch to the first weight sync: the first row's
``time/unix - time/elapsed_s``, when the trainer's clock started); samples per second, both
idle ratios (the last step's) and the mean staleness. Per mode it prints the medians over
the seeds and the ratios to sync (time to reward: sync / mode, > 1 is faster than sync),
and how it learned over the seeds: how many reached the target, the final reward's mean,
spread and worst seed and, with ``--greedy-val``, the greedy validation reward at the end
on the task's held-out prompts (``held_out_prompts`` of ``next_digit``, as the learning
tests, or of ``long_tail``).

As a seed sweep it says of every run whether it reached the target and whether it *held*
it (the mean reward of the last 10% of its steps at or above the target less
``--hold-margin``), and which collapse signs the trainer named (``trainer/collapse.py``: a
healthy run names none); per mode, how many seeds reached and held it and the median time
to the target. ``--keep DIR`` keeps every run directory (DIR/MODE-SEED) for reading
afterwards (``python -m hpc_asyncppo.report DIR/MODE-SEED``).

    python scripts/bench_time_to_reward.py --no-sync --steps 700 --seeds 1 2 3 4 5 6 7 8 9 10 \
        --keep /var/tmp/sweep async_training.staleness_threshold=1.0   # every seed learns?

    python scripts/bench_time_to_reward.py                          # sync vs fully_async, seeds 1 2
    python scripts/bench_time_to_reward.py --no-sync --greedy-val --seeds 1 2 3 4 5 \
        --mode "lr5e-4=actor.lr=5e-4"                                # defaults: learning over seeds
    python scripts/bench_time_to_reward.py --steps 300 --seeds 1 2 3 \\
        --mode "stale0.5=async_training.staleness_threshold=0.5" \\
        --mode "stale0.5_is=async_training.staleness_threshold=0.5 algorithm.rollout_is=token"
    python scripts/bench_time_to_reward.py --no-sync --no-default --steps 600 \\
        --mode "in_process=rollout.multi_turn.enable=true rollout.multi_turn.tool_config_path=tools/lookup.yaml" \\
        --mode "agent=data.agent=examples.lookup_agent:run" \\
        --seeds 1 2 3 -- data.task=tool_lookup rollout.response_length=10   # an agent vs tools
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpc_asyncppo.runlog import split_metrics  # noqa: E402
from hpc_asyncppo.tasks import long_tail, next_digit  # noqa: E402
from hpc_asyncppo.tasks.next_digit import LEARNED_REWARD, write_prompts  # noqa: E402

HELD_OUT = {"next_digit": next_digit.held_out_prompts, "long_tail": long_tail.held_out_prompts}

VAL_PROMPTS = 128


def run(overrides: list[str], steps: int, seed: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local",
           "--run-dir", str(run_dir), f"trainer.total_steps={steps}",
           f"trainer.seed={seed}", "checkpoint.save_every=0", *overrides]  # fmt: skip
    launched = time.time()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps, vals = split_metrics(rows)
    return {"launched": launched, "rows": steps, "vals": vals}


def measure(result: dict, window: int, target: float, hold_margin: float = 0.05) -> dict:
    rows = result["rows"]
    reached = None
    for i in range(window - 1, len(rows)):
        if statistics.fmean(r["reward/mean"] for r in rows[i - window + 1 : i + 1]) >= target:
            reached = rows[i]
            break
    last, first = rows[-1], rows[0]
    tail = statistics.fmean(r["reward/mean"] for r in rows[-max(1, len(rows) // 10) :])
    return {
        "last10": tail,  # the mean reward of the last 10% of the steps
        "held": reached is not None and tail >= target - hold_margin,
        "collapse": [r["collapse/line"] for r in rows if "collapse/line" in r],
        "startup_s": first["time/unix"] - first["time/elapsed_s"] - result["launched"],
        "step": reached["step"] if reached else None,
        "from_launch_s": reached["time/unix"] - result["launched"] if reached else None,
        "from_sync_s": reached["time/elapsed_s"] if reached else None,
        "samples_per_s": last["samples/total"] / last["time/elapsed_s"],
        "trainer_idle": last["trainer/idle_ratio"],
        "rollout_idle": last["rollouter/idle_ratio"],
        "staleness": statistics.fmean(r["staleness/mean"] for r in rows),
        # real tokens trained per second of the trainer's updates (its waits left out)
        "trainer_tokens_per_s": sum(r["tokens/trained"] for r in rows)
        / sum(r["time/train_s"] for r in rows),
        "final_reward": statistics.fmean(r["reward/mean"] for r in rows[-window:]),
        "greedy_val": result["vals"][-1]["val/reward/mean"] if result["vals"] else None,
    }


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) else None


def fmt(v: float | None, spec: str = "7.2f") -> str:
    return format(v, spec) if v is not None else "  never"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--target", type=float, default=LEARNED_REWARD)
    parser.add_argument(
        "--hold-margin",
        type=float,
        default=0.05,
        help="held: the last 10%% of the steps' mean reward at least the target less this",
    )
    parser.add_argument("--keep", type=Path, help="keep each run's directory in KEEP/MODE-SEED")
    parser.add_argument(
        "--mode",
        action="append",
        default=[],
        help='another mode: "NAME=key=value key=value ..." (fully_async plus these)',
    )
    parser.add_argument("--no-sync", action="store_true", help="leave out the sync mode")
    parser.add_argument(
        "--no-default", action="store_true", help="leave out fully_async without --mode's"
    )
    parser.add_argument(
        "--greedy-val",
        action="store_true",
        help="validate greedily on held-out prompts before training and at the end",
    )
    parser.add_argument("overrides", nargs="*", help="key=value for every mode")
    args = parser.parse_args()
    modes = {} if args.no_sync else {"sync": ["async_training.mode=sync"]}
    if not args.no_default:
        modes["fully_async"] = []
    for spec in args.mode:
        name, _, rest = spec.partition("=")
        modes[name] = rest.split()
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.keep or Path(tmp)
        if args.greedy_val:
            task = [o.partition("=")[2] for o in args.overrides if o.startswith("data.task=")]
            held_out = HELD_OUT.get(task[-1] if task else "next_digit")
            if held_out is None:
                parser.error(f"--greedy-val: no held-out prompts for data.task={task[-1]}")
            write_prompts(Path(tmp) / "val.jsonl", held_out(VAL_PROMPTS))
            args.overrides += [
                f"data.val={Path(tmp) / 'val.jsonl'}",
                f"trainer.test_freq={args.steps}",
            ]
        for i, seed in enumerate(args.seeds):
            names = list(modes) if i % 2 == 0 else list(modes)[::-1]  # alternate the order
            for name in names:
                out = measure(
                    run(
                        [*args.overrides, *modes[name]],
                        args.steps,
                        seed,
                        runs / f"{name}-{seed}",
                    ),
                    args.window,
                    args.target,
                    args.hold_margin,
                )
                out["seed"] = seed
                results[name].append(out)
                print(
                    f"{name:14s} seed {seed}: reward {args.target} (rolling {args.window}) at step "
                    f"{out['step']}, {fmt(out['from_launch_s'])} s from launch, "
                    f"{fmt(out['from_sync_s'])} s from the first sync (start-up "
                    f"{out['startup_s']:.2f} s); {out['samples_per_s']:.0f} "
                    f"samples/s, idle trainer {out['trainer_idle']:.2f} rollout "
                    f"{out['rollout_idle']:.2f}, staleness {out['staleness']:.2f}, final reward "
                    f"{out['final_reward']:.3f}, greedy validation {fmt(out['greedy_val'], '.3f')}"
                    f", trainer {out['trainer_tokens_per_s']:.0f} tokens/s; last 10% "
                    f"{out['last10']:.3f} ({'held' if out['held'] else 'not held'}), "
                    f"{len(out['collapse'])} collapse signs",
                    flush=True,
                )
    base_mode = "sync" if "sync" in results else next(iter(results))  # the ratios' base
    print(f"{args.steps} steps, seeds {args.seeds}; medians (never: a seed did not reach it)")
    print("mode            launch s  sync s  start-up s  samples/s  idle tr/ro  staleness  "
          f"reward  ratio to {base_mode} (launch, sync)")  # fmt: skip
    base = {k: median([r[k] for r in results[base_mode]]) for k in ("from_launch_s", "from_sync_s")}
    for name, rs in results.items():
        m = {k: median([r[k] for r in rs]) for k in rs[0] if k not in ("collapse", "held")}
        ratios = [
            base[k] / m[k] if base[k] is not None and m[k] else None
            for k in ("from_launch_s", "from_sync_s")
        ]
        print(
            f"{name:14s} {fmt(m['from_launch_s'])} {fmt(m['from_sync_s'])} "
            f"{m['startup_s']:11.2f} {m['samples_per_s']:10.0f}  "
            f"{m['trainer_idle']:.2f}/{m['rollout_idle']:.2f}"
            f"  {m['staleness']:9.2f}  {m['final_reward']:.3f}  "
            f"{fmt(ratios[0], '.2f')}x {fmt(ratios[1], '.2f')}x"
        )
    # Time to reward from the first sync = steps to reach it x seconds per step: a mode's
    # time against sync's is the product of the two ratios below. Sync's seconds per step
    # are generation plus update, fully_async's at best the longer of the two (the trainer
    # is the bottleneck when its idle ratio is low), so its per-step ratio is above
    # update / (generation + update); stale samples show in the steps ratio.
    print(f"mode            steps to reward  s per step  steps / {base_mode}'s  s per step / ditto"
          "  trainer tokens/s  / ditto")  # fmt: skip
    per_step = {
        name: [r["from_sync_s"] / r["step"] if r["step"] else None for r in rs]
        for name, rs in results.items()
    }
    base_steps = median([r["step"] for r in results[base_mode]])
    base_per_step = median(per_step[base_mode])
    base_tokens = median([r["trainer_tokens_per_s"] for r in results[base_mode]])
    for name, rs in results.items():
        steps, seconds = median([r["step"] for r in rs]), median(per_step[name])
        steps_ratio = steps / base_steps if steps and base_steps else None
        step_ratio = seconds / base_per_step if seconds and base_per_step else None
        tokens = median([r["trainer_tokens_per_s"] for r in rs])
        print(
            f"{name:14s} {fmt(steps, '16.1f')}  {fmt(seconds, '10.4f')}  "
            f"{fmt(steps_ratio, '13.2f')}x  {fmt(step_ratio, '18.2f')}x"
            f"  {tokens:16.0f}  {tokens / base_tokens:6.2f}x"
        )

    print(f"learning over {len(args.seeds)} seeds: reached {args.target} (rolling {args.window}), "
          f"the step it did (median, range), final reward (last {args.window} steps: mean +- sd, "
          "worst), greedy validation at the end (mean, worst)")  # fmt: skip
    for name, rs in results.items():
        steps = [r["step"] for r in rs if r["step"] is not None]
        finals = [r["final_reward"] for r in rs]
        vals = [r["greedy_val"] for r in rs if r["greedy_val"] is not None]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        reached = f"{len(steps)}/{len(rs)}"
        at = f"{statistics.median(steps):.0f} ({min(steps)}-{max(steps)})" if steps else "never"
        greedy = f"{statistics.fmean(vals):.3f} {min(vals):.3f}" if vals else "-"
        print(
            f"{name:14s} {reached:>5s}  {at:>15s}  {statistics.fmean(finals):.3f} +- {spread:.3f}"
            f" {min(finals):.3f}  {greedy}"
        )
    print_sweep(results, args.target, args.hold_margin)


def print_sweep(results: dict[str, list[dict]], target: float, margin: float) -> None:
    """Per mode and seed: reached the target (step, seconds from the first sync), held it,
    the last 10% of the steps' mean, the collapse signs named; then per mode the counts and
    the median time to the target over the seeds that reached it."""
    print(f"seed sweep: reached {target}, held it (last 10% of the steps >= {target - margin:.2f})"
          ", collapse signs named")  # fmt: skip
    print("mode            seed  reached at (s from sync)  last 10%  held  collapse signs")
    for name, rs in results.items():
        for r in rs:
            at = f"{r['step']} ({r['from_sync_s']:.0f} s)" if r["step"] else "never"
            signs = "; ".join(line.split(": ", 1)[1][:60] for line in r["collapse"]) or "-"
            print(f"{name:14s} {r['seed']:5d}  {at:>24s}  {r['last10']:8.3f}  "
                  f"{'yes' if r['held'] else 'no':>4s}  {signs}")  # fmt: skip
    for name, rs in results.items():
        times = [r["from_sync_s"] for r in rs if r["step"]]
        median_s = f"{statistics.median(times):.0f} s" if times else "-"
        print(f"{name:14s} reached {sum(bool(r['step']) for r in rs)}/{len(rs)}, held "
              f"{sum(r['held'] for r in rs)}/{len(rs)}, median time to {target} from the first "
              f"sync {median_s}, collapse signs on {sum(bool(r['collapse']) for r in rs)} runs")  # fmt: skip


if __name__ == "__main__":
    main()
