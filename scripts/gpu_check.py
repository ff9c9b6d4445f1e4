"""GPU check of the vLLM rollout path: weights from a trainer into vLLM's workers, checked
against the sender and against transformers, and a few async steps.

On a machine with CUDA GPUs and vLLM (bash scripts/gpu_check.sh runs hpc_asyncppo.gpu_check
first, then this), for a Qwen2 architecture with untied and with tied embeddings (random
weights, the default task's tokenizer), CUDA graphs on:
  1. with 2+ GPUs, a trainer process (cuda:1) is rank 0 of the weight group and the vLLM
     worker (cuda:0) its member, as in a run (NCCL; the rollout process only drives the
     engine: ``join_weights``, ``update_weights``); with one GPU the rollout process sends
     the weights itself (``VLLMEngine.load_weights``, gloo through host memory: NCCL
     refuses two members on one device);
  2. after every sync (``hpc_asyncppo.gpu_check.check_vllm_update``, which the vLLM engine's
     tests run on the CPU): each worker's digest of what it loaded equals the sender's,
     and greedy responses are transformers' greedy continuation under the same weights,
     with log-probs equal to its log_softmax within ``--tolerance``;
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
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="bf16: greedy log-probs against transformers'")  # fmt: skip
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
    models = [Path(args.model)] if args.model else [qwen2(work, tied) for tied in (False, True)]
    gpus = torch.cuda.device_count()
    print(f"gpu_check: {gpus} GPU(s): {torch.cuda.get_device_name(0)}")
    if gpus < 2:
        print("gpu_check: one GPU: the NCCL trainer->rollout broadcast needs two, skipped")
    rc = 0
    for model_dir in models:
        print(f"gpu_check: model {model_dir}")
        port = free_port()
        if gpus >= 2:
            ctx = torch.multiprocessing.get_context("spawn")
            sent = ctx.Queue()
            trainer = ctx.Process(
                target=trainer_process, args=(str(model_dir), port, args.syncs + 1, sent)
            )
            trainer.start()
            rc |= rollout_process(args, model_dir, port, sent)
            trainer.join(timeout=600)
            rc |= trainer.exitcode or 0
        else:
            rc |= rollout_process(args, model_dir, port, None)
    return rc


def qwen2(work: Path, tied: bool) -> Path:
    """A random Qwen2 (4 layers of 256, 4 heads of 64, 2 KV heads, bf16) with the default
    task's tokenizer; ``tied``: the LM head is the embedding."""
    from hpc_asyncppo.config import DataConfig
    from hpc_asyncppo.models.tiny import build_tiny_qwen2
    from hpc_asyncppo.tasks import load_task

    out = work / ("qwen2_tied" if tied else "qwen2_untied")
    words = load_task(DataConfig()).vocabulary()
    return build_tiny_qwen2(
        out, words, tied, seed=3, dtype="bfloat16", hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512,
    )  # fmt: skip


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


def trainer_process(model_dir: str, port: int, versions: int, sent) -> None:
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
        sent.put((version, digest.hexdigest()))
        print(f"trainer: broadcast v{version} in {seconds:.3f} s, digest {digest.hexdigest()[:12]}",
              flush=True)  # fmt: skip


def rollout_process(args: argparse.Namespace, model_dir: Path, port: int, sent) -> int:
    """The vLLM engine on cuda:0: its weights from the trainer process (``sent``: the queue
    of the digests it sent; NCCL) or from this process (None; through host memory), each
    sync checked, then the async phase."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from transformers import AutoModelForCausalLM

    from hpc_asyncppo.config import ModelConfig, RolloutConfig
    from hpc_asyncppo.gpu_check import check_vllm_update
    from hpc_asyncppo.rollout.vllm_engine import VLLMEngine

    device = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    nccl = sent is not None

    rollout = RolloutConfig(
        engine="vllm", n=args.n, response_length=args.tokens, gpu_memory_utilization=0.5
    )
    start = time.monotonic()
    engine = VLLMEngine(
        ModelConfig(path=str(model_dir), dtype="bfloat16"), rollout, device, max_prompt_length=64
    )
    print(f"rollout: vLLM engine up in {time.monotonic() - start:.1f} s")
    if nccl:
        engine.join_weights(weight_group_spec(port), 1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    checked = [engine.encode(f"{i} {i + 3} {i + 5} =") for i in range(4)]
    failures = []

    def next_weights(version: int, check: bool = True) -> None:
        start = time.monotonic()
        weights = dict(perturbed(model_dir, version, device))
        if nccl:
            update = engine.update_weights(version, digest=True)
            carried, digest = sent.get(timeout=600)
            assert carried == version, (carried, version)
        else:
            update, digest = engine.load_weights(weights, version, True), None
        print(f"rollout: v{version} in the worker in {time.monotonic() - start:.3f} s "
              f"(paused {update.pause_s:.3f} s)")  # fmt: skip
        if not check:  # the async phase: the check would finish its cut requests
            return
        try:
            print("rollout:", check_vllm_update(engine, update, weights, hf, checked,
                                                args.tolerance, digest))  # fmt: skip
        except AssertionError as exc:
            failures.append(str(exc))
            print(f"rollout: v{version}: FAILED: {exc}")

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
        next_weights(version, check=False)  # mid-generation: the cut requests resume under it
    while engine.in_flight:
        done.update(engine.step())
    elapsed = time.monotonic() - start
    tokens = sum(int(g.response_lengths.sum()) for g in done.values())
    spanning = sum(int((g.versions.max(axis=1) > g.versions[:, 0]).sum()) for g in done.values())
    print(f"rollout: async phase: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:,.0f} tok/s "
          f"(syncs included); {spanning} responses span more than one version")  # fmt: skip
    engine.close()
    if not spanning:
        failures.append("no response was resumed across a sync")
    print("gpu_check:", "FAILED: " + "; ".join(failures) if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
