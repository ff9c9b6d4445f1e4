"""GPU check of the vLLM rollout path: weights from a trainer into vLLM's workers, and a few
async steps.

On a machine with CUDA GPUs and vLLM (bash scripts/gpu_check.sh runs hpc_asyncppo.gpu_check
first, then this):
  1. with 2+ GPUs, a trainer process (cuda:1) is rank 0 of the weight group and the vLLM
     worker (cuda:0) its member, as in a run (NCCL; the rollout process only drives the
     engine: ``join_weights``, ``update_weights``); with one GPU the rollout process sends
     the weights itself (``VLLMEngine.load_weights``, gloo through host memory: NCCL
     refuses two members on one device);
  2. the worker loads them through vLLM's loader (layerwise reload, prefix-cache reset),
     digests what it loaded, and sampling changes;
  3. a few async steps with partial rollout: generate, cut at a sync, resume.
It prints tokens/s and sync times. Without CUDA it exits with status 2 at once.

    python scripts/gpu_check.py [--model HF_FOLDER] [--prompts 64] [--n 8] [--tokens 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="HF model folder; empty: a tiny random Llama")
    p.add_argument("--prompts", type=int, default=64, help="prompt groups")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--tokens", type=int, default=256, help="max new tokens per response")
    p.add_argument("--syncs", type=int, default=3, help="weight syncs in the async phase")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False): nothing run",
            file=sys.stderr,
        )
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    model_dir = Path(args.model) if args.model else tiny_model(work)
    gpus = torch.cuda.device_count()
    print(f"gpu_check: {gpus} GPU(s): {torch.cuda.get_device_name(0)}; model {model_dir}")
    port = free_port()
    if gpus >= 2:
        trainer = torch.multiprocessing.get_context("spawn").Process(
            target=trainer_process, args=(str(model_dir), port, args.syncs + 1)
        )
        trainer.start()
        rc = rollout_process(args, model_dir, port, nccl=True)
        trainer.join(timeout=600)
        return rc or trainer.exitcode or 0
    print("gpu_check: one GPU: the NCCL trainer->rollout broadcast needs two, skipped")
    return rollout_process(args, model_dir, port, nccl=False)


def tiny_model(work: Path) -> Path:
    from hpc_asyncppo.config import DataConfig, TinyModelConfig
    from hpc_asyncppo.models.tiny import build_tiny_model
    from hpc_asyncppo.tasks import load_task

    size = TinyModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512)
    return build_tiny_model(work / "model", load_task(DataConfig()).vocabulary(), size, seed=3)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perturbed(model_dir: Path, seed: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(
                0.01
                * p.abs().mean()
                * torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype)
            )
    return [(n, p.detach()) for n, p in model.named_parameters()]


def weight_group_spec(port: int):
    from hpc_asyncppo.transport.weight_group import WeightGroupSpec

    return WeightGroupSpec("127.0.0.1", port, world_size=2, backend="nccl", timeout_s=600)


def trainer_process(model_dir: str, port: int, versions: int) -> None:
    """Rank 0 of the weight group on cuda:1: the trainer leader's side of every sync."""
    from hpc_asyncppo.runlog import WeightDigest
    from hpc_asyncppo.transport.weight_group import open_weight_group
    from hpc_asyncppo.transport.weights import WeightBroadcaster

    torch.cuda.set_device(1)
    group = open_weight_group(weight_group_spec(port), 0)
    sender = WeightBroadcaster(group, 0, bucket_mb=512, device=torch.device("cuda", 1))
    for version in range(versions):
        digest = WeightDigest()
        named = perturbed(Path(model_dir), version, torch.device("cuda", 1))
        seconds = sender.broadcast(version, named, on_tensor=digest.add)
        print(f"trainer: broadcast v{version} in {seconds:.3f} s, digest {digest.hexdigest()[:12]}",
              flush=True)  # fmt: skip


def rollout_process(args: argparse.Namespace, model_dir: Path, port: int, nccl: bool) -> int:
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from hpc_asyncppo.config import ModelConfig, RolloutConfig
    from hpc_asyncppo.rollout.vllm_engine import VLLMEngine

    device = torch.device("cuda", 0)
    torch.cuda.set_device(0)

    rollout = RolloutConfig(
        engine="vllm", n=args.n, response_length=args.tokens, gpu_memory_utilization=0.6
    )
    start = time.monotonic()
    engine = VLLMEngine(
        ModelConfig(path=str(model_dir), dtype="bfloat16"), rollout, device, max_prompt_length=64
    )
    print(f"rollout: vLLM engine up in {time.monotonic() - start:.1f} s")
    if nccl:
        engine.join_weights(weight_group_spec(port), 1)

    def next_weights(version: int) -> None:
        start = time.monotonic()
        if nccl:
            update = engine.update_weights(version, digest=True)
        else:
            update = engine.load_weights(dict(perturbed(model_dir, version, device)), version, True)
        print(f"rollout: v{version} in the worker in {time.monotonic() - start:.3f} s "
              f"(paused {update.pause_s:.3f} s), digest {update.digests[0][:12]}")  # fmt: skip

    prompts = [engine.encode(f"{i % 10} {(i * 7) % 10} =") for i in range(args.prompts)]

    next_weights(0)
    start = time.monotonic()
    gens = engine.generate(prompts, args.n)
    tokens = sum(int(g.response_lengths.sum()) for g in gens)
    elapsed = time.monotonic() - start
    print(f"rollout: generate: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:,.0f} tok/s")

    for i, prompt in enumerate(prompts):  # async phase: cut and resume at every sync
        engine.submit(i, prompt, args.n)
    done, tokens, start = {}, 0, time.monotonic()
    for version in range(1, args.syncs + 1):
        for _ in range(max(2, args.tokens // (args.syncs + 1))):
            done.update(engine.step())
        engine.interrupt()
        next_weights(version)  # mid-generation: the cut requests resume under it
    while engine.in_flight:
        done.update(engine.step())
    elapsed = time.monotonic() - start
    tokens = sum(int(g.response_lengths.sum()) for g in done.values())
    spanning = sum(int((g.versions.max(axis=1) > g.versions[:, 0]).sum()) for g in done.values())
    print(f"rollout: async phase: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:,.0f} tok/s "
          f"(syncs included); {spanning} responses span more than one version")  # fmt: skip
    engine.close()
    ok = spanning > 0
    print("gpu_check:", "OK" if ok else "FAILED: no response was resumed across a sync")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
