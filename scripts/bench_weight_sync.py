"""Weight-sync bandwidth and memory: the project's streamed sync against one raw broadcast.

For each case (model size x number of receivers) a fresh gloo world on 127.0.0.1 is spawned:
rank 0 holds the "trainer" weights, every other rank preallocated "model" tensors of the
same shapes. Alternating, repeated:

- ``project``: ``WeightBroadcaster.broadcast`` (header, then the buckets: large tensors
  alone from their own memory, small ones packed) -> ``WeightReceiver.receive`` with a
  consumer that names the model tensors as destinations (large ones arrive in place) and
  copies the rest, as the HF engine does;
- ``raw``: one ``dist.broadcast`` of a single preallocated flat tensor of the same bytes.

With ``--lora RANK`` a third method, ``lora``, syncs the same model as LoRA does
(``models/lora.py``): rank 0 broadcasts only fp32 adapters of that rank for every layer
matrix (q/k/v/o/gate/up/down, peft's ``all-linear``), and each receiver merges them into
the base exactly as the HF engine does: the targeted weights read from the base's
safetensors files (written once before the case), base + B @ A in fp32, copied into the
model. Its time therefore includes the merge; ``full/lora`` is the ratio to ``project``.

Time: from a barrier to the slowest rank's end (all-reduced max). Memory, per rank: the
most bucket-buffer bytes alive at once (counted by the project's ``Window``) and the
growth of the process's resident set over its level before the sync (sampled every ms from
/proc/self/statm; the model tensors and the raw buffer are allocated before and not
counted), both as multiples of the bucket size. The broadcaster and receiver live for the
whole case, as in a run, so their two buffers stay between syncs: the first project run's
RSS growth is the buffers' allocation; later ones grow by what a sync allocates anew.

    python scripts/bench_weight_sync.py                # 256 MiB and 1 GiB, 1 and 3 receivers
    python scripts/bench_weight_sync.py --sizes 256 --receivers 1 --repeats 2
    python scripts/bench_weight_sync.py --sizes 256 1024 --receivers 1 --lora 8
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_asyncppo.models import lora
from hpc_asyncppo.transport.weights import WeightBroadcaster, WeightReceiver, specs_of

PAGE = os.sysconf("SC_PAGE_SIZE")


def qwen_like(total_mib: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """A Qwen2-shaped set (hidden 1024, MLP 2816, 4 KV heads of 64, vocab 32003) of about
    ``total_mib``: bf16 embeddings; per layer q/k/v (with odd-length-free biases), o, gate,
    up, down; fp32 norms and an odd fp32 rotary table. 256 MiB: bf16 layer matrices;
    1 GiB and more: fp32 layer matrices (fp32 weights, as a sync of master weights)."""
    hidden, mlp, kv, vocab = 1024, 2816, 256, 32003
    matrix = torch.bfloat16 if total_mib <= 256 else torch.float32
    specs = [("model.embed_tokens.weight", (vocab, hidden), torch.bfloat16)]
    layer = [
        ("self_attn.q_proj.weight", (hidden, hidden), matrix),
        ("self_attn.q_proj.bias", (hidden,), torch.bfloat16),
        ("self_attn.k_proj.weight", (kv, hidden), matrix),
        ("self_attn.k_proj.bias", (kv,), torch.bfloat16),
        ("self_attn.v_proj.weight", (kv, hidden), matrix),
        ("self_attn.v_proj.bias", (kv,), torch.bfloat16),
        ("self_attn.o_proj.weight", (hidden, hidden), matrix),
        ("self_attn.rotary.inv_freq", (33,), torch.float32),  # odd: 132 bytes
        ("mlp.gate_proj.weight", (mlp, hidden), matrix),
        ("mlp.up_proj.weight", (mlp, hidden), matrix),
        ("mlp.down_proj.weight", (hidden, mlp), matrix),
        ("input_layernorm.weight", (hidden,), torch.float32),
        ("post_attention_layernorm.weight", (hidden,), torch.float32),
    ]
    tail = [
        ("model.norm.weight", (hidden,), torch.float32),
        ("lm_head.weight", (vocab, hidden), torch.bfloat16),
    ]

    def nbytes(items: list) -> int:
        return sum(torch.Size(s).numel() * d.itemsize for _, s, d in items)

    layers = max(1, round((total_mib * 2**20 - nbytes(specs + tail)) / nbytes(layer)))
    for i in range(layers):
        specs += [(f"model.layers.{i}.{n}", s, d) for n, s, d in layer]
    return specs + tail


LORA_TARGETS = ("_proj.weight",)  # every layer matrix: peft's all-linear without the LM head


def adapters_of(specs: list, rank: int, g: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    """fp32 LoRA adapters of ``rank`` (A: rank x in, B: out x rank, on the wire's names) for
    every layer matrix of ``specs``."""
    out = []
    for name, shape, _ in specs:
        if name.endswith(LORA_TARGETS) and len(shape) == 2:
            module = name[: -len(".weight")]
            out.append((module + lora.LORA_A, torch.randn((rank, shape[1]), generator=g) / 100))
            out.append((module + lora.LORA_B, torch.randn((shape[0], rank), generator=g) / 100))
    return out


def write_base(specs: list, folder: str) -> None:
    """The base model's weights as one safetensors file (what a LoRA receiver reads)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    save_file(
        {n: torch.randn(s, generator=g).to(d) for n, s, d in specs}, f"{folder}/model.safetensors"
    )


