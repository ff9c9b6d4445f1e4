"""The hf engine on long-tailed responses: whole-response batches against continuous
batching (``rollout.hf_step_tokens``), side by side.

Both engines get the same tiny Llama (built here, random weights) and the long-tail task's
prompts in the same order, with each response's length fixed to what the task asks (the
short answer's 5 tokens or the long one's 49: ``Response.limit``, EOS ignored), so the
batches differ only in how they are run. ``--groups`` groups of n are kept in flight, as
the rollout rank keeps ``rollout.prompts_per_generate``: whole-response steps
(``hf_step_tokens=0``) take them in batches that run to their longest response; continuous
steps let a finished group leave and a new one join every k tokens. Throughput: the
samples of the first ``--count`` groups submitted over the time until all of them have
finished (later groups keep the batch full meanwhile; nothing favours the short ones).

    python scripts/bench_hf_steps.py
    python scripts/bench_hf_steps.py --steps 1 2 4 8 --hidden 256 --layers 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[4], help="hf_step_tokens to try")
    p.add_argument("--groups", type=int, default=16, help="groups in flight")
    p.add_argument("--n", type=int, default=8, help="responses per group")
    p.add_argument("--count", type=int, default=128, help="groups timed per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per setting (alternated)")
    p.add_argument("--hidden", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    from hpc_asyncppo.config import DataConfig, ModelConfig, RolloutConfig, TinyModelConfig
    from hpc_asyncppo.models.tiny import build_tiny_model
    from hpc_asyncppo.rollout.hf_engine import HFEngine
    from hpc_asyncppo.tasks import load_task
    from hpc_asyncppo.tasks.long_tail import need

    task = load_task(DataConfig(task="long_tail"))
    size = TinyModelConfig(
        hidden_size=args.hidden, num_layers=args.layers, intermediate_size=2 * args.hidden
    )
    model_dir = build_tiny_model(
        Path(tempfile.mkdtemp(prefix="bench_hf_steps_")) / "model", task.vocabulary(), size, 3
    )
    model = ModelConfig(path=str(model_dir))
    prompts = list(task.prompts())
    engines = {}
    for k in [0, *args.steps]:
        rollout = RolloutConfig(n=args.n, response_length=56, ignore_eos=True, hf_step_tokens=k)
        engines[k] = HFEngine(model, rollout, torch.device("cpu"))
    long = sum(need(p) > 4 for p in prompts[: args.count])
    print(
        f"{args.count} groups x n={args.n} ({long} long), {args.groups} in flight; model "
        f"hidden {args.hidden}, layers {args.layers}; one torch thread"
    )

    def run(k: int) -> float:
        engine, submitted, timed = engines[k], 0, set(range(args.count))
        torch.manual_seed(0)
        start = time.monotonic()
        while timed:
            if k > 0 or engine.in_flight == 0:  # whole-response steps: a batch at a time
                while engine.in_flight < args.groups:
                    prompt = prompts[submitted % len(prompts)]
                    engine.submit(submitted, engine.encode(prompt.text), args.n)
                    for r in engine.groups[submitted].responses:
                        r.limit = need(prompt) + 1  # the answer and the end of the response
                    submitted += 1
            timed -= {key for key, _ in engine.step()}
        elapsed = time.monotonic() - start
        while engine.in_flight:  # drain before the next run
            engine.step()
        return args.count * args.n / elapsed

    rates: dict[int, list[float]] = {k: [] for k in engines}
    for repeat in range(args.repeats):
        for k in engines:
            rates[k].append(run(k))
            print(f"repeat {repeat}: hf_step_tokens={k}: {rates[k][-1]:,.0f} samples/s")
    whole = statistics.median(rates[0])
    print("\nhf_step_tokens  samples/s (median)  / whole-response steps")
    for k, rate in rates.items():
        print(f"{k:14}  {statistics.median(rate):18,.0f}  {statistics.median(rate) / whole:.2f}x")


if __name__ == "__main__":
    main()
