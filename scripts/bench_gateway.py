"""The gateway's cost: your own agent (``data.agent``) against the project's in-process
tools, on the same task, engine, ranks and sample budget, side by side in one run; the
latency a call gains by going through the gateway; and many concurrent sessions on one
rank.

1. ``throughput``: the lookup task (``data.task=tool_lookup``) run by ``submit`` as the
   in-process multi-turn tool loop and as ``examples/lookup_agent.py`` (the same task
   written with the ``openai`` client), runs alternated, ``--repeats`` each: samples/s
   (the last step's ``samples/total`` over ``time/elapsed_s``), medians, and the ratio
   agent / in-process.
2. ``latency``: one rank's gateway (uvicorn, the real sessions, the transformers engine on
   the tiny lookup model) driven by one session at a time through the ``openai`` client:
   a call's round trip minus the engine's own time for its turn (engine.step, timed in the
   rank's loop) is what the gateway adds (HTTP, JSON, the chat template, the hand-over
   between the server's thread and the rank's loop). Median and 90th percentile per call.
3. ``concurrent``: ``--sessions`` sessions (groups of ``rollout.n`` = 8) open at once on
   that rank, each run by the lookup agent in a thread of its own (as ``data.agent`` runs
   a plain function): every session ends, the wall time, calls/s,
   the call latency's median and 99th percentile, and the process's peak RSS.

    python scripts/bench_gateway.py                         # all three, hf engine
    python scripts/bench_gateway.py --only latency concurrent --sessions 256
    python scripts/bench_gateway.py --only throughput --engine vllm
    python scripts/bench_gateway.py --only throughput --engine vllm -- \
        model.tiny.hidden_size=256 model.tiny.num_layers=4 model.tiny.intermediate_size=512

Absolute times drift with this machine's neighbours; the ratio of part 1 and the added
latency (a difference measured in the same calls) hold.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = {
    "in_process": [
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tool_config_path=tools/lookup.yaml",
    ],
    "agent": ["data.agent=examples.lookup_agent:run"],
}
TASK = ["data.task=tool_lookup", "rollout.response_length=10"]
WIDTH = 10


def throughput(args: argparse.Namespace) -> None:
    extra = f", {' '.join(args.overrides)}" if args.overrides else ""
    print(f"== throughput: {args.steps} steps per run, engine {args.engine}{extra}, runs "
          "alternated")  # fmt: skip
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    engine = [f"rollout.engine={args.engine}"]
    env = dict(os.environ)
    if args.engine == "vllm":  # offline, no torch.compile, a 1 GiB KV cache, a head size
        engine.append("model.tiny.num_heads=2")  # vLLM's CPU build takes
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                   TORCH_COMPILE_DISABLE="1")  # fmt: skip
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        for repeat in range(args.repeats):
            for mode, overrides in MODES.items():
                run_dir = Path(tmp) / f"{mode}-{repeat}"
                cmd = [sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local",
                       "--run-dir", str(run_dir), f"trainer.total_steps={args.steps}",
                       f"trainer.seed={repeat + 1}", "checkpoint.save_every=0",
                       *engine, *TASK, *overrides, *args.overrides]  # fmt: skip
                subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, env=env)
                rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
                last = [r for r in rows if "samples/total" in r][-1]
                rate = last["samples/total"] / last["time/elapsed_s"]
                rates[mode].append(rate)
                # which side bounds the pipeline: the one that waits less
                idle = f"idle trainer {last['trainer/idle_ratio']:.2f} rollout " \
                       f"{last['rollouter/idle_ratio']:.2f}"  # fmt: skip
                print(f"  {mode:10s} seed {repeat + 1}: {rate:7.1f} samples/s, {idle}")
    med = {mode: statistics.median(v) for mode, v in rates.items()}
    print(f"  median samples/s: in_process {med['in_process']:.1f}, agent {med['agent']:.1f}")
    print(f"  ratio agent / in_process: {med['agent'] / med['in_process']:.2f}x")


class Rank(threading.Thread):
    """The rollout rank's loop as far as sessions go (``Rollouter.step_and_send``), the
    engine's time per step added up."""

    def __init__(self, engine, sessions):
        super().__init__(daemon=True)
        self.engine, self.sessions = engine, sessions
        self.opening: list = []
        self.ended = 0
        self.engine_s = 0.0
        self.halt = False
        self.lock = threading.Lock()

    def generate(self):
        t = time.perf_counter()
        out = self.engine.step()
        self.engine_s += time.perf_counter() - t
        return out

    def open(self, key, prefix, prompt, n) -> None:
        with self.lock:
            self.opening.append((key, prefix, prompt, n))

    def run(self) -> None:
        while not self.halt:
            with self.lock:
                opening, self.opening = self.opening, []
            for key, prefix, prompt, n in opening:
                self.sessions.open_group(key, prefix, prompt, n)
            for key, _gen in self.sessions.step(self.engine, self.generate):
                self.sessions.finish(key)
                self.ended += 1
            if not self.sessions.groups and not opening:
                time.sleep(0.001)


