import dataclasses
import os
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_asyncppo.transport.weights import (
    ALIGN,
    Background,
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
from tests.conftest import end_spawned_rank, free_port


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


def join_gloo(rank: int, world: int, port: int) -> None:
    """This spawned process joins a gloo world of ``world`` ranks on the loopback."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )


def _broadcast_worker(rank: int, world: int, port: int, bucket_mb: int, queue) -> None:
    join_gloo(rank, world, port)
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
            version, tensors = receiver.receive_all()
            ok = version == expected_version and all(
                torch.equal(tensors[n], t * factor) and tensors[n].dtype == t.dtype
                for n, t in named
            )
            queue.put((rank, version, ok))
    end_spawned_rank(queue)


def test_real_gloo_broadcast_reaches_every_receiver():
    world = 3
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_broadcast_worker, args=(world, free_port(), 1, queue), nprocs=world, join=True)
    results = sorted(queue.get() for _ in range(2 * (world - 1)))
    assert results == [(1, 5, True), (1, 6, True), (2, 5, True), (2, 6, True)]


def streamed_tensors() -> list[tuple[str, torch.Tensor]]:
    """Every dtype, odd lengths, an empty tensor, and one (4000 bytes) larger than a bucket."""
    g = torch.Generator().manual_seed(1)
    return named_tensors() + [
        ("big.fp32", torch.randn(1000, generator=g)),
        ("f64", torch.randn(3, 3, generator=g).double()),
        ("odd.half", torch.randn(13, generator=g).half()),
    ]


SYNC_ORDERS = 3  # seeds: each a different order of streamed_tensors()
SYNC_BUCKETS = (64 / 2**20, 300 / 2**20, 1.0)  # MiB: 64 and 300 bytes, 1 MiB


def _streaming_worker(rank: int, world: int, port: int, queue) -> None:
    """Rank 0 streams each order x bucket size; every receiver loads each bucket as it comes
    into preallocated "model" tensors, checking that at most two bucket buffers are alive."""
    join_gloo(rank, world, port)
    group = dist.new_group(list(range(world)))
    named = streamed_tensors()
    cpu = torch.device("cpu")
    receiver = WeightReceiver(group, 0, cpu)
    version = 0
    for seed in range(SYNC_ORDERS):
        order = torch.randperm(len(named), generator=torch.Generator().manual_seed(seed))
        shuffled = [named[i] for i in order.tolist()]
        for bucket_mb in SYNC_BUCKETS:
            version += 1
            slots = plan_buckets(specs_of(shuffled), max(1, int(bucket_mb * 2**20)))
            largest = max(bucket_sizes(slots))
            if rank == 0:
                sender = WeightBroadcaster(group, 0, bucket_mb, cpu)
                # a stream: each tensor made only when its turn comes, as a sharded trainer does
                sender.broadcast(version, ((n, t.clone()) for n, t in shuffled), specs_of(shuffled))
                queue.put((rank, version, sender.peak_bytes <= 2 * largest, 0))
                continue
            model = {n: torch.full_like(t, -1) for n, t in shuffled}
            incoming = receiver.receive()
            buffers: list[weakref.ref] = []  # every bucket buffer seen, alive or not
            most_alive, loaded, in_place = 0, [], set()
            # rank 2 names destinations, as the HF engine does: direct tensors land in place
            into = model.get if rank == 2 else None
            for bucket in incoming.buckets(into=into):
                for name, tensor in bucket.items():
                    if tensor.numel() and tensor.data_ptr() == model[name].data_ptr():
                        in_place.add(name)
                    else:
                        model[name].copy_(tensor)
                    loaded.append(name)
                if in_place & set(bucket):
                    del bucket, tensor
                    continue
                root = next(iter(bucket.values()))
                root = root._base if root._base is not None else root
                if all(ref() is not root for ref in buffers):
                    buffers.append(weakref.ref(root))
                del bucket, root, tensor
                alive = sum(ref() is not None for ref in buffers)
                most_alive = max(
                    most_alive, alive, len([b for b in receiver.window.buffers if b is not None])
                )
                assert receiver.held_bytes <= 2 * largest
            direct = {s.name for s in slots if s.direct}
            ok = (
                incoming.version == version
                and in_place == (direct if rank == 2 else set())
                and sorted(loaded) == sorted(model)
                and all(
                    model[n].dtype == t.dtype
                    and torch.equal(
                        model[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)
                    )
                    for n, t in shuffled
                )
            )
            queue.put((rank, version, ok, most_alive))
    end_spawned_rank(queue)


def test_streamed_sync_round_trips_bit_exactly_with_at_most_two_buckets_alive():
    """Through real gloo broadcasts, per-bucket receive: any order, odd lengths, every dtype,
    buckets of 64 and 300 bytes (tensors spanning many, one larger than a bucket) and 1 MiB;
    one receiver copies every bucket out, the other takes direct tensors in place."""
    world = 3
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_streaming_worker, args=(world, free_port(), queue), nprocs=world, join=True)
    syncs = SYNC_ORDERS * len(SYNC_BUCKETS)
    results = [queue.get() for _ in range(world * syncs)]
    assert all(ok for _, _, ok, _ in results), [r for r in results if not r[2]]
    receivers = [r for r in results if r[0] != 0]
    assert len(receivers) == (world - 1) * syncs
    assert max(alive for *_, alive in receivers) <= 2
    # with 64-byte buckets there are many buckets: the two buffers really take turns
    assert max(alive for *_, alive in receivers) == 2


def _unloaded_buckets(pulled: list[int]):
    pulled.append(1)
    yield {}


def test_hf_engine_refuses_a_mismatched_sync_before_loading_anything(tiny_model_dir):
    from hpc_asyncppo.config import Config
    from hpc_asyncppo.rollout.hf_engine import HFEngine

    cfg = Config()
    engine = HFEngine(
        dataclasses.replace(cfg.model, path=str(tiny_model_dir)), cfg.rollout, torch.device("cpu")
    )
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    good = [(n, tuple(p.shape), p.dtype) for n, p in engine.named_parameters()]
    (name0, shape0, dtype0), rest = good[0], good[1:]
    wrong = {
        "missing": rest,
        "unexpected": good + [("extra.weight", (2,), torch.float32)],
        "twice": good + [good[0]],
        "shape": [(name0, (*shape0, 1), dtype0), *rest],
        "dtype": [(name0, shape0, torch.float16), *rest],
    }
    for case, specs in wrong.items():
        pulled: list[int] = []
        with pytest.raises(ValueError, match="weight"):
            engine.load_buckets(specs, _unloaded_buckets(pulled), version=3)
        assert pulled == [], case  # not a single bucket was taken
    # a stream that ends short of its header is named, not silently half-loaded
    with pytest.raises(RuntimeError, match="half-loaded"):
        engine.load_buckets(good, iter([]), version=3)
    for n, p in engine.named_parameters():
        assert torch.equal(p, before[n]), n
    assert engine.version == -1


def test_hf_engine_loads_bucket_by_bucket(tiny_model_dir):
    from hpc_asyncppo.config import Config
    from hpc_asyncppo.rollout.hf_engine import HFEngine

    cfg = Config()
    engine = HFEngine(
        dataclasses.replace(cfg.model, path=str(tiny_model_dir)), cfg.rollout, torch.device("cpu")
    )
    new = [(n, torch.randn_like(p)) for n, p in engine.named_parameters()]
    specs = specs_of(new)
    slots = plan_buckets(specs, bucket_bytes=4096)
    buckets = [
        {n: t for n, t in new if n in {s.name for s in slots if s.bucket == b}}
        for b in range(len(bucket_sizes(slots)))
    ]
    assert len(buckets) > 2
    engine.load_buckets(specs, iter(buckets), version=4)
    assert engine.version == 4
    assert all(torch.equal(p, dict(new)[n]) for n, p in engine.named_parameters())


def test_plan_sends_large_tensors_alone_and_packs_small_ones():
    """Tensors of at least ``direct_bytes`` travel alone (direct) as they come; smaller ones
    share one bucket across the large ones between them, sent when it is full or at the
    end; an empty tensor never shares a bucket with a direct one."""
    specs = [
        ("a", (3,), torch.float32),  # 12 bytes
        ("big", (256,), torch.float32),  # 1024 bytes: direct
        ("empty", (0,), torch.float32),
        ("big2", (300,), torch.bfloat16),  # 600 bytes: direct
        ("b", (5,), torch.bfloat16),
        ("c", (7,), torch.float16),
    ]
    slots = plan_buckets(specs, bucket_bytes=4096, direct_bytes=512)
    by_name = {s.name: s for s in slots}
    assert [s.name for s in slots if s.direct] == ["big", "big2"]
    for name in ("big", "big2"):
        s = by_name[name]
        assert s.offset == 0 and [t.name for t in slots if t.bucket == s.bucket] == [name]
    packed = {by_name[n].bucket for n in ("a", "empty", "b", "c")}
    assert packed == {2}  # after both large ones, which left while it filled
    assert (by_name["big"].bucket, by_name["big2"].bucket) == (0, 1)
    # a small tensor that does not fit closes the open bucket: it goes out next
    tight = plan_buckets(specs, bucket_bytes=24, direct_bytes=512)
    # a: 16 bytes with its padding, + b's 10 > 24; b: 16, + c's 14 > 24
    small = [(s.name, s.bucket) for s in tight if not s.direct]
    assert small == [("a", 2), ("empty", 2), ("b", 3), ("c", 4)]
    assert bucket_sizes(slots)[by_name["big"].bucket] == 1024
    # buckets are numbered without gaps, in order
    assert sorted({s.bucket for s in slots}) == list(range(len(bucket_sizes(slots))))


def start_sync(rank, group, version, sent, staging) -> Background:
    """The leader's broadcast (rank 0) or a receiver's staging, on a side thread."""
    cpu = torch.device("cpu")
    if rank == 0:
        return WeightBroadcaster(group, 0, 64 / 2**20, cpu).broadcast_in_background(version, sent)
    return WeightReceiver(group, 0, cpu).receive_staged(staging)


def _background_worker(rank: int, world: int, port: int, queue) -> None:
    """Two syncs, each handed to a side thread while the main threads run collectives of
    their own on the world group, as a trainer trains on. The peers of the side thread
    join the sync only after those collectives: sync 1's receivers, so the leader's main
    thread must get through them while its broadcast waits; sync 2's leader, so each
    receiver's main thread must while its staging waits. A side thread that blocked its
    caller would never reach the collectives: the group's 60 s timeout fails the test.
    The receivers then check the staged copy."""
    join_gloo(rank, world, port)
    sync_group = dist.new_group(list(range(world)), timeout=timedelta(seconds=60))
    big = ("huge.fp32", torch.arange(2**18, dtype=torch.float32))  # 1 MiB: direct
    named = streamed_tensors() + [big]
    staging: dict[str, torch.Tensor] = {}
    first_ptrs: dict[str, int] = {}
    for version, factor in ((1, 1.0), (2, -2.0)):
        sent = [(n, t * factor) for n, t in named]

        tested_side = 0 if version == 1 else 1  # the leader's side, then the receivers'
        on_tested_side = (rank == 0) == (tested_side == 0)
        if on_tested_side:
            sending = start_sync(rank, sync_group, version, sent, staging)
            assert not sending.done()  # its peers have not joined yet
        total = torch.ones(1)
        for _ in range(20):  # the loop goes on: collectives on the world group
            dist.all_reduce(total)
        if not on_tested_side:
            sending = start_sync(rank, sync_group, version, sent, staging)
        result = sending.result(60)
        if rank == 0:
            queue.put((rank, version, sending.done() and result >= 0, total.item() > 1))
            continue
        got_version, specs = result
        ok = got_version == version and [s[0] for s in specs] == [n for n, _ in named]
        ok = ok and all(
            staging[n].dtype == t.dtype
            and torch.equal(staging[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
            for n, t in sent
        )
        if version == 1:
            first_ptrs = {n: t.data_ptr() for n, t in staging.items()}
        else:  # the staging copy is allocated once and reused
            ok = ok and all(staging[n].data_ptr() == p for n, p in first_ptrs.items())
        queue.put((rank, version, ok, total.item() > 1))
    end_spawned_rank(queue)


def test_a_sync_runs_on_side_threads_while_both_loops_go_on():
    """In-flight weight updates: the leader's broadcast and a receiver's staging run on side
    threads while the main threads run collectives of their own, which the sync's peers
    wait for before they join it (so the main thread provably went on while the side
    thread's sync was under way); the staged copy is bit exact, every dtype and a direct
    (in-place) tensor included, and reused by the next sync."""
    world = 3
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_background_worker, args=(world, free_port(), queue), nprocs=world, join=True)
    results = sorted(queue.get() for _ in range(2 * world))
    assert results == [(r, v, True, True) for r in range(world) for v in (1, 2)]


def test_a_failing_background_call_raises_on_the_caller_with_its_name():
    def fail() -> None:
        raise ValueError("wire cut")

    call = Background(fail, "weight sync v3")
    with pytest.raises(RuntimeError, match="weight sync v3 failed: wire cut"):
        call.result(10)
