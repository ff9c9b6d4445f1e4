"""Weights from the trainer leader to every rollout rank, in flat byte buckets.

A sync is: a header (version and, per tensor, name, dtype, shape, bucket and byte offset)
broadcast as JSON bytes, then each bucket. Tensors are packed as raw bytes, so every dtype
(bf16 included) travels bit-exactly. The group is {trainer leader} + rollout ranks, gloo on
CPU and NCCL when CUDA is present (same code: only the device of the buffers changes). When
the group cannot use NCCL (ranks sharing a GPU), buckets travel through host memory over
gloo and the receiver copies them to its device.

Both sides stream and are double-buffered. The sender takes the tensors one at a time (a
sharded trainer gathers each from its shards just then), copies each into the current
bucket and posts the bucket's broadcast as soon as it is full; while bucket k is on the
wire it gathers and packs k+1 into the other buffer. The receiver posts the receive of
bucket k+1 before handing bucket k to its consumer (the engine), which loads it in place.
Each side holds at most two bucket buffers (plus, on the sender, the tensor being packed;
on a receiver whose group is on the host, one bucket copied to its device), and the
header. Every tensor starts at a multiple of ``ALIGN`` bytes, so that the receiver's views
of any dtype are aligned whatever the order and lengths of the tensors before it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

_DTYPES = {str(dt): dt for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
ALIGN = 16  # bytes: every tensor's offset in its bucket is a multiple of this


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str  # e.g. "torch.bfloat16"
    shape: tuple[int, ...]
    bucket: int
    offset: int  # byte offset inside the bucket
    nbytes: int


WeightSpec = tuple[str, tuple[int, ...], torch.dtype]  # name, shape, dtype


def specs_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[WeightSpec]:
    return [(name, tuple(t.shape), t.dtype) for name, t in named]


def plan_buckets(
    named: list[tuple[str, torch.Tensor]] | list[WeightSpec], bucket_bytes: int
) -> list[TensorSlot]:
    """Assign tensors (or their specs), in order, to buckets of at most ``bucket_bytes``
    (a larger tensor gets its own), each at an ``ALIGN``-byte offset."""
    slots, bucket, used = [], 0, 0
    for item in named:
        name, shape, dtype = (
            item if len(item) == 3 else (item[0], tuple(item[1].shape), item[1].dtype)
        )
        nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        if used and used + nbytes > bucket_bytes:
            bucket, used = bucket + 1, 0
        slots.append(TensorSlot(name, str(dtype), tuple(shape), bucket, used, nbytes))
        used = (used + nbytes + ALIGN - 1) // ALIGN * ALIGN
    return slots


def bucket_sizes(slots: list[TensorSlot]) -> list[int]:
    sizes: dict[int, int] = {}
    for s in slots:
        sizes[s.bucket] = max(sizes.get(s.bucket, 0), s.offset + s.nbytes)
    return [sizes[b] for b in sorted(sizes)]


def pack(
    named: list[tuple[str, torch.Tensor]], slots: list[TensorSlot], device: torch.device
) -> list[torch.Tensor]:
    """Copy tensors into flat uint8 buckets laid out by ``slots`` (all buckets at once)."""
    return [bucket for _, bucket in stream_buckets(named, slots, device)]


def stream_buckets(
    named: Iterable[tuple[str, torch.Tensor]],
    slots: list[TensorSlot],
    device: torch.device,
    take: Callable[[int, int], torch.Tensor] | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """(bucket index, filled bucket) as soon as each is complete, taking the tensors one at a
    time in ``slots``' order. ``take(index, nbytes)`` supplies each bucket's buffer (default:
    a new one each), so a caller can recycle two buffers."""
    sizes = bucket_sizes(slots)
    take = take or (lambda _, nbytes: torch.empty(nbytes, dtype=torch.uint8, device=device))
    current, buf = -1, None
    for (name, tensor), slot in zip(named, slots, strict=True):
        if name != slot.name:
            raise ValueError(f"weights came out of order: got {name!r}, planned {slot.name!r}")
        if slot.bucket != current:
            if buf is not None:
                yield current, buf
            current = slot.bucket
            buf = take(current, sizes[current])
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[slot.offset : slot.offset + slot.nbytes].copy_(raw)
    if buf is not None:
        yield current, buf


def unpack(buckets: list[torch.Tensor], slots: list[TensorSlot]) -> dict[str, torch.Tensor]:
    """Views into ``buckets``, one per tensor, with its dtype and shape."""
    return {s.name: _view(buckets[s.bucket], s) for s in slots}


def _view(bucket: torch.Tensor, s: TensorSlot) -> torch.Tensor:
    return bucket[s.offset : s.offset + s.nbytes].view(_DTYPES[s.dtype]).view(s.shape)


def encode_header(version: int, slots: list[TensorSlot]) -> bytes:
    return json.dumps(
        {"version": version, "slots": [list(s.__dict__.values()) for s in slots]}
    ).encode()


def decode_header(raw: bytes) -> tuple[int, list[TensorSlot]]:
    header = json.loads(raw)
    slots = [
        TensorSlot(n, dt, tuple(shape), b, off, nb) for n, dt, shape, b, off, nb in header["slots"]
    ]
    for s in slots:
        if s.dtype not in _DTYPES:
            raise ValueError(f"weight {s.name!r} has unsupported dtype {s.dtype}")
    return int(header["version"]), slots


class BucketPair:
    """Two flat uint8 buffers that buckets take turns in (bucket k uses buffer k % 2).

    A buffer is handed out again only once the operation last posted on it has completed,
    so at most two buckets exist at a time: one on the wire, one being filled (sender) or
    consumed (receiver). A buffer is replaced when a bucket needs more room than it has (a
    tensor larger than the bucket size travels alone) or less than half of it, so that a
    large tensor's buffer does not stay beside the next normal bucket's.
    ``held_bytes`` / ``peak_bytes`` count the buffers' bytes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.works: list[dist.Work | None] = [None, None]
        self.peak_bytes = 0

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)

    def take(self, index: int, nbytes: int) -> torch.Tensor:
        """The buffer for bucket ``index``, ``nbytes`` long, once bucket ``index - 2`` is done."""
        i = index % 2
        self.wait(index)
        buf = self.buffers[i]
        if buf is None or not nbytes <= buf.numel() < 2 * nbytes:
            self.buffers[i] = None  # free the old one before allocating its replacement
            buf = self.buffers[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return buf[:nbytes]

    def posted(self, index: int, work: dist.Work | None) -> None:
        self.works[index % 2] = work

    def wait(self, index: int) -> None:
        """Wait for the operation last posted on bucket ``index``'s buffer."""
        work, self.works[index % 2] = self.works[index % 2], None
        if work is not None:
            work.wait()

    def settle(self) -> None:
        """Wait for both buffers' operations (the buffers stay, for the next sync)."""
        for i in (0, 1):
            self.wait(i)
        if self.device.type == "cuda":
            # Work.wait() on NCCL only orders the current stream after the collective: the
            # host waits here so that the time taken is the time to complete.
            torch.cuda.current_stream(self.device).synchronize()


class WeightBroadcaster:
    """Trainer leader: sends its weights to every rollout rank of ``group`` (src = leader).

    Memory beyond the model: the header, two bucket buffers (bucket k on the wire while
    k+1 is packed) and the one tensor being packed (gathered from the shards by the caller).
    The two buffers stay between syncs: fresh host pages cost more than the packing."""

    def __init__(self, group: dist.ProcessGroup, src: int, bucket_mb: float, device: torch.device):
        """``bucket_mb``: the bucket size in MiB (a fraction gives tests buckets of bytes)."""
        self.group, self.src, self.device = group, src, device
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.pair = BucketPair(device)
        self.peak_bytes = 0  # most bucket-buffer bytes held at once, over every sync

    def broadcast(
        self,
        version: int,
        named: Iterable[tuple[str, torch.Tensor]],
        specs: list[WeightSpec] | None = None,
        on_tensor: Callable[[str, torch.Tensor], None] | None = None,
    ) -> float:
        """Broadcast ``named`` tensors as ``version``; returns the seconds it took, to the
        completion of the last bucket's broadcast.

        ``specs`` (name, shape, dtype of each, in order) lets ``named`` be a stream that
        produces each tensor only when it is packed; without them ``named`` is a list.
        ``on_tensor`` sees every tensor as it is packed (e.g. to digest it)."""
        start = time.monotonic()
        if specs is None:
            named = list(named)
            specs = specs_of(named)
        slots = plan_buckets(specs, self.bucket_bytes)
        header = torch.frombuffer(bytearray(encode_header(version, slots)), dtype=torch.uint8).to(
            self.device
        )
        length = torch.tensor([header.numel()], dtype=torch.int64, device=self.device)
        dist.broadcast(length, src=self.src, group=self.group)
        dist.broadcast(header, src=self.src, group=self.group)

        def watched() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                if on_tensor is not None:
                    on_tensor(name, tensor)
                yield name, tensor

        pair = self.pair
        try:
            for index, bucket in stream_buckets(watched(), slots, self.device, take=pair.take):
                work = dist.broadcast(bucket, src=self.src, group=self.group, async_op=True)
                pair.posted(index, work)
        finally:
            pair.settle()
            self.peak_bytes = pair.peak_bytes
        return time.monotonic() - start


@dataclass
class IncomingWeights:
    """One sync announced by its header: the version and layout, and the buckets still to
    come (``buckets()``, to be iterated once, to the end: the sender is broadcasting them)."""

    version: int
    slots: list[TensorSlot]
    _buckets: Iterator[dict[str, torch.Tensor]]

    def specs(self) -> list[WeightSpec]:
        """(name, shape, dtype) of every tensor, in the order they come: known before any
        bucket arrives, so that an engine can refuse a mismatched sync before loading."""
        return [(s.name, s.shape, _DTYPES[s.dtype]) for s in self.slots]

    def buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """Per bucket, its tensors by name: views valid only until the next bucket is asked
        for (their buffer is then reused), so a consumer copies them where they go."""
        return self._buckets


class WeightReceiver:
    """Rollout rank: receives one sync's header, then its buckets one by one.

    Memory: the header, two bucket buffers on the group's device (bucket k+1 arriving while
    the consumer loads k) and, when the group's device is not the target (host memory on a
    shared GPU), one bucket copied to the target. The two buffers stay between syncs."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        src: int,
        device: torch.device,
        target: torch.device | None = None,
    ):
        """Buckets arrive on ``device`` (the group's); tensors are handed out on ``target``."""
        self.group, self.src, self.device = group, src, device
        self.target = target or device
        self.pair = BucketPair(device)
        self.peak_bytes = 0  # most bucket-buffer bytes held at once, over every sync

    @property
    def held_bytes(self) -> int:
        """Bytes of bucket buffers alive now (on the group's device)."""
        return self.pair.held_bytes

    def receive(self) -> IncomingWeights:
        """The next sync's header; its buckets follow through ``IncomingWeights.buckets``."""
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.broadcast(length, src=self.src, group=self.group)
        header = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(header, src=self.src, group=self.group)
        version, slots = decode_header(header.cpu().numpy().tobytes())
        return IncomingWeights(version, slots, self._buckets(slots))

    def receive_all(self) -> tuple[int, dict[str, torch.Tensor]]:
        """A whole sync as one dict of copies: a whole extra model, for tests and checks."""
        incoming = self.receive()
        tensors = {n: t.clone() for bucket in incoming.buckets() for n, t in bucket.items()}
        return incoming.version, tensors

    def _buckets(self, slots: list[TensorSlot]) -> Iterator[dict[str, torch.Tensor]]:
        sizes = bucket_sizes(slots)
        members: list[list[TensorSlot]] = [[] for _ in sizes]
        for s in slots:
            members[s.bucket].append(s)
        pair = self.pair

        def post(index: int) -> torch.Tensor:
            buf = pair.take(index, sizes[index])
            pair.posted(index, dist.broadcast(buf, self.src, group=self.group, async_op=True))
            return buf

        try:
            arriving = post(0) if sizes else None
            for index in range(len(sizes)):
                bucket = arriving
                pair.wait(index)
                # post the next receive before handing this bucket out: it arrives meanwhile
                arriving = post(index + 1) if index + 1 < len(sizes) else None
                if self.target != self.device:
                    bucket = bucket.to(self.target)
                yield {s.name: _view(bucket, s) for s in members[index]}
                del bucket  # the device copy goes before the next one is made
        finally:
            pair.settle()
            self.peak_bytes = pair.peak_bytes