def serve(root: Path, width: int):
    """One rank's gateway in front of the transformers engine on the tiny lookup model."""
    import torch
    import transformers

    from hpc_asyncppo.config import DataConfig, ModelConfig, RolloutConfig, TinyModelConfig
    from hpc_asyncppo.models.tiny import build_tiny_model
    from hpc_asyncppo.rollout.gateway.addresses import make_token
    from hpc_asyncppo.rollout.gateway.requests import Fields
    from hpc_asyncppo.rollout.gateway.server import Gateway, make_app
    from hpc_asyncppo.rollout.gateway.sessions import Sessions
    from hpc_asyncppo.rollout.hf_engine import HFEngine
    from hpc_asyncppo.rollout.rollouter import GATHER_S
    from hpc_asyncppo.tasks.tool_lookup import CHAT_TEMPLATE, ToolLookupTask

    transformers.utils.logging.disable_progress_bar()
    task = ToolLookupTask(DataConfig(num_prompts=64))
    model_dir = build_tiny_model(root / "model", task.vocabulary(), TinyModelConfig(), 1,
                                 CHAT_TEMPLATE)  # fmt: skip
    engine = HFEngine(ModelConfig(path=str(model_dir)), RolloutConfig(response_length=width),
                      torch.device("cpu"))  # fmt: skip
    sessions = Sessions(engine.tokenizer, engine.eos_id, width, 256, timeout_s=600,
                        gather_s=GATHER_S)  # fmt: skip
    engine.turn_ends = sessions.turn_ends
    token = make_token(root)
    app = make_app(sessions, token, "tiny", Fields({"temperature": 1.0, "top_p": 1.0}), 2**23)
    gateway = Gateway(app, "127.0.0.1", 0)
    rank = Rank(engine, sessions)
    rank.start()
    return task, rank, gateway, token


def timed_client(client, latencies: list[float]):
    """``client`` with each chat call's round trip appended to ``latencies``."""

    def create(**kw):
        t = time.perf_counter()
        out = client.chat.completions.create(**kw)
        latencies.append(time.perf_counter() - t)
        return out

    return types.SimpleNamespace(
        chat=types.SimpleNamespace(completions=types.SimpleNamespace(create=create))
    )


