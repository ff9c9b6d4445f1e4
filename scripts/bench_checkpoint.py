"""Checkpoint save/load against torch.save/torch.load of the same state, and the SpillQueue.

The state is a model-shaped dict of float32 tensors (``--params`` parameters) plus an
AdamW-like optimizer state (exp_avg, exp_avg_sq, step per tensor; int keys), as the trainer
saves it. Each timing is the best of ``--repeats``. Saves start with no old file and no
dirty pages; ours include its fsyncs, torch.save is timed alone and plus an fsync. Our
save and load also compute and verify a CRC-32 of every byte (torch.load verifies none). Loads are timed warm (the file in
the page cache) and cold (its pages dropped with posix_fadvise first).

    python scripts/bench_checkpoint.py [--params 50e6] [--repeats 3] [--dir runs/bench]

(after scripts/install.sh; or run it with PYTHONPATH=. from the repository root)
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hpc_asyncppo.checkpoint.overflow import SpillQueue
from hpc_asyncppo.checkpoint.store import fsync_file, load_checkpoint, save_checkpoint

GB = 1e9
MB = 1e6


def model_state(params: int, hidden: int = 1024) -> dict[str, torch.Tensor]:
    """Llama-like shapes: an embedding, per layer 4 h*h attention and 3 h*(8h/3) MLP matrices."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    ffn = 8 * hidden // 3
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
    vocab = max(1, params % per_layer // hidden)  # the embedding takes up the remainder
    state["model.embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g)
    for layer in range(max(1, params // per_layer)):
        p = f"model.layers.{layer}."
        for name in ("q", "k", "v", "o"):
            state[p + f"self_attn.{name}_proj.weight"] = torch.randn(hidden, hidden, generator=g)
        for name, shape in (
            ("gate", (ffn, hidden)),
            ("up", (ffn, hidden)),
            ("down", (hidden, ffn)),
        ):
            state[p + f"mlp.{name}_proj.weight"] = torch.randn(*shape, generator=g)
        state[p + "input_layernorm.weight"] = torch.ones(hidden)
        state[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    return state


def adamw_state(model: dict[str, torch.Tensor]) -> dict:
    state = {
        i: {"step": torch.tensor(10.0), "exp_avg": t * 1e-3, "exp_avg_sq": t * t * 1e-6}
        for i, t in enumerate(model.values())
    }
    group = {"lr": 1e-6, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    return {"state": state, "param_groups": [{**group, "params": list(range(len(model)))}]}


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


Case = tuple[Callable[[], object], Callable[[], None]]  # (timed, untimed setup before it)


def best_times(repeats: int, cases: dict[str, Case]) -> dict[str, float]:
    """Best time of each case; the cases alternate, so drift on a shared machine hits all."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (fn, before) in cases.items():
            before()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(ts) for name, ts in times.items()}


def bench_checkpoint(tree: dict, nbytes: int, root: Path, repeats: int) -> None:
    ours, theirs = root / "ckpt.h5", root / "ckpt.pt"

    def torch_save() -> None:
        torch.save(tree, theirs)

    def torch_save_fsync() -> None:
        torch.save(tree, theirs)
        fsync_file(theirs)

    def fresh(path: Path) -> Callable[[], None]:
        # Each save starts with no old file to replace and no dirty pages pending.
        return lambda: (path.unlink(missing_ok=True), os.sync())

    def nothing() -> None:
        pass

    saves: dict[str, Case] = {
        "save": (lambda: save_checkpoint(ours, tree, {"step": 10}), fresh(ours)),
        "torch.save": (torch_save, fresh(theirs)),
        "torch.save+fsync": (torch_save_fsync, fresh(theirs)),
    }
    loads: dict[str, Case] = {
        "load warm": (lambda: load_checkpoint(ours), nothing),
        "torch.load warm": (lambda: torch.load(theirs, weights_only=True), nothing),
        "load cold": (lambda: load_checkpoint(ours), lambda: drop_cache(ours)),
        "torch.load cold": (
            lambda: torch.load(theirs, weights_only=True),
            lambda: drop_cache(theirs),
        ),
    }
    t = best_times(repeats, saves) | best_times(repeats, loads)
    print(
        f"state: {nbytes / GB:.2f} GB in {count_tensors(tree)} tensors; "
        f"files: hdf5 {ours.stat().st_size / GB:.2f} GB, torch {theirs.stat().st_size / GB:.2f} GB"
    )
    for name, seconds in t.items():
        print(f"  {name:18s} {seconds:7.2f} s  {nbytes / GB / seconds:6.2f} GB/s")
    print("  ratios (hdf5 time / torch time; < 1 means hdf5 is faster):")
    print(f"    save vs torch.save        {t['save'] / t['torch.save']:.2f}")
    print(f"    save vs torch.save+fsync  {t['save'] / t['torch.save+fsync']:.2f}")
    print(f"    load vs torch.load (warm) {t['load warm'] / t['torch.load warm']:.2f}")
    print(f"    load vs torch.load (cold) {t['load cold'] / t['torch.load cold']:.2f}")


def count_tensors(tree: object) -> int:
    if isinstance(tree, torch.Tensor):
        return 1
    if isinstance(tree, dict):
        return sum(count_tensors(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(count_tensors(v) for v in tree)
    return 0


def bench_queue(root: Path, total_mb: float, item_kb: float, limit_mb: float) -> None:
    rng = random.Random(0)
    size = int(item_kb * 1024)
    count = int(total_mb * MB / size)
    pool = [np.frombuffer(rng.randbytes(size), dtype=np.uint8) for _ in range(64)]
    items = [pool[i % len(pool)] for i in range(count)]
    for label, limit in (("in memory", total_mb * 2), (f"limit {limit_mb:g} MB", limit_mb)):
        queue = SpillQueue(root / "overflow.h5", memory_limit_mb=limit)
        start = time.perf_counter()
        queue.extend(items)
        push_s = time.perf_counter() - start
        spilled = queue.spilled_count
        start = time.perf_counter()
        while len(queue):
            queue.pop()
        pop_s = time.perf_counter() - start
        queue.close()
        print(
            f"  SpillQueue {label:16s} {count} items x {item_kb:g} KiB, {spilled} spilled: "
            f"push {total_mb / push_s:8.0f} MB/s {count / push_s:9.0f} items/s | "
            f"pop {total_mb / pop_s:8.0f} MB/s {count / pop_s:9.0f} items/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50e6, help="model parameters")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: /tmp)")
    parser.add_argument(
        "--queue-mb", type=float, default=512, help="bytes pushed through the queue"
    )
    parser.add_argument("--item-kb", type=float, default=16, help="size of one queued item")
    parser.add_argument("--limit-mb", type=float, default=64, help="the queue's memory limit")
    args = parser.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench_checkpoint-", dir=args.dir))
    try:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        model = model_state(int(args.params))
        tree = {"model": model, "optimizer": adamw_state(model)}
        nbytes = 3 * sum(t.nbytes for t in model.values())
        print(f"model: {sum(t.numel() for t in model.values()) / 1e6:.1f} M float32 parameters")
        bench_checkpoint(tree, nbytes, root, args.repeats)
        del tree, model
        bench_queue(root, args.queue_mb, args.item_kb, args.limit_mb)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
