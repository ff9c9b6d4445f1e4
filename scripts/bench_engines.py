"""Generation throughput and weight-load time: the vLLM engine against the transformers one.

Both engines get the same tiny Llama (built here, random weights), the same token-id
prompts and sampling settings. Throughput counts response tokens up to each response's
length (EOS included) over wall time, after one warm-up call. Weight load: the time of
``engine.load_weights`` for a full set of new tensors (hf: in-place copies; vllm: gloo
push into the worker process, layerwise reload, prefix-cache reset).

    python scripts/bench_engines.py                       # the tiny default size
    python scripts/bench_engines.py --hidden 512 --layers 8 --heads 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument(
        "--heads", type=int, default=2, help="attention heads (head size >= 32 for vLLM on CPU)"
    )
    p.add_argument("--prompts", type=int, default=8, help="prompt groups per call")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--response-length", type=int, default=64, help="max new tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per engine")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_engines_"))
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "TORCH_COMPILE_DISABLE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(work / "vllm_cache"),
        "TMPDIR": str(work / "tmp"),
    }.items():
        os.environ.setdefault(key, value)
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    torch.set_num_threads(args.threads)

    from hpc_asyncppo.config import DataConfig, ModelConfig, RolloutConfig, TinyModelConfig
    from hpc_asyncppo.models.tiny import build_tiny_model
    from hpc_asyncppo.rollout.hf_engine import HFEngine
    from hpc_asyncppo.rollout.vllm_engine import VLLMEngine
    from hpc_asyncppo.tasks import load_task

    task = load_task(DataConfig())
    size = TinyModelConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=2 * args.hidden,
    )
    model_dir = build_tiny_model(work / "model", task.vocabulary(), size, seed=3)
    model = ModelConfig(path=str(model_dir))
    rollout = RolloutConfig(n=args.n, response_length=args.response_length)
    texts = [p.text for p in list(task.prompts())[: args.prompts]]
    params = sum(t.numel() for t in new_weights(model_dir).values())
    print(
        f"model: {params / 1e6:.2f}M parameters (hidden {args.hidden}, layers {args.layers}, "
        f"heads {args.heads}); batch: {args.prompts} prompts x n={args.n}, "
        f"up to {args.response_length} tokens; torch threads {args.threads}"
    )

    cpu = torch.device("cpu")
    results = {}
    for name in ("hf", "vllm"):
        start = time.monotonic()
        if name == "hf":
            engine = HFEngine(model, rollout, cpu)
        else:
            engine = VLLMEngine(model, rollout, cpu, max_prompt_length=16, seed=3)
        startup = time.monotonic() - start
        prompts = [engine.encode(t) for t in texts]
        engine.generate(prompts, args.n)  # warm-up
        rates, loads = [], []
        for i in range(args.repeats):
            start = time.monotonic()
            gens = engine.generate(prompts, args.n)
            elapsed = time.monotonic() - start
            tokens = sum(int(g.response_lengths.sum()) for g in gens)
            rates.append(tokens / elapsed)
            print(
                f"{name}: call {i}: {tokens} tokens in {elapsed:.3f} s = {tokens / elapsed:,.0f} tok/s"
            )
            weights = new_weights(model_dir, seed=i)
            start = time.monotonic()
            engine.load_weights(weights, version=i)
            loads.append(time.monotonic() - start)
            print(f"{name}: weight load {i}: {loads[-1] * 1e3:.1f} ms")
        engine.close()
        results[name] = (startup, statistics.median(rates), statistics.median(loads))

    print("\nengine  startup_s  tokens_per_s(median)  weight_load_ms(median)")
    for name, (startup, rate, load) in results.items():
        print(f"{name:6}  {startup:9.1f}  {rate:20,.0f}  {load * 1e3:22.1f}")
    ratio = results["vllm"][1] / results["hf"][1]
    print(f"throughput ratio vllm/hf: {ratio:.2f}x")


def new_weights(model_dir: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's tensors, perturbed: a stand-in for a trainer's update."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(model_dir / "model.safetensors"))
    return {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in tensors.items()}


if __name__ == "__main__":
    main()
