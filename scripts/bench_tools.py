"""Do tool calls overlap generation? Generation throughput with a tool that takes a random
0-2 s per call, against the same tool answering at once, side by side in one run.

A model that calls the lookup tool on every trajectory (the tiny model trained on
``data.task=tool_lookup``: this script trains one first, ~2 minutes, unless ``--model``
names one) generates on the transformers engine in this process, through the rollout
rank's own multi-turn code (``rollout/turns.py``: ``advance`` then an engine step, as
``Rollouter.step_and_send``), with ``--groups`` prompt groups of 8 kept in flight (a
finished group is replaced at once) for ``--seconds`` per measurement after a quarter of
that as warm-up, the two tools alternated over ``--rounds``. Throughput: the model's own tokens (observations not
counted) per second. A trajectory waiting for its call holds no engine time, so with
enough trajectories in flight the engine always has others to run: the ratio says how
close to the instant tool's throughput the slow tool's stays. How many are enough is
Little's law: trajectories in flight >= trajectories finished per second x the tool's
mean latency (1 s here); the tiny model on a CPU finishes hundreds a second, a 7B model
on a GPU far fewer.

    python scripts/bench_tools.py                       # trains the model, then measures
    python scripts/bench_tools.py --model RUN/export --groups 16 64
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from hpc_asyncppo.config import DataConfig, ModelConfig, MultiTurnConfig, RolloutConfig  # noqa: E402
from hpc_asyncppo.rollout.hf_engine import HFEngine  # noqa: E402
from hpc_asyncppo.rollout.turns import Turns  # noqa: E402
from hpc_asyncppo.tasks import tokenize_prompt  # noqa: E402
from hpc_asyncppo.tasks.tool_lookup import ToolLookupTask, lookup_tool_config  # noqa: E402
from hpc_asyncppo.tools.base import load_tools  # noqa: E402

LOOKUP = [
    "data.task=tool_lookup",
    "rollout.multi_turn.enable=true",
    "rollout.multi_turn.tool_config_path=tools/lookup.yaml",
    "rollout.response_length=10",
]


def train_model(work: Path) -> Path:
    run = work / "run"
    cmd = [sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local", "--run-dir",
           str(run), *LOOKUP, "trainer.total_steps=400", "checkpoint.save_every=0"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    subprocess.run([sys.executable, "-m", "hpc_asyncppo.export", str(run), str(work / "export")],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL)  # fmt: skip
    return work / "export"


def make_engine(model: Path, kind: str):
    rollout = RolloutConfig(response_length=10, n=8, engine=kind)
    if kind == "vllm":
        from hpc_asyncppo.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(ModelConfig(path=str(model)), rollout, torch.device("cpu"), 16), rollout
    return HFEngine(ModelConfig(path=str(model)), rollout, torch.device("cpu")), rollout


def measure(engine, rollout, delay: str, groups: int, seconds: float, work: Path) -> dict:
    config = work / f"tools_{abs(hash(delay))}.yaml"
    config.write_text(lookup_tool_config(delay))
    cfg = MultiTurnConfig(enable=True, tool_config_path=str(config), max_parallel_calls=8 * groups)
    turns = Turns(cfg, engine.tokenizer, load_tools(config), engine.eos_id, rollout.response_length)
    engine.turn_ends = turns.turn_ends
    prompts = ToolLookupTask(DataConfig(num_prompts=4096)).prompts()
    ids = {i: tokenize_prompt(engine.tokenizer, p) for i, p in enumerate(prompts)}
    started = 0
    for _ in range(groups):
        engine.submit((0, started), ids[started], rollout.n)
        started += 1
    tokens = idle_steps = 0
    begin = time.monotonic()
    warm = begin + seconds / 4  # the first calls all start at once: counted from here
    calls_before = None
    while time.monotonic() - begin < seconds + seconds / 4:
        if calls_before is None and time.monotonic() >= warm:
            tokens, calls_before = 0, turns.counts["tool_calls"]
        if not turns.advance(engine.groups, lambda key: prompts[key[1]]):
            idle_steps += 1
            time.sleep(0.002)
        for key, gen in engine.step():
            tokens += (
                int(gen.loss_mask.sum())
                if gen.loss_mask is not None
                else int(gen.response_lengths.sum())
            )
            turns.finish(key, rollout.n)
            engine.submit((0, started), ids[started % len(ids)], rollout.n)
            started += 1
    elapsed = time.monotonic() - warm
    engine.interrupt()
    for key, _ in engine.unfinished():  # what is left, for the next measurement's engine
        engine.groups.pop(key)
    calls = turns.counts["tool_calls"] - (calls_before or 0)
    return {
        "tokens_per_s": tokens / elapsed,
        "calls_per_s": calls / elapsed,
        "idle_steps": idle_steps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model trained on tool_lookup (HF folder)")
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--engine", choices=["hf", "vllm"], default="hf",
        help="vllm: the model needs a head size vLLM's CPU build supports (model.tiny.num_heads=2)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.engine == "vllm" and args.model is None:
        parser.error("--engine vllm needs --model: one trained with model.tiny.num_heads=2")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model or train_model(work)
        engine, rollout = make_engine(model, args.engine)
        print(f"model: {model}, engine: {args.engine}")
        print("groups  instant tok/s  slow(0-2s) tok/s  ratio   calls/s (slow)  rounds")
        for groups in args.groups:
            fast, slow, slow_calls = [], [], []
            for r in range(args.rounds):
                order = [("0", fast), ("[0, 2]", slow)]
                for delay, into in order if r % 2 == 0 else order[::-1]:
                    got = measure(engine, rollout, delay, groups, args.seconds, work)
                    into.append(got["tokens_per_s"])
                    if into is slow:
                        slow_calls.append(got["calls_per_s"])
            f, s = statistics.median(fast), statistics.median(slow)
            print(f"{groups:6d}  {f:13.0f}  {s:16.0f}  {s / f:5.2f}   {statistics.median(slow_calls):14.1f}  "
                  f"{args.rounds}: " + " ".join(f"{b / a:.2f}" for a, b in zip(fast, slow, strict=True)))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