def lora_sync(end, version: int, adapters: list, model: dict, base: lora.BaseWeights) -> int:
    """One LoRA sync: the adapters over ``end``; a receiver merges them into its model as
    the HF engine's ``load_adapters`` does."""
    if isinstance(end, WeightBroadcaster):
        end.broadcast(version, iter(adapters), specs=specs_of(adapters))
        return end.peak_bytes
    got = {n: t.clone() for bucket in end.receive().buckets() for n, t in bucket.items()}
    targets = lora.base_targets(got)
    for name, merged in lora.merged_weights(got, base.read(targets), model[targets[0]].dtype):
        model[name].copy_(merged)
    return end.peak_bytes


class RssPeak:
    """Highest resident set of this process while active, sampled every millisecond."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def __enter__(self) -> RssPeak:
        self.base = self.peak = self.now()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def project_sync(end, version: int, weights: list, model: dict) -> int:
    """One streamed sync through ``end`` (this rank's broadcaster or receiver, kept from
    sync to sync as in a run); returns the most bucket-buffer bytes it has held."""
    if isinstance(end, WeightBroadcaster):
        end.broadcast(version, iter(weights), specs=specs_of(weights))
        return end.peak_bytes
    # large tensors are received straight into the model, as the HF engine has them
    for bucket in end.receive().buckets(into=model.get):
        for name, tensor in bucket.items():
            if tensor.data_ptr() != model[name].data_ptr():
                model[name].copy_(tensor)
    return end.peak_bytes


def worker(
    rank: int, world: int, port: int, args: argparse.Namespace, size: int, base_dir: str, queue
) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    group = dist.new_group(list(range(world)))
    specs = qwen_like(size)
    total = sum(torch.Size(s).numel() * d.itemsize for _, s, d in specs)
    g = torch.Generator().manual_seed(0)
    weights, model = [], {}
    for name, shape, dtype in specs:
        if rank == 0:
            weights.append((name, torch.randn(shape, generator=g).to(dtype)))
        else:
            model[name] = torch.zeros(shape, dtype=dtype)
    flat = (
        torch.ones(total, dtype=torch.uint8) if rank == 0 else torch.zeros(total, dtype=torch.uint8)
    )
    adapters = adapters_of(specs, args.lora, g) if args.lora and rank == 0 else []
    base = lora.BaseWeights(base_dir) if args.lora and rank else None
    bucket_bytes = args.bucket_mb * 2**20
    cpu = torch.device("cpu")
    end = (
        WeightBroadcaster(group, 0, args.bucket_mb, cpu)
        if rank == 0
        else WeightReceiver(group, 0, cpu)
    )
    rows = []
    for repeat in range(args.repeats):
        methods = ("project", "raw", "lora") if args.lora else ("project", "raw")
        for method in methods if repeat % 2 == 0 else methods[::-1]:
            dist.barrier(group=group)
            with RssPeak() as rss:
                start = time.perf_counter()
                if method == "raw":
                    dist.broadcast(flat, src=0, group=group)
                    buffers = 0
                elif method == "lora":
                    buffers = lora_sync(end, repeat, adapters, model, base)
                else:
                    buffers = project_sync(end, repeat, weights, model)
                seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
            # the peaks of the sender and of the receiver that grew most
            peaks = torch.tensor([[buffers, rss.growth]], dtype=torch.float64)
            every = [torch.zeros_like(peaks) for _ in range(world)]
            dist.all_gather(every, peaks, group=group)
            if rank == 0:
                recv = torch.cat(every[1:]).max(dim=0).values.tolist()
                rows.append(
                    (
                        method,
                        seconds.item(),
                        *(v / bucket_bytes for v in (buffers, rss.growth)),
                        *(v / bucket_bytes for v in recv),
                    )  # fmt: skip
                )
    if rank == 0:
        queue.put((total, rows))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="MiB of weights")
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--repeats", type=int, default=4, help="runs of each method per case")
    parser.add_argument("--bucket-mb", type=int, default=64, help="the sync's bucket size")
    parser.add_argument("--lora", type=int, default=0, help="also a LoRA sync of this rank")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print(f"bucket {args.bucket_mb} MiB, {args.repeats} repeats per method, gloo on 127.0.0.1")
    print(
        "case            method   median s   GB/s   sender bufs/rss   receiver bufs/rss (x bucket)"
    )
    for size in args.sizes:
        for receivers in args.receivers:
            queue = ctx.SimpleQueue()
            world = 1 + receivers
            with tempfile.TemporaryDirectory() as base_dir:
                if args.lora:
                    write_base(qwen_like(size), base_dir)
                mp.spawn(
                    worker, args=(world, free_port(), args, size, base_dir, queue), nprocs=world
                )  # fmt: skip
            total, rows = queue.get()
            medians = {}
            for method in ("project", "raw", "lora") if args.lora else ("project", "raw"):
                mine = [r for r in rows if r[0] == method]
                med = [statistics.median(r[i] for r in mine) for i in range(1, 6)]
                medians[method] = med[0]
                print(
                    f"{total / 2**20:6.0f} MiB x{receivers}  {method:8s} {med[0]:8.3f}"
                    f"  {total / med[0] / 1e9:5.2f}     {med[1]:4.2f} / {med[2]:4.2f}"
                    f"         {med[3]:4.2f} / {med[4]:4.2f}"
                    + (
                        f"   (max {max(r[2] for r in mine):.2f}/{max(r[4] for r in mine):.2f} rss)"
                        if method == "project"
                        else ""
                    )  # fmt: skip
                )
                print("                 runs s: " + " ".join(f"{r[1]:.3f}" for r in mine))
            print(f"{'':16s} project/raw bandwidth: {medians['raw'] / medians['project']:.2f}x")
            if args.lora:
                sent = sum(
                    t.numel() * 4
                    for _, t in adapters_of(qwen_like(size), args.lora, torch.Generator())
                )
                print(
                    f"{'':16s} LoRA rank {args.lora}: {sent / 2**20:.1f} MiB of adapters on the wire "
                    f"({sent / total:.3f} of the model); full/lora time: "
                    f"{medians['project'] / medians['lora']:.2f}x"
                )


if __name__ == "__main__":
    main()
