"""What a trainer rank holds, and its step time, for 1, 2 and 4 trainer ranks (gloo, CPU).

Builds a Qwen2-architecture model of ~120M parameters locally (random weights, HF format),
then for each number of ranks T starts T processes that each build the sharded Policy
(FSDP2, fp32 master weights, compute in --dtype) and run --steps PPO updates on the same
synthetic batch. Prints per rank: ``memory/trainer_state_mb`` (weights + gradients + AdamW
state of its shard), its peak RSS and the peak's growth over the process before the model,
and the mean step time after the first; then the ratios of state per rank to T = 1.

With ``--lora RANK`` every case runs twice, full fine-tuning and LoRA of that rank on
``all-linear`` (``actor.lora_rank``): the frozen base is held in --dtype with no master,
gradient or AdamW state, the adapters in fp32 with all three; the LoRA/full ratios of
state and peak RSS growth per rank follow.

    python scripts/bench_trainer_memory.py [--ranks 1 2 4] [--dtype bfloat16] [--steps 3]
    python scripts/bench_trainer_memory.py --ranks 1 2 --lora 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_model(out: Path, hidden: int, layers: int, vocab: int) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def synthetic_batch(rows: int, prompt: int, response: int, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "prompt_ids": rng.integers(0, vocab, (rows, prompt)).astype(np.int32),
        "prompt_mask": np.ones((rows, prompt), dtype=np.int8),
        "response_ids": rng.integers(0, vocab, (rows, response)).astype(np.int32),
        "response_mask": np.ones((rows, response), dtype=np.int8),
        "rollout_log_probs": -rng.random((rows, response)).astype(np.float32),
        "rewards": rng.random(rows).astype(np.float32),
        "advantages": rng.normal(size=rows).astype(np.float32),
    }


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(
    rank: int, world: int, port: int, args: argparse.Namespace, out: str, lora_rank: int
) -> None:
    from hpc_asyncppo.config import Config
    from hpc_asyncppo.trainer.batch import shard_rows, to_tensors
    from hpc_asyncppo.trainer.policy import Policy, ppo_update

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    before = rss_mb()
    cfg = Config()
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=args.model_dir, dtype=args.dtype),
        actor=dataclasses.replace(
            cfg.actor, ppo_micro_batch_size_per_gpu=args.micro, lr=1e-5, lora_rank=lora_rank
        ),
    )
    policy = Policy(cfg, torch.device("cpu"))
    batch = synthetic_batch(args.rows, args.prompt, args.response, args.vocab)
    mine = to_tensors(shard_rows(batch, world, 1)[rank], torch.device("cpu"))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        ppo_update(policy, mine)
        times.append(time.perf_counter() - start)
    row = {
        "lora": lora_rank,
        "ranks": world,
        "rank": rank,
        "state_mb": policy.state_bytes() / 2**20,
        "peak_mb": rss_mb(),
        "peak_growth_mb": rss_mb() - before,
        "step_s": float(np.mean(times[1:] if len(times) > 1 else times)),
    }
    Path(out, f"{lora_rank}-{world}-{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rows", type=int, default=8, help="responses in the batch (all ranks)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=96)
    p.add_argument("--micro", type=int, default=2, help="ppo_micro_batch_size_per_gpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lora", type=int, default=0, help="also LoRA of this rank, side by side")
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    work = Path(tempfile.mkdtemp(prefix="bench_trainer_memory_"))
    args.model_dir = str(work / "model")
    params = build_model(work / "model", args.hidden, args.layers, args.vocab)
    print(f"model: Qwen2 architecture, {params / 1e6:.1f} M parameters "
          f"(hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}); compute "
          f"{args.dtype}, fp32 master weights; batch {args.rows} x ({args.prompt} + "
          f"{args.response}) tokens, micro-batch {args.micro}")  # fmt: skip
    print(f"expected state per rank: 16 bytes x N / T = {16 * params / 2**20:.0f} MB / T")
    rows = []
    for world in args.ranks:
        for lora_rank in (0, args.lora) if args.lora else (0,):
            mp.start_processes(worker, args=(world, free_port(), args, str(work), lora_rank),
                               nprocs=world, start_method="spawn")  # fmt: skip
            rows += [json.loads((work / f"{lora_rank}-{world}-{r}.json").read_text())
                     for r in range(world)]  # fmt: skip
    print(f"{'lora':>4} {'ranks':>5} {'rank':>4} {'state_mb':>9} {'peak_rss_mb':>11} "
          f"{'peak_growth_mb':>14} {'step_s':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['lora']:>4} {r['ranks']:>5} {r['rank']:>4} {r['state_mb']:>9.1f} "
              f"{r['peak_mb']:>11.0f} {r['peak_growth_mb']:>14.0f} {r['step_s']:>7.2f}")  # fmt: skip

    def leader(world: int, lora_rank: int = 0) -> dict:
        return next(r for r in rows if (r["ranks"], r["rank"], r["lora"]) == (world, 0, lora_rank))

    base = leader(args.ranks[0])["state_mb"]
    for world in args.ranks:
        print(f"state per rank at {world} ranks / at {args.ranks[0]}: "
              f"{leader(world)['state_mb'] / base:.3f}")  # fmt: skip
        if args.lora:
            full, lora = leader(world), leader(world, args.lora)
            print(f"  LoRA rank {args.lora} / full at {world} ranks: state "
                  f"{lora['state_mb'] / full['state_mb']:.3f}, peak RSS growth "
                  f"{lora['peak_growth_mb'] / full['peak_growth_mb']:.3f}, step time "
                  f"{lora['step_s'] / full['step_s']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
