"""Weights from the trainer leader to every rollout rank, in flat byte buckets.

A sync is: a header (version and, per tensor, name, dtype, shape, bucket and byte offset)
broadcast as JSON bytes, then each bucket. Tensors are packed as raw bytes, so every dtype
(bf16 included) travels bit-exactly. The group is {trainer leader} + rollout ranks, gloo on
CPU and NCCL when CUDA is present (same code: only the device of the buffers changes). When
the group cannot use NCCL (ranks sharing a GPU), buckets travel through host memory over
gloo and the receiver copies them to its device.

The sender streams: it takes the tensors one at a time (a sharded trainer gathers each
from its shards just then), copies each into the current bucket and broadcasts a bucket as
soon as it is full, so it holds one bucket and one tensor beyond the model's own shards.
Every tensor starts at a multiple of ``ALIGN`` bytes, so that the receiver's views of any
dtype are aligned whatever the order and lengths of the tensors before it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
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
    named: Iterable[tuple[str, torch.Tensor]], slots: list[TensorSlot], device: torch.device
) -> Iterable[tuple[int, torch.Tensor]]:
    """(bucket index, filled bucket) as soon as each is complete, taking the tensors one at a
    time in ``slots``' order: one bucket exists at a time (reused when sizes allow)."""
    sizes = bucket_sizes(slots)
    current, buf = -1, None
    for (name, tensor), slot in zip(named, slots, strict=True):
        if name != slot.name:
            raise ValueError(f"weights came out of order: got {name!r}, planned {slot.name!r}")
        if slot.bucket != current:
            if buf is not None:
                yield current, buf
            current = slot.bucket
            buf = torch.empty(sizes[current], dtype=torch.uint8, device=device)
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[slot.offset : slot.offset + slot.nbytes].copy_(raw)
    if buf is not None:
        yield current, buf


def unpack(buckets: list[torch.Tensor], slots: list[TensorSlot]) -> dict[str, torch.Tensor]:
    """Views into ``buckets``, one per tensor, with its dtype and shape."""
    return {
        s.name: buckets[s.bucket][s.offset : s.offset + s.nbytes]
        .view(_DTYPES[s.dtype])
        .view(s.shape)
        for s in slots
    }


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


class WeightBroadcaster:
    """Trainer leader: sends its weights to every rollout rank of ``group`` (src = leader)."""

    def __init__(self, group: dist.ProcessGroup, src: int, bucket_mb: int, device: torch.device):
        self.group, self.src, self.device = group, src, device
        self.bucket_bytes = bucket_mb * 2**20

    def broadcast(
        self,
        version: int,
        named: Iterable[tuple[str, torch.Tensor]],
        specs: list[WeightSpec] | None = None,
        on_tensor: Callable[[str, torch.Tensor], None] | None = None,
    ) -> float:
        """Broadcast ``named`` tensors as ``version``; returns the seconds it took.

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

        for _, bucket in stream_buckets(watched(), slots, self.device):
            dist.broadcast(bucket, src=self.src, group=self.group)
        return time.monotonic() - start


class WeightReceiver:
    """Rollout rank: receives one sync's header and buckets from the leader."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        src: int,
        device: torch.device,
        target: torch.device | None = None,
    ):
        """Buckets arrive on ``device`` (the group's); tensors are returned on ``target``."""
        self.group, self.src, self.device = group, src, device
        self.target = target or device

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.broadcast(length, src=self.src, group=self.group)
        header = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(header, src=self.src, group=self.group)
        version, slots = decode_header(header.cpu().numpy().tobytes())
        buckets = [
            torch.empty(size, dtype=torch.uint8, device=self.device) for size in bucket_sizes(slots)
        ]
        for bucket in buckets:
            dist.broadcast(bucket, src=self.src, group=self.group)
        if self.target != self.device:
            buckets = [b.to(self.target) for b in buckets]
        return version, unpack(buckets, slots)
