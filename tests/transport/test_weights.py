import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_asyncppo.transport.weights import (
    ALIGN,
    WeightBroadcaster,
    WeightReceiver,
    bucket_sizes,
    decode_header,
    encode_header,
    pack,
    plan_buckets,
    specs_of,
    unpack,
)


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(10, 4, generator=g)),
        ("layer.bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        ("layer.half", torch.randn(7, generator=g).to(torch.float16)),
        ("head.weight", torch.randn(4, 10, generator=g)),
        ("scalar", torch.tensor(3.5)),
        ("odd.bf16", torch.randn(3, generator=g).to(torch.bfloat16)),  # 6 bytes
        ("after_odd", torch.randn(5, generator=g)),  # a float32 view right behind it
        ("empty", torch.zeros(0, 4)),
    ]


def test_buckets_respect_the_size_limit_and_keep_order():
    named = named_tensors()
    slots = plan_buckets(named, bucket_bytes=100)
    assert [s.name for s in slots] == [n for n, _ in named]
    sizes = bucket_sizes(slots)
    # a 160-byte tensor gets a bucket of its own; no bucket with two tensors exceeds the limit
    for b, size in enumerate(sizes):
        members = [s for s in slots if s.bucket == b]
        assert size == members[-1].offset + members[-1].nbytes
        assert len(members) == 1 or size <= 100
        for s, t in zip(members, members[1:], strict=False):
            assert s.offset + s.nbytes <= t.offset  # no overlap
    assert all(s.offset % ALIGN == 0 for s in slots)


def test_any_order_and_odd_lengths_round_trip_bit_exactly():
    """Every dtype, tensors of odd byte lengths before wider ones, in several orders."""
    named = named_tensors()
    for seed in range(5):
        order = torch.randperm(len(named), generator=torch.Generator().manual_seed(seed))
        shuffled = [named[i] for i in order.tolist()]
        for bucket_bytes in (8, 64, 1 << 20):
            slots = plan_buckets(specs_of(shuffled), bucket_bytes)
            out = unpack(pack(shuffled, slots, torch.device("cpu")), slots)
            for name, tensor in shuffled:
                assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
                assert torch.equal(out[name], tensor), (seed, bucket_bytes, name)


def test_pack_unpack_is_bit_exact_for_every_dtype():
    named = named_tensors()
    slots = plan_buckets(named, bucket_bytes=64)
    out = unpack(pack(named, slots, torch.device("cpu")), slots)
    for name, tensor in named:
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(
            out[name].view(torch.uint8) if tensor.dim() else out[name],
            tensor.view(torch.uint8) if tensor.dim() else tensor,
        )


def test_header_round_trip():
    slots = plan_buckets(named_tensors(), 1 << 20)
    version, back = decode_header(encode_header(17, slots))
    assert version == 17 and back == slots


def test_header_with_unknown_dtype_is_refused():
    raw = encode_header(1, plan_buckets([("x", torch.zeros(2, dtype=torch.int64))], 64))
    with pytest.raises(ValueError, match="unsupported dtype"):
        decode_header(raw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast_worker(rank: int, world: int, port: int, bucket_mb: int, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    group = dist.new_group(list(range(world)))
    named = named_tensors()
    if rank == 0:
        WeightBroadcaster(group, 0, bucket_mb, torch.device("cpu")).broadcast(5, named)
        # streamed: each tensor is made only when its turn comes, as a sharded trainer does
        WeightBroadcaster(group, 0, bucket_mb, torch.device("cpu")).broadcast(
            6, ((n, t * 2) for n, t in named), specs=specs_of(named)
        )
    else:
        receiver = WeightReceiver(group, 0, torch.device("cpu"))
        for expected_version, factor in ((5, 1), (6, 2)):
            version, tensors = receiver.receive()
            ok = version == expected_version and all(
                torch.equal(tensors[n], t * factor) and tensors[n].dtype == t.dtype
                for n, t in named
            )
            queue.put((rank, version, ok))
    dist.destroy_process_group()


def test_real_gloo_broadcast_reaches_every_receiver():
    world = 3
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_broadcast_worker, args=(world, _free_port(), 1, queue), nprocs=world, join=True)
    results = sorted(queue.get() for _ in range(2 * (world - 1)))
    assert results == [(1, 5, True), (1, 6, True), (2, 5, True), (2, 6, True)]
