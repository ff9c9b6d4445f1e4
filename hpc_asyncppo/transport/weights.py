"""Weights from the trainer leader to every rollout rank, in flat byte buckets.

A sync is: a header (version and, per tensor, name, dtype, shape, bucket and byte offset)
broadcast as JSON bytes, then each bucket. Tensors are packed as raw bytes, so every dtype
(bf16 included) travels bit-exactly. The group is the weight group (``weight_group.py``):
the trainer leader (rank 0) and every process that holds inference weights (the HF
engine's rollout rank, or each vLLM worker), gloo on CPU and NCCL when CUDA is present
(same code: only the device of the buffers changes). When the group cannot use NCCL
(members sharing a GPU), buckets travel through host memory over gloo and the receiver
copies them to its device. Collectives are called on the group object
(``group.broadcast(tensor, src)``, src a rank of the group), so that a group unknown to
torch.distributed's registry works as well as one it made.

Both sides stream. The sender takes the tensors one at a time (a sharded trainer gathers
each from its shards just then). A tensor of at least ``DIRECT_BYTES`` is a bucket of its
own, broadcast from its own memory; the receiver receives it straight into the place its
consumer names (the HF engine: the parameter), so the large tensors, nearly all the
bytes, are never copied. Smaller ones are packed into one open bucket, shared across the
large ones between them, that goes out when full. Operations are posted ahead, up to two
buckets' bytes in flight (gloo pays per collective; a window of bytes keeps the wire busy
with many mid-sized tensors). Each side holds at most two bucket buffers (packed buckets;
on a receiver also direct tensors that have no destination), the header and, on the
sender, the tensors it was handed that are still on the wire (the window) plus the one
being packed; on a receiver whose group is on the host, one bucket copied to its device.
Every packed tensor starts at a multiple of ``ALIGN`` bytes, so that the receiver's views
of any dtype are aligned whatever the order and lengths of the tensors before it.

In-flight weight updates: either side can run a sync on a side thread
(``WeightBroadcaster.broadcast_in_background``, ``WeightReceiver.receive_staged``) while
its loop goes on: the leader hands over the gathered tensors and trains on; an hf rollout
rank receives into a staging copy of the weights while its engine generates under the old
ones, and loads the copy between two engine steps (vLLM's workers receive with their engine
paused instead: no copy). Only that thread uses the weight group then;
``Background.result`` joins it (bounded: the group's own timeout ends a stuck collective)
and raises what it raised.

Why one long file: it is the sync's wire protocol, both ends of it (the header, the bucket
layout, the window of operations in flight); split, each end would hide half the protocol.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from hpc_asyncppo.runtime import faults

_DTYPES = {str(dt): dt for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
ALIGN = 16  # bytes: every tensor's offset in its bucket is a multiple of this
# A tensor of at least this many bytes travels alone and without copies: broadcast from the
# tensor itself and, where the consumer names a destination, received straight into it.
# Below it, tensors are packed into shared buckets (one collective for many small ones).
DIRECT_BYTES = 1 << 20


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str  # e.g. "torch.bfloat16"
    shape: tuple[int, ...]
    bucket: int
    offset: int  # byte offset inside the bucket
    nbytes: int
    direct: bool = False  # alone in its bucket, sent from the tensor and received in place


WeightSpec = tuple[str, tuple[int, ...], torch.dtype]  # name, shape, dtype


class Group(Protocol):
    """What a sync needs of its group: an asynchronous broadcast from a group rank
    (a torch ``ProcessGroup`` or a ``weight_group.WeightGroup``)."""

    def broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work: ...


def specs_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[WeightSpec]:
    return [(name, tuple(t.shape), t.dtype) for name, t in named]


def plan_buckets(
    named: list[tuple[str, torch.Tensor]] | list[WeightSpec],
    bucket_bytes: int,
    direct_bytes: int = DIRECT_BYTES,
) -> list[TensorSlot]:
    """Assign tensors (or their specs), taken in order, to buckets numbered in the order
    they go on the wire.

    A tensor of ``min(direct_bytes, bucket_bytes)`` bytes or more is ``direct``: a bucket
    of its own, sent as soon as it comes. Smaller ones are packed, each at an
    ``ALIGN``-byte offset, into one open bucket of at most ``bucket_bytes`` that is sent
    when the next small tensor does not fit (or at the end): the small tensors of many
    layers share a bucket while the large ones between them go out alone, so that a sync
    takes few more collectives than it has large tensors."""
    slots: list[TensorSlot] = []
    number = 0  # buckets numbered so far
    open_slots: list[int] = []  # positions in ``slots`` of the open packed bucket's tensors
    used = 0

    def close() -> None:
        nonlocal number, used
        for i in open_slots:
            slots[i] = dataclasses.replace(slots[i], bucket=number)
        number, used = number + 1, 0
        open_slots.clear()

    for item in named:
        name, shape, dtype = (
            item if len(item) == 3 else (item[0], tuple(item[1].shape), item[1].dtype)
        )
        nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        if nbytes > 0 and nbytes >= min(direct_bytes, bucket_bytes):
            slots.append(TensorSlot(name, str(dtype), tuple(shape), number, 0, nbytes, True))
            number += 1
            continue
        if open_slots and used + nbytes > bucket_bytes:
            close()
        open_slots.append(len(slots))
        slots.append(TensorSlot(name, str(dtype), tuple(shape), -1, used, nbytes))
        used = (used + nbytes + ALIGN - 1) // ALIGN * ALIGN
    if open_slots:
        close()
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
    """(bucket index, filled bucket) in index order, each as soon as it is complete, taking
    the tensors one at a time in ``slots``' order. ``take(index, nbytes)`` supplies each
    packed bucket's buffer (default: a new one each), so a caller can recycle two buffers.
    A direct slot's bucket is the tensor's own bytes (moved to ``device`` and made
    contiguous only if it is not already): nothing is copied for it."""
    sizes = bucket_sizes(slots)
    take = take or (lambda _, nbytes: torch.empty(nbytes, dtype=torch.uint8, device=device))
    current, buf = -1, None  # the open packed bucket
    for (name, tensor), slot in zip(named, slots, strict=True):
        if name != slot.name:
            raise ValueError(f"weights came out of order: got {name!r}, planned {slot.name!r}")
        raw = _bytes_of(tensor.detach().to(device))
        if slot.direct:
            yield slot.bucket, raw
            continue
        if slot.bucket != current:
            if buf is not None:
                yield current, buf
            current, buf = slot.bucket, take(slot.bucket, sizes[slot.bucket])
        buf[slot.offset : slot.offset + slot.nbytes].copy_(raw)
    if buf is not None:
        yield current, buf


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (a copy only if not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def unpack(buckets: list[torch.Tensor], slots: list[TensorSlot]) -> dict[str, torch.Tensor]:
    """Views into ``buckets``, one per tensor, with its dtype and shape."""
    return {s.name: _view(buckets[s.bucket], s) for s in slots}


def _view(bucket: torch.Tensor, s: TensorSlot) -> torch.Tensor:
    return bucket[s.offset : s.offset + s.nbytes].view(_DTYPES[s.dtype]).view(s.shape)


def encode_header(version: int, slots: list[TensorSlot], bucket_bytes: int = 0) -> bytes:
    return json.dumps(
        {
            "version": version,
            "bucket_bytes": bucket_bytes,
            "slots": [list(s.__dict__.values()) for s in slots],
        }
    ).encode()


def decode_header(raw: bytes) -> tuple[int, list[TensorSlot]]:
    return _decode(raw)[:2]


def _decode(raw: bytes) -> tuple[int, list[TensorSlot], int]:
    header = json.loads(raw)
    slots = [
        TensorSlot(n, dt, tuple(shape), b, off, nb, bool(direct))
        for n, dt, shape, b, off, nb, direct in header["slots"]
    ]
    for s in slots:
        if s.dtype not in _DTYPES:
            raise ValueError(f"weight {s.name!r} has unsupported dtype {s.dtype}")
    return int(header["version"]), slots, int(header.get("bucket_bytes", 0))


class Window:
    """The bucket operations in flight, oldest first, and two flat uint8 buffers.

    Operations are posted (async) in bucket order and complete in that order; a new one is
    posted only when the bytes in flight plus its own stay within ``budget`` (one is always
    allowed), so the wire stays busy with many small direct tensors as with one large
    bucket, and what is in flight is bounded in bytes, not in count. Buckets that need a
    buffer (packed ones; on a receiver, direct ones without a destination) take turns in
    the two buffers: a buffer is handed out again only once the operation last posted on it
    has completed (and, on a receiver, its bucket has been consumed). A buffer is replaced
    when a bucket needs more room than it has or, being larger than ``bucket_bytes``, less
    than half of it, so that a large tensor's buffer does not stay beside the next normal
    bucket's. ``held_bytes`` / ``peak_bytes`` count the buffers' bytes."""

    def __init__(self, device: torch.device, budget: int, bucket_bytes: int = 0):
        self.device, self.budget, self.bucket_bytes = device, budget, bucket_bytes
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.last_op = [-1, -1]  # per buffer, the sequence number of its last operation
        self.flight: deque[tuple[int, dist.Work | None, torch.Tensor]] = deque()
        self.flight_bytes, self.posted_ops, self.completed = 0, 0, -1
        self.turn = 0
        self.peak_bytes = 0

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)

    def buffer(self, nbytes: int, free: Callable[[int], bool] = lambda _: True) -> torch.Tensor:
        """A buffer ``nbytes`` long: the next in turn that ``free`` allows, once the
        operation last posted on it has completed."""
        i = self.turn if free(self.turn) else 1 - self.turn
        self.wait_for(self.last_op[i])
        buf = self.buffers[i]
        if buf is None or not nbytes <= buf.numel() < max(2 * nbytes, self.bucket_bytes + 1):
            self.buffers[i] = None  # free the old one before allocating its replacement
            buf = self.buffers[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.turn = 1 - i
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return buf[:nbytes]

    def buffer_of(self, tensor: torch.Tensor) -> int | None:
        """Which buffer ``tensor`` (a bucket handed out by ``buffer``) lies in, if any."""
        for i, buf in enumerate(self.buffers):
            if buf is not None and buf.numel() and tensor.data_ptr() == buf.data_ptr():
                return i
        return None

    def make_room(self, nbytes: int) -> None:
        """Wait for the oldest operations until ``nbytes`` more fit in the budget."""
        while self.flight and self.flight_bytes + nbytes > self.budget:
            self._complete_oldest()

    def post(self, tensor: torch.Tensor, work: dist.Work | None) -> int:
        """Record an operation posted on ``tensor`` (kept alive until it completes); its
        sequence number."""
        seq, self.posted_ops = self.posted_ops, self.posted_ops + 1
        i = self.buffer_of(tensor)
        if i is not None:
            self.last_op[i] = seq
        self.flight.append((seq, work, tensor))
        self.flight_bytes += tensor.numel()
        return seq

    def wait_for(self, seq: int) -> None:
        while self.completed < seq:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        seq, work, tensor = self.flight.popleft()
        if work is not None:
            work.wait()
        self.flight_bytes -= tensor.numel()
        self.completed = seq

    def settle(self) -> None:
        """Wait for every operation in flight (the buffers stay, for the next sync)."""
        self.wait_for(self.posted_ops - 1)
        if self.device.type == "cuda":
            # Work.wait() on NCCL only orders the current stream after the collective: the
            # host waits here so that the time taken is the time to complete.
            torch.cuda.current_stream(self.device).synchronize()


class WeightBroadcaster:
    """Trainer leader: sends its weights to every rollout rank of ``group`` (src = leader).

    Memory beyond the model: the header, two bucket buffers (packed buckets of small
    tensors) and the tensors the caller makes for the sync (gathered from the shards, or
    cast to the rollout dtype): the one being packed and the direct ones still on the wire,
    at most two buckets' bytes in flight. A direct tensor that already exists (a parameter
    of the rollout dtype on an unsharded trainer) is sent from its own memory. The two
    buffers stay between syncs: fresh host pages cost more than the packing."""

    def __init__(self, group: Group, src: int, bucket_mb: float, device: torch.device):
        """``bucket_mb``: the bucket size in MiB (a fraction gives tests buckets of bytes)."""
        self.group, self.src, self.device = group, src, device
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.window = Window(device, budget=2 * self.bucket_bytes, bucket_bytes=self.bucket_bytes)
        self.peak_bytes = 0  # most bucket-buffer bytes held at once, over every sync
        self.stream: torch.cuda.Stream | None = None  # the side thread's (in-flight syncs)

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
        raw = encode_header(version, slots, self.bucket_bytes)
        header = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
        length = torch.tensor([header.numel()], dtype=torch.int64, device=self.device)
        self.group.broadcast(length, self.src).wait()
        self.group.broadcast(header, self.src).wait()

        def watched() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                if on_tensor is not None:
                    on_tensor(name, tensor)
                yield name, tensor

        window = self.window
        take = lambda _, nbytes: window.buffer(nbytes)  # noqa: E731
        try:
            for _, bucket in stream_buckets(watched(), slots, self.device, take=take):
                window.make_room(bucket.numel())
                work = self.group.broadcast(bucket, self.src)
                window.post(bucket, work)
        finally:
            window.settle()
            self.peak_bytes = window.peak_bytes
        return time.monotonic() - start

    def broadcast_in_background(
        self, version: int, named: list[tuple[str, torch.Tensor]]
    ) -> Background:
        """``broadcast`` on a side thread; its result is the seconds the broadcast took.
        ``named`` must be tensors the caller no longer changes (e.g. gathered copies): they
        are read while the caller trains on.

        On a GPU the side thread works on a stream of its own: its packing copies and the
        collectives (which NCCL orders after the calling thread's current stream) wait
        only for the kernels that made ``named`` (an event recorded here, on the caller's
        stream), not for the training kernels queued after them, so the broadcast does not
        stretch with training. ``named`` stays referenced until the thread ends, and the
        thread ends only once its stream has completed (``Window.settle``), so no tensor's
        memory is reused while the side stream still reads it."""
        if self.device.type != "cuda":
            return Background(lambda: self.broadcast(version, named), f"weight sync v{version}")
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(self.device))
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        side = self.stream

        def run() -> float:
            with torch.cuda.stream(side):
                side.wait_event(made)
                return self.broadcast(version, named)

        return Background(run, f"weight sync v{version}")


class Background:
    """One call running on a side thread: ``done()`` without waiting, ``result()`` joins it
    and returns its value or raises its exception."""

    def __init__(self, fn: Callable[[], object], name: str):
        self.name = name
        self._value: object = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout_s: float) -> object:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.name} did not finish within {timeout_s:g} s")
        if self._error is not None:
            raise RuntimeError(f"{self.name} failed: {self._error}") from self._error
        return self._value


Destination = Callable[[str], torch.Tensor | None]


@dataclass
class WeightUpdate:
    """What an engine reports of a sync it has loaded."""

    version: int
    # per weight-group member of the rank (HF: the rank; vLLM: each worker), the digest of
    # what it loaded (``runlog.WeightDigest``); empty strings when not asked for
    digests: list[str]
    # seconds the engine could not generate for it (vLLM: paused from start to finish)
    pause_s: float


def check_version(announced: int, carried: int, who: str) -> None:
    """A sync's header must carry the version its announcement (SYNC) named."""
    if announced != carried:
        raise RuntimeError(
            f"{who}: weight sync announced version {announced} but the broadcast carried {carried}"
        )


@dataclass
class IncomingWeights:
    """One sync announced by its header: the version and layout, and the buckets still to
    come (``buckets()``, to be called once and iterated to the end: the sender is
    broadcasting them)."""

    version: int
    slots: list[TensorSlot]
    _stream: Callable[[Destination | None, bool], Iterator[dict[str, torch.Tensor]]]

    def specs(self) -> list[WeightSpec]:
        """(name, shape, dtype) of every tensor, in the order they come: known before any
        bucket arrives, so that an engine can refuse a mismatched sync before loading."""
        return [(s.name, s.shape, _DTYPES[s.dtype]) for s in self.slots]

    def buckets(
        self, into: Destination | None = None, keep: bool = False
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Per bucket, its tensors by name: views valid only until the next bucket is asked
        for (their buffer is then reused), so a consumer copies them where they go.

        ``into(name)`` may name where a direct tensor goes (a contiguous tensor of its
        dtype and shape on the group's device, e.g. the engine's parameter): it is then
        received there in place and handed out as that same memory, which the consumer
        need not copy. A destination is written while its bucket arrives, i.e. possibly
        before the buckets ahead of it have been consumed.

        ``keep``: every tensor handed out is memory of its own that the consumer may hold
        on to (a loader that buffers a layer's tensors until the layer is complete, as
        vLLM's layerwise reload does): direct tensors without a destination are received
        into fresh memory, packed ones copied out of their bucket."""
        return self._stream(into, keep)


class WeightReceiver:
    """Rollout rank: receives one sync's header, then its buckets one by one.

    Memory: the header, two bucket buffers on the group's device (for packed buckets, and
    direct ones that have no destination; a direct tensor with one is received in place)
    and, when the group's device is not the target (host memory on a shared GPU), one
    bucket copied to the target. Receives are posted ahead, up to two buckets' bytes in
    flight. The two buffers stay between syncs. With ``buckets(keep=True)`` (a vLLM worker)
    the tensors handed out are the consumer's to hold, and count as its memory."""

    def __init__(
        self,
        group: Group,
        src: int,
        device: torch.device,
        target: torch.device | None = None,
    ):
        """Buckets arrive on ``device`` (the group's); tensors are handed out on ``target``."""
        self.group, self.src, self.device = group, src, device
        self.target = target or device
        self.window = Window(device, budget=0)
        self.peak_bytes = 0  # most bucket-buffer bytes held at once, over every sync
        self.syncs = 0  # headers received: this sync's number (for faults.at)

    @property
    def held_bytes(self) -> int:
        """Bytes of bucket buffers alive now (on the group's device)."""
        return self.window.held_bytes

    def receive(self) -> IncomingWeights:
        """The next sync's header; its buckets follow through ``IncomingWeights.buckets``."""
        self.syncs += 1
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        self.group.broadcast(length, self.src).wait()
        header = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.group.broadcast(header, self.src).wait()
        version, slots, bucket_bytes = _decode(header.cpu().numpy().tobytes())
        return IncomingWeights(
            version, slots, lambda into, keep: self._buckets(slots, bucket_bytes, into, keep)
        )

    def receive_staged(self, staging: dict[str, torch.Tensor]) -> Background:
        """Receive the next sync on a side thread into ``staging`` (name -> tensor of the
        weight's shape and dtype on the target device; missing ones are allocated there and
        kept, so the caller's dict becomes a whole extra copy of the weights, reused by
        every later sync). Direct tensors are received in place, the rest copied from their
        bucket. The result is ``(version, specs)``; the staged tensors are only read once
        it is done."""

        def run() -> tuple[int, list[WeightSpec]]:
            incoming = self.receive()
            specs = incoming.specs()
            for name, shape, dtype in specs:
                held = staging.get(name)
                if held is None or tuple(held.shape) != tuple(shape) or held.dtype != dtype:
                    staging[name] = torch.empty(shape, dtype=dtype, device=self.target)
            for bucket in incoming.buckets(into=staging.get):
                for name, tensor in bucket.items():
                    if tensor.data_ptr() != staging[name].data_ptr():
                        staging[name].copy_(tensor)
            return incoming.version, specs

        return Background(run, "weight sync (receiving)")

    def receive_all(self) -> tuple[int, dict[str, torch.Tensor]]:
        """A whole sync as one dict of copies: a whole extra model, for tests and checks."""
        incoming = self.receive()
        tensors = {n: t.clone() for bucket in incoming.buckets() for n, t in bucket.items()}
        return incoming.version, tensors

    def _buckets(
        self, slots: list[TensorSlot], bucket_bytes: int, into: Destination | None, keep: bool
    ) -> Iterator[dict[str, torch.Tensor]]:
        if keep and into is None and self.target == self.device:
            by_name = {s.name: s for s in slots}

            def fresh(name: str) -> torch.Tensor:
                s = by_name[name]
                return torch.empty(s.shape, dtype=_DTYPES[s.dtype], device=self.device)

            into = fresh

        sizes = bucket_sizes(slots)
        members: list[list[TensorSlot]] = [[] for _ in sizes]
        for s in slots:
            members[s.bucket].append(s)
        window = self.window
        largest = max(sizes, default=0)
        window.bucket_bytes = bucket_bytes or largest
        window.budget = 2 * (bucket_bytes or largest)
        owner: list[int | None] = [None, None]  # per buffer, the bucket received into it
        arrived: dict[int, tuple[int, torch.Tensor, bool]] = {}  # bucket -> (op, data, in place)

        def destination(s: TensorSlot) -> torch.Tensor | None:
            dest = into(s.name) if into is not None and s.direct else None
            if dest is None or not (
                dest.device == self.device
                and dest.dtype == _DTYPES[s.dtype]
                and tuple(dest.shape) == s.shape
                and dest.is_contiguous()
            ):
                return None
            return dest

        def post(index: int, consuming: int) -> bool:
            """Post bucket ``index``'s receive if the window and a buffer allow; whether it
            was posted. Buckets before ``consuming`` have been consumed."""
            dest = destination(members[index][0])
            free = [owner[i] is None or owner[i] < consuming for i in (0, 1)]
            if dest is None and not any(free):
                return False
            if window.flight and window.flight_bytes + sizes[index] > window.budget:
                return False
            if dest is not None:
                buf = _bytes_of(dest)
            else:
                buf = window.buffer(sizes[index], free=lambda i: free[i])
                owner[1 - window.turn] = index  # the buffer it just handed out
            work = self.group.broadcast(buf, self.src)
            seq = window.post(buf, work)
            arrived[index] = (seq, buf if dest is None else dest, dest is not None)
            return True

        try:
            posted = 0
            for index in range(len(sizes)):
                # Post every receive the window allows: they arrive while this bucket is
                # consumed. This one's own is always possible when not yet posted: every
                # bucket before it has completed and been consumed.
                while posted < len(sizes) and post(posted, consuming=index):
                    posted += 1
                if posted <= index:
                    raise RuntimeError(f"weight sync: bucket {index} could not be received")
                seq, bucket, in_place = arrived.pop(index)
                window.wait_for(seq)
                faults.at("bucket", index + 1, sync=self.syncs)  # a drill's named moment
                if in_place:
                    yield {members[index][0].name: bucket}
                    continue
                if self.target != self.device:
                    bucket = bucket.to(self.target)
                views = {s.name: _view(bucket, s) for s in members[index]}
                yield {n: t.clone() for n, t in views.items()} if keep else views
                del bucket  # the device copy goes before the next one is made
        finally:
            window.settle()
            self.peak_bytes = window.peak_bytes
