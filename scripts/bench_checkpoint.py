"""Checkpoint save/load against torch.save/torch.load of the same state, sharded checkpoints
written and read by 1, 2 and 4 trainer ranks, and the SpillQueue.

The state is a model-shaped dict of float32 tensors (``--params`` parameters) plus an
AdamW-like optimizer state (exp_avg, exp_avg_sq, step per tensor; int keys), as the trainer
saves it. Each timing is the best of ``--repeats``. Saves start with no old file and no
dirty pages; ours include its fsyncs, torch.save is timed alone and plus an fsync. Our
save and load also compute and verify a CRC-32 of every byte (torch.load verifies none). Loads are timed warm (the file in
the page cache) and cold (its pages dropped with posix_fadvise first).

Sharded (``--ranks 1 2 4``): each of T processes holds its rows of every tensor (FSDP's
split of dim 0) and writes its own part of a checkpoint (``checkpoint.protocol``), rank 0
commits the manifest; then each reads its rows back (warm). Times run from a barrier before
to a barrier after (the slowest rank's); each rank samples its resident memory every
millisecond and reports the peak growth during the save and the load as a multiple of its
own shard's bytes (the load's destination tensors exist before it starts, as a model's do).

    python scripts/bench_checkpoint.py [--params 50e6] [--repeats 3] [--ranks 1 2 4] [--dir runs/bench]

(after scripts/install.sh; or run it with PYTHONPATH=. from the repository root)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hpc_asyncppo.checkpoint.store import fsync_file, load_checkpoint, save_checkpoint
from hpc_asyncppo.trainer.queue import SpillQueue

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
    bench_checkpoint.torch_times = t  # the sharded runs' baselines
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


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident-memory growth over the level at entry, sampled every millisecond."""

    def __enter__(self) -> PeakRSS:
        import threading

        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def shard_tree(params: int, rank: int, ranks: int) -> tuple[dict, int]:
    """This rank's rows of the model and AdamW state, with the layout a trainer part has."""
    layout: dict[str, list[int]] = {}
    model, state = {}, {}
    for i, (name, full) in enumerate(model_state(params).items()):
        per = -(-full.shape[0] // ranks)
        start = min(rank * per, full.shape[0])
        rows = full[start : start + per].clone()
        model[name] = rows
        state[i] = {"step": torch.tensor(10.0), "exp_avg": rows * 1e-3, "exp_avg_sq": rows * 1e-6}
        layout[f"model/{name}"] = [start, *full.shape]
        for key in ("exp_avg", "exp_avg_sq"):
            layout[f"optimizer/state/{i}/{key}"] = [start, *full.shape]
    tree = {"model": model, "optimizer": {"state": state, "param_groups": []},
            "layout": json.dumps(layout)}  # fmt: skip
    nbytes = sum(t.nbytes for t in model.values()) * 3
    return tree, nbytes


def _sharded_worker(rank: int, ranks: int, port: int, params: int, folder: str, out: str) -> None:
    import json

    import torch.distributed as dist

    from hpc_asyncppo.checkpoint import protocol

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ranks)  # fmt: skip
    torch.set_num_threads(1)
    tree, shard = shard_tree(params, rank, ranks)
    folder_path = Path(folder)
    dist.barrier()
    start = time.perf_counter()
    with PeakRSS() as save_mem:
        part = protocol.write_part(folder_path, protocol.trainer_part(rank), tree)
    Path(out, f"part-{ranks}-{rank}.json").write_text(json.dumps(part.to_json()))
    dist.barrier()
    if rank == 0:
        infos = [
            protocol.PartInfo.from_json(json.loads(Path(out, f"part-{ranks}-{r}.json").read_text()))
            for r in range(ranks)
        ]
        protocol.commit(folder_path, infos, {"step": 1, "train_ranks": ranks})
    dist.barrier()
    save_s = time.perf_counter() - start
    targets = {n: torch.empty_like(t) for n, t in tree["model"].items()}
    del tree
    manifest = protocol.read_manifest(folder_path)
    dist.barrier()
    start = time.perf_counter()
    with PeakRSS() as load_mem:
        with protocol.ShardedReader(folder_path, manifest, [rank]) as reader:
            for name, target in targets.items():
                begin = reader.layouts[rank][f"model/{name}"][0]
                target.copy_(reader.rows(("model", name), slice(begin, begin + target.shape[0])))
                for key in ("exp_avg", "exp_avg_sq"):  # read like the optimizer's rows
                    index = list(targets).index(name)
                    reader.rows(
                        ("optimizer", "state", index, key), slice(begin, begin + target.shape[0])
                    )
    dist.barrier()
    load_s = time.perf_counter() - start
    row = {"rank": rank, "shard": shard, "save_s": save_s, "load_s": load_s,
           "save_peak": save_mem.growth, "load_peak": load_mem.growth}  # fmt: skip
    Path(out, f"result-{ranks}-{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def bench_sharded(params: int, ranks: list[int], root: Path, repeats: int, torch_t: dict) -> None:
    import json
    import socket

    import torch.multiprocessing as mp

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    results: dict[int, list[dict]] = {}
    for _ in range(repeats):
        for world in ranks:  # alternating, so drift hits every rank count
            folder = root / f"sharded-{world}" / "step_00000001"
            shutil.rmtree(folder.parent, ignore_errors=True)
            os.sync()
            mp.start_processes(_sharded_worker, args=(world, free_port(), params, str(folder),
                                                      str(root)), nprocs=world, start_method="spawn")  # fmt: skip
            rows = [
                json.loads((root / f"result-{world}-{r}.json").read_text()) for r in range(world)
            ]
            best = results.get(world)
            if (
                best is None
                or rows[0]["save_s"] + rows[0]["load_s"] < best[0]["save_s"] + best[0]["load_s"]
            ):
                results[world] = rows
    print(
        f"sharded checkpoints of the same state, best of {repeats} (save: write + commit; load: warm)"
    )
    print("  ranks  save_s  load_s  save/1rank  load/1rank  save/torch.save+fsync  load/torch.load  "
          "peak save/shard  peak load/shard")  # fmt: skip
    base = results[ranks[0]][0]
    for world, rows in results.items():
        r0 = rows[0]
        save_peak = max(r["save_peak"] / r["shard"] for r in rows)
        load_peak = max(r["load_peak"] / r["shard"] for r in rows)
        print(f"  {world:5d}  {r0['save_s']:6.2f}  {r0['load_s']:6.2f}  {r0['save_s'] / base['save_s']:10.2f}  "
              f"{r0['load_s'] / base['load_s']:10.2f}  {r0['save_s'] / torch_t['torch.save+fsync']:21.2f}  "
              f"{r0['load_s'] / torch_t['torch.load warm']:15.2f}  {save_peak:15.2f}  {load_peak:15.2f}")  # fmt: skip


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
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 4], help="sharded: ranks")
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
        if args.ranks:
            bench_sharded(int(args.params), args.ranks, root, args.repeats,
                          bench_checkpoint.torch_times)  # fmt: skip
        bench_queue(root, args.queue_mb, args.item_kb, args.limit_mb)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
