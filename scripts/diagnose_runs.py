"""Why a run did or did not learn: its metrics over tenths of its steps, side by side with
other runs' (the runs a seed sweep kept: ``bench_time_to_reward.py --keep DIR``).

Per run and tenth of its steps: the mean reward, the policy's entropy (nats per token),
the rollout-to-trainer KL (``rollout_corr/k3_kl``), the share of importance weights the
correction masked or truncated, the mean staleness of the samples trained, how many weight
versions one response spanned (partial rollout: ``param_version_end -
param_version_start`` of the samples trained), the share of groups with no reward
variance, the mean response length, and the collapse signs the trainer named. On the
long-tail task (``data.task=long_tail``) also the reward, staleness and version span of
the long prompts' samples alone (the ones a reward above 0.75 needs).

    python scripts/diagnose_runs.py /var/tmp/sweep/s1-11 /var/tmp/sweep/s1-12
    python scripts/diagnose_runs.py /var/tmp/sweep/*          # every kept run
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpc_asyncppo.config import load_resolved  # noqa: E402
from hpc_asyncppo.runlog import read_jsonl, split_metrics  # noqa: E402
from hpc_asyncppo.tasks import load_task, long_tail  # noqa: E402

MASKED = ("rollout_corr/is_masked_fraction", "rollout_corr/is_truncated_fraction")


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def long_prompts(run_dir: Path) -> set[int] | None:
    """The indices of the long-tail task's long prompts; None for another task."""
    cfg = load_resolved(run_dir / "config.yaml")
    if cfg.data.task != "long_tail":
        return None
    prompts = load_task(cfg.data).prompts()
    return {p.index for p in prompts if long_tail.need(p) == long_tail.LONG}


def tenths(run_dir: Path) -> list[dict]:
    rows = split_metrics(read_jsonl(run_dir / "metrics.jsonl"))[0]
    longs = long_prompts(run_dir)
    spans: dict[int, list[int]] = {}
    long_samples: dict[int, list[dict]] = {}
    for s in read_jsonl(run_dir / "trained_samples.jsonl"):
        spans.setdefault(s["step"], []).append(s["param_version_end"] - s["param_version_start"])
        if longs is not None and int(s["uid"].split("-")[2][1:]) in longs:
            long_samples.setdefault(s["step"], []).append(s)
    size = max(1, len(rows) // 10)
    out = []
    for i in range(0, len(rows), size):
        part = rows[i : i + size]
        steps = [r["step"] for r in part]
        masked = next((k for k in MASKED if k in part[0]), None)
        out.append({
            "steps": f"{steps[0]}-{steps[-1]}",
            "reward": mean([r["reward/mean"] for r in part]),
            "entropy": mean([r["actor/entropy"] for r in part if "actor/entropy" in r]),
            "kl": mean([r["rollout_corr/k3_kl"] for r in part if "rollout_corr/k3_kl" in r]),
            "masked": mean([r[masked] for r in part]) if masked else float("nan"),
            "staleness": mean([r["staleness/mean"] for r in part]),
            "span": mean([v for s in steps for v in spans.get(s, [])]),
            "zero_var": mean([r["batch/zero_variance_groups"] for r in part]),
            "length": mean([r["response_length/mean"] for r in part]),
            "signs": [r["collapse/line"] for r in part if "collapse/line" in r],
        })  # fmt: skip
        if longs is not None:
            mine = [x for step in steps for x in long_samples.get(step, [])]
            out[-1]["long"] = {
                "reward": mean([x["reward"] for x in mine]),
                "staleness": mean([x["staleness"] for x in mine]),
                "span": mean([x["param_version_end"] - x["param_version_start"] for x in mine]),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args()
    for run_dir in args.runs:
        if not (run_dir / "metrics.jsonl").exists():
            continue
        print(f"{run_dir}:")
        rows = tenths(run_dir)
        extra = "  | long: reward  stale  span" if "long" in rows[0] else ""
        print("  steps      reward  entropy  k3_kl   masked  stale  span  zero_var  length" + extra)
        for t in rows:
            line = (f"  {t['steps']:9s}  {t['reward']:6.3f}  {t['entropy']:7.3f}  {t['kl']:6.4f}  "
                    f"{t['masked']:6.3f}  {t['staleness']:5.2f}  {t['span']:4.2f}  "
                    f"{t['zero_var']:8.2f}  {t['length']:6.1f}")  # fmt: skip
            if "long" in t:
                lg = t["long"]
                line += f"  |  {lg['reward']:11.3f}  {lg['staleness']:5.2f}  {lg['span']:4.2f}"
            print(line)
            for line in t["signs"]:
                print(f"    {line}")


if __name__ == "__main__":
    main()
