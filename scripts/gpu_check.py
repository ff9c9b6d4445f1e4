"""GPU check of the vLLM rollout path: weight broadcast into vLLM and a few async steps.

On a machine with CUDA GPUs and vLLM (bash scripts/gpu_check.sh runs hpc_asyncppo.gpu_check
first, then this):
  1. with 2+ GPUs, a trainer process (cuda:1) broadcasts the weights with NCCL through the
     project's WeightBroadcaster to a rollout process (cuda:0), as in a run; with one GPU
     the rollout process makes the tensors itself (NCCL refuses two ranks on one device);
  2. the rollout process loads them into vLLM (CUDA-IPC weight-transfer engine, layerwise
     reload, prefix-cache reset) and checks that sampling changed;
  3. a few async steps with partial rollout: generate, cut at a sync, resume.
It prints tokens/s and sync (load) times. Without CUDA it exits with status 2 at once.

    python scripts/gpu_check.py [--model HF_FOLDER] [--prompts 64] [--n 8] [--tokens 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta
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


def process_group(rank: int, port: int):
    import torch.distributed as dist

    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    return dist.new_group([0, 1])


def trainer_process(model_dir: str, port: int, versions: int) -> None:
    from hpc_asyncppo.transport.weights import WeightBroadcaster

    torch.cuda.set_device(1)
    group = process_group(1, port)
    sender = WeightBroadcaster(group, src=1, bucket_mb=512, device=torch.device("cuda", 1))
    for version in range(versions):
        seconds = sender.broadcast(
            version, perturbed(Path(model_dir), version, torch.device("cuda", 1))
        )
        print(f"trainer: broadcast v{version} in {seconds:.3f} s", flush=True)


def rollout_process(args: argparse.Namespace, model_dir: Path, port: int, nccl: bool) -> int:
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from hpc_asyncppo.config import ModelConfig, RolloutConfig
    from hpc_asyncppo.rollout.vllm_engine import VLLMEngine
    from hpc_asyncppo.transport.weights import WeightReceiver

    device = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    receiver = WeightReceiver(process_group(0, port), src=1, device=device) if nccl else None

    def next_weights(version: int) -> dict[str, torch.Tensor]:
        start = time.monotonic()
        if receiver is None:
            tensors = dict(perturbed(model_dir, version, device))
        else:
            got, tensors = receiver.receive_all()
            assert got == version, (got, version)
        print(f"rollout: v{version} received in {time.monotonic() - start:.3f} s")
        return tensors

    rollout = RolloutConfig(
        engine="vllm", n=args.n, response_length=args.tokens, gpu_memory_utilization=0.6
    )
    start = time.monotonic()
    engine = VLLMEngine(
        ModelConfig(path=str(model_dir), dtype="bfloat16"), rollout, device, max_prompt_length=64
    )
    print(f"rollout: vLLM engine up in {time.monotonic() - start:.1f} s")
    prompts = [engine.encode(f"{i % 10} {(i * 7) % 10} =") for i in range(args.prompts)]

    tensors = next_weights(0)
    start = time.monotonic()
    engine.load_weights(tensors, version=0)
    print(f"rollout: v0 loaded into vLLM in {time.monotonic() - start:.3f} s")
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
        tensors = next_weights(version)
        t0 = time.monotonic()
        engine.load_weights(tensors, version=version)
        print(
            f"rollout: v{version} loaded into vLLM in {time.monotonic() - t0:.3f} s (mid-generation)"
        )
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