def latency(args: argparse.Namespace, root: Path) -> None:
    import httpx
    import openai

    from examples.lookup_agent import run as lookup
    from hpc_asyncppo.rollout.gateway.agents import AgentRow

    print(f"== latency: {args.calls_sessions} sessions one at a time, hf engine, tiny model")
    task, rank, gateway, token = serve(root / "latency", WIDTH)
    http = httpx.Client(timeout=None)
    prompts = task.prompts()
    added, rounds = [], []
    try:
        for i in range(args.calls_sessions):
            prompt = prompts[i % len(prompts)]
            sid = f"s1-e{i}-p{prompt.index}-r0"
            rank.open(("lat", i), f"s1-e{i}-p{prompt.index}", prompt, 1)
            while sid not in rank.sessions.by_id:
                time.sleep(0.0005)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/sessions/{sid}/v1",
                                   api_key=token, max_retries=0, http_client=http)  # fmt: skip
            calls: list[float] = []
            engine_before = rank.engine_s
            outcome = lookup(timed_client(client, calls), AgentRow.of(prompt, sid))
            engine_s = rank.engine_s - engine_before
            rank.sessions.end(sid, outcome).result(timeout=60)
            if i < 5:  # warm-up: first compilations, connections
                continue
            rounds.extend(calls)
            added.append((sum(calls) - engine_s) / len(calls))
    finally:
        rank.halt = True
        gateway.close()
    q = statistics.quantiles
    print(f"  calls: {len(rounds)}; round trip median {statistics.median(rounds) * 1e3:.1f} ms")
    print(f"  added by the gateway per call (round trip - engine time): median "
          f"{statistics.median(added) * 1e3:.1f} ms, p90 {q(added, n=10)[-1] * 1e3:.1f} ms")  # fmt: skip


def concurrent(args: argparse.Namespace, root: Path) -> None:
    import httpx
    import openai

    from examples.lookup_agent import run as lookup
    from hpc_asyncppo.rollout.gateway.agents import KEEPALIVE_S, AgentRow

    n = 8
    groups = max(1, args.sessions // n)
    print(f"== concurrent: {groups * n} sessions at once on one rank ({groups} groups of {n}),"
          " a thread each")  # fmt: skip
    task, rank, gateway, token = serve(root / "concurrent", WIDTH)
    prompts = task.prompts()
    calls: list[float] = []
    local = threading.local()

    def one(sid, prompt):
        if getattr(local, "http", None) is None:
            local.http = httpx.Client(
                timeout=None, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S)
            )
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/sessions/{sid}/v1",
                               api_key=token, max_retries=0, http_client=local.http)  # fmt: skip
        outcome = lookup(timed_client(client, calls), AgentRow.of(prompt, sid))
        rank.sessions.end(sid, outcome).result(timeout=600)
        return outcome

    sids = []
    for g in range(groups):
        prompt = prompts[g % len(prompts)]
        rank.open(("many", g), f"s1-e{g}-p{prompt.index}", prompt, n)
        sids += [(f"s1-e{g}-p{prompt.index}-r{j}", prompt) for j in range(n)]
    try:
        while len(rank.sessions.by_id) < len(sids):
            time.sleep(0.001)
        t = time.perf_counter()
        with ThreadPoolExecutor(len(sids)) as pool:
            outcomes = list(pool.map(lambda a: one(*a), sids))
        wall = time.perf_counter() - t
        deadline = time.monotonic() + 60
        while rank.ended < groups and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        rank.halt = True
        gateway.close()
    q = statistics.quantiles(calls, n=100)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  sessions ended: {len(outcomes)} of {len(sids)}; groups finished {rank.ended} "
          f"of {groups}; mean reward {statistics.fmean(o['reward'] for o in outcomes):.3f}")  # fmt: skip
    print(f"  wall {wall:.1f} s, {len(calls)} calls, {len(calls) / wall:.1f} calls/s; call "
          f"latency median {statistics.median(calls) * 1e3:.0f} ms, p99 {q[98] * 1e3:.0f} ms")  # fmt: skip
    print(f"  peak RSS of the process (engine, server, agents): {peak_mb:.0f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=["throughput", "latency", "concurrent"],
                        default=["throughput", "latency", "concurrent"])  # fmt: skip
    parser.add_argument("--steps", type=int, default=60, help="per throughput run")
    parser.add_argument("--repeats", type=int, default=2, help="throughput runs per mode")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--calls-sessions", type=int, default=40, help="latency: sessions")
    parser.add_argument("--sessions", type=int, default=256, help="concurrent sessions")
    parser.add_argument("overrides", nargs="*", help="throughput: config overrides for both "
                        "modes' runs (e.g. a larger model: model.tiny.hidden_size=256)")  # fmt: skip
    args = parser.parse_args()
    if "throughput" in args.only:
        throughput(args)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        if "latency" in args.only:
            latency(args, Path(tmp))
        if "concurrent" in args.only:
            concurrent(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
