"""A weight sync into vLLM's workers (CPU build) against a raw broadcast of the same bytes,
and the pause generation sees.

One vLLM engine (``--tp`` workers) on a Llama of ``--hidden`` x ``--layers`` built here
(fp32). This process plays the trainer leader, rank 0 of a weight group whose other
members are the engine's workers, the job's own code on both sides (``WeightBroadcaster``
-> each worker's ``WeightReceiver`` -> vLLM's loader inside its layerwise reload), through
``VLLMEngine.load_weights``. Alternating, repeated:

- ``sync``: the whole sync as a rollout rank sees it: generation paused from the start of
  the update to its end (header, buckets, load, reload's finalize, prefix-cache reset),
  and of it the slowest worker's receive + ``load_weights`` calls;
- ``raw``: one gloo broadcast of one flat tensor of the same bytes from this process to
  ``--tp`` plain processes (no vLLM): the wire alone.

With ``--lora RANK``, then ``lora``: syncs of LoRA adapters of that rank on ``--targets``
(``models/lora.py``; in a row after full syncs, each timed), as a LoRA run makes them:
only the adapters cross, each worker merges them into the base (read from the model's
files at the first, then held) and reloads the layers they change. Printed beside the full
sync: the bytes on the wire, the first and the later LoRA syncs' times, the tensors each
worker loaded and the base it holds.

Then ``pause``: requests are generating (``--requests`` at a time, 64 tokens each) when a
sync comes; the engine's steps before it and the gap the sync leaves are timed, as the
rollout loop sees them (interrupt, update, resubmission of the cut requests: partial
rollout). Printed: medians and the ratios, measured side by side.

    python scripts/bench_vllm_sync.py                    # 512 x 8 (~100 MB fp32), TP 1
    python scripts/bench_vllm_sync.py --tp 2 --repeats 3
    python scripts/bench_vllm_sync.py --lora 8 --targets q_proj,v_proj
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_asyncppo.config import DataConfig, ModelConfig, RolloutConfig, TinyModelConfig
from hpc_asyncppo.models import lora
from hpc_asyncppo.models.tiny import build_tiny_model
from hpc_asyncppo.tasks import load_task


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw_receiver(rank: int, port: int, world: int, nbytes: int, repeats: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank + 1, world_size=world,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats):
        dist.barrier()
        dist.broadcast(buf, 0)
    dist.destroy_process_group()


def adapters_of(weights: dict, rank: int, targets: str) -> dict[str, torch.Tensor]:
    """Random LoRA adapters as a sync carries them (fp32, wire names) on ``targets``
    (``all-linear``: every projection; or module names, comma-separated)."""
    g = torch.Generator().manual_seed(0)
    wanted = None if targets == "all-linear" else set(targets.split(","))
    adapters = {}
    for name, t in weights.items():
        module = name.removesuffix(".weight")
        last = module.rsplit(".", 1)[-1]
        if name.endswith("_proj.weight") and (wanted is None or last in wanted):
            adapters[module + lora.LORA_A] = torch.randn((rank, t.shape[1]), generator=g) / 100
            adapters[module + lora.LORA_B] = torch.randn((t.shape[0], rank), generator=g) / 100
    return adapters


def lora_syncs(engine, weights: dict, args: argparse.Namespace) -> None:
    """Full syncs, then LoRA syncs in a row as a LoRA run makes them (after a full sync
    the first LoRA sync reloads every layer, and reads the base), each timed; printed side
    by side."""
    adapters = adapters_of(weights, args.lora, args.targets)
    wire = sum(t.numel() * t.element_size() for t in adapters.values())
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    times: dict[str, list[float]] = {"lora": [], "full": []}
    version = 1000
    for name, tensors, count in (
        ("full", weights, args.repeats),
        ("lora", adapters, args.repeats + 1),
    ):
        for _ in range(count):
            start = time.monotonic()
            engine.load_weights(tensors, version=version)
            times[name].append(time.monotonic() - start)
            version += 1
    workers = engine.last_sync()
    first, later = times["lora"][0], statistics.median(times["lora"][1:])
    full = statistics.median(times["full"])
    print(
        f"LoRA rank {args.lora} on {args.targets}: {wire / 2**20:.1f} MiB of adapters on the "
        f"wire ({wire / nbytes:.3f} of the model)"
    )
    print(
        f"lora first {first:.3f} s (reads the base), later median {later:.3f} s "
        f"({' '.join(f'{t:.3f}' for t in times['lora'][1:])}); full median {full:.3f} s; "
        f"lora/full: {later / full:.2f}x"
    )
    if "base_bytes" in workers[0]:  # (not reported before the base was held)
        print(
            f"each worker loaded {workers[0]['tensors_loaded']} of {len(weights)} tensors and "
            f"holds a base of {workers[0]['base_bytes'] / 2**20:.0f} MiB "
            f"({workers[0]['base_bytes'] / nbytes:.2f} of the model)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: no LoRA syncs)")
    parser.add_argument("--targets", default="all-linear", help="LoRA target modules")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_vllm_sync_"))
    for key, value in {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
        "TORCH_COMPILE_DISABLE": "1", "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
    }.items():  # fmt: skip
        os.environ.setdefault(key, value)
    size = TinyModelConfig(
        hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 32,
        intermediate_size=args.hidden * 11 // 4,
    )  # fmt: skip
    model_dir = build_tiny_model(root / "model", load_task(DataConfig()).vocabulary(), size, 3)
    from transformers import AutoModelForCausalLM

    weights = {
        n: p.detach().clone()
        for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()
    }
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())

    from hpc_asyncppo.rollout.vllm_engine import VLLMEngine

    rollout = RolloutConfig(
        engine="vllm", response_length=64, tensor_parallel_size=args.tp, ignore_eos=True
    )
    engine = VLLMEngine(ModelConfig(path=str(model_dir)), rollout, torch.device("cpu"), 32)
    engine.standalone_bucket_mb = args.bucket_mb
    engine.load_weights(weights, version=0)  # joins the group, warms the buffers

    port, world = _port(), 1 + args.tp
    ctx = mp.get_context("spawn")
    receivers = [
        ctx.Process(target=_raw_receiver, args=(r, port, world, nbytes, args.repeats))
        for r in range(args.tp)
    ]
    for p in receivers:
        p.start()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    flat = torch.empty(nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {"sync": [], "raw": [], "received": [], "loader": []}
    for i in range(args.repeats):
        start = time.monotonic()
        engine.load_weights(weights, version=1 + i)
        times["sync"].append(time.monotonic() - start)
        # of which each worker's receive and load_weights calls (the rest: vLLM's
        # layerwise reload set-up and finalize, the RPCs)
        last = engine.last_sync()
        times["received"].append(max(w["seconds"] for w in last))
        times["loader"].append(max(w["load_s"] for w in last))
        dist.barrier()
        start = time.monotonic()
        dist.broadcast(flat, 0)
        times["raw"].append(time.monotonic() - start)
    for p in receivers:
        p.join()
    if args.lora:
        lora_syncs(engine, weights, args)

    prompt = engine.encode("1 2 3 4 =")
    steps: list[float] = []
    pauses: list[float] = []
    version = 100
    for _ in range(args.repeats):
        for k in range(args.requests):
            engine.submit(("bench", version, k), prompt, 1)
        for _ in range(8):  # decoding steps before the sync
            start = time.monotonic()
            engine.step()
            steps.append(time.monotonic() - start)
        start = time.monotonic()
        engine.interrupt()  # partial rollout: the requests are cut...
        engine.load_weights(weights, version=version)
        engine.step()  # ...and resume under the new weights
        pauses.append(time.monotonic() - start)
        version += 1
        while engine.in_flight:
            engine.step()
    engine.close()

    sync, raw = statistics.median(times["sync"]), statistics.median(times["raw"])
    pause, step = statistics.median(pauses), statistics.median(steps)
    print(
        f"model {nbytes / 2**20:.0f} MiB fp32 ({args.hidden} x {args.layers}), TP {args.tp}, "
        f"buckets {args.bucket_mb:g} MiB, {args.repeats} repeats"
    )
    print(f"{'case':<8}{'median s':>10}{'GB/s':>8}   runs")
    for name, med in (("sync", sync), ("raw", raw)):
        runs = " ".join(f"{t:.3f}" for t in times[name])
        print(f"{name:<8}{med:>10.3f}{nbytes / med / 1e9:>8.2f}   {runs}")
    received = statistics.median(times["received"])
    print(f"sync / raw broadcast: {sync / raw:.2f}x")
    loader = statistics.median(times["loader"])
    print(
        f"of the sync: the workers' receive + load_weights {received:.3f} s, of which in "
        f"vLLM's loader (and the layers it processes as they complete) {loader:.3f} s, the "
        f"receiving {received - loader:.3f} s ({(received - loader) / raw:.2f}x the raw "
        f"broadcast); vLLM's reload set-up, finalize and the RPCs {sync - received:.3f} s"
    )
    print(
        f"generation: a decoding step of {args.requests} requests {step * 1000:.1f} ms; "
        f"a sync's pause (interrupt + update + resume) {pause:.3f} s = {pause / step:.0f} steps "
        f"({pause / sync:.2f}x the sync alone)"
    )


if __name__ == "__main__":
    main()
