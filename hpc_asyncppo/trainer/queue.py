"""The trainer's sample queue: a FIFO of encoded sample groups that spills to HDF5.

Items are the uint8 buffers of ``transport.samples.encode_group``; the caller decodes what
it pops. At most ``memory_limit_mb`` of them are held in memory; the rest wait, in order,
in RUN_DIR/overflow.h5 and come back in FIFO order. Nothing is dropped for lack of room.

The queue is three segments, oldest first::

    head (memory) | spilled (overflow file) | tail (memory, written to the file in batches)

While everything fits, pushes and pops touch only the in-memory deque: no file exists.
The head may use 7/8 of the limit; the rest (at most ``io_chunk_mb``) is the tail, where
items queue once one did not fit, so that the file sees few large writes. A pop that finds
the head empty reads the next run of spilled items back in one read (at most
``io_chunk_mb``); when the file is drained it is deleted and the tail moves up.

The overflow file is scratch, not a recovery format (no fsync): a checkpoint stores
``snapshot()`` (``state_dict``), and a resumed run pushes those items into a fresh queue
(``load_state_dict``). Not thread-safe.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

_DATA_CHUNK = 256 * 1024  # bytes per HDF5 chunk of the data dataset
_ENDS_CHUNK = 8192  # items per chunk of the offsets dataset
_ENDS_WINDOW = 65536  # offsets read at once when refilling


class SpillQueue:
    """FIFO of 1-D uint8 buffers, at most ``memory_limit_mb`` of them in memory."""

    def __init__(self, path: str | Path, memory_limit_mb: float, io_chunk_mb: float = 16.0):
        """``path``: the overflow file (e.g. RUN_DIR/overflow.h5; overwritten when first
        needed). ``io_chunk_mb``: the most bytes moved to or from the file at once."""
        if memory_limit_mb < 0:
            raise ValueError(f"memory_limit_mb must be >= 0, got {memory_limit_mb}")
        self.path = Path(path)
        self.memory_limit = int(memory_limit_mb * 2**20)
        self._io_chunk = max(1, int(io_chunk_mb * 2**20))
        # Part of the budget is kept for the tail, so that a full head still lets spilled
        # items be written in batches rather than one at a time.
        self._tail_cap = max(1, min(self._io_chunk, self.memory_limit // 8))
        self._head_cap = self.memory_limit - self._tail_cap
        self._head: deque[np.ndarray] = deque()
        self._head_bytes = 0
        self._tail: list[np.ndarray] = []
        self._tail_bytes = 0
        self._file: h5py.File | None = None
        self._written = self._written_bytes = 0  # items / bytes in the file
        self._read = self._read_bytes = 0  # items / bytes already read back
        self.total_spilled = 0  # items ever written to the file

    def __len__(self) -> int:
        return len(self._head) + self.spilled_count + len(self._tail)

    @property
    def memory_bytes(self) -> int:
        """Bytes of queued items held in memory."""
        return self._head_bytes + self._tail_bytes

    @property
    def spilled_count(self) -> int:
        """Items waiting in the overflow file."""
        return self._written - self._read

    def push(self, buf: np.ndarray) -> None:
        if not (isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1):
            raise TypeError("SpillQueue holds 1-D uint8 arrays (see encode_group)")
        if (
            not self._tail
            and not self.spilled_count
            and self._head_bytes + buf.nbytes <= self._head_cap
        ):
            self._head.append(buf)
            self._head_bytes += buf.nbytes
            return
        # Something older waits behind the head (or this does not fit): queue behind it.
        self._tail.append(buf)
        self._tail_bytes += buf.nbytes
        over_limit = self._head_bytes + self._tail_bytes > self.memory_limit
        if over_limit or self._tail_bytes >= self._tail_cap:
            self._flush_tail()

    def extend(self, bufs: Iterable[np.ndarray]) -> None:
        """Push each of ``bufs`` in order (e.g. the queue saved in a checkpoint)."""
        for buf in bufs:
            self.push(buf)

    def pop(self) -> np.ndarray:
        """The oldest item; IndexError if the queue is empty."""
        if not self._head:
            self._refill()
        if not self._head:
            raise IndexError("pop from an empty SpillQueue")
        buf = self._head.popleft()
        self._head_bytes -= buf.nbytes
        return buf

    def push_front(self, bufs: list[np.ndarray]) -> None:
        """Put items just popped back at the front, in their order (a batch abandoned by a
        stop). They were in memory a moment ago, so they go back to the head whatever its
        size: the limit holds again once they are popped."""
        for buf in reversed(bufs):
            self._head.appendleft(buf)
            self._head_bytes += buf.nbytes

    def popleft_many(self, k: int) -> list[np.ndarray]:
        """The ``min(k, len(self))`` oldest items, oldest first."""
        return [self.pop() for _ in range(min(k, len(self)))]

    def snapshot(self) -> list[np.ndarray]:
        """Every queued item in order, without removing any (for a checkpoint)."""
        spilled = self._read_spilled(self._written) if self.spilled_count else []
        return [*self._head, *spilled, *self._tail]

    def state_dict(self) -> dict:
        """Every queued item in order under ``queue``: the spilled ones read back, so the
        whole queue is in memory while a checkpoint writes it."""
        return {"queue": self.snapshot()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Push a checkpoint's items, in order, into this queue (a resume's, empty)."""
        self.extend(state["queue"] or [])

    def close(self) -> None:
        """Delete the overflow file and forget every item (snapshot first to keep them)."""
        self._drop_file()
        self._head.clear()
        self._tail.clear()
        self._head_bytes = self._tail_bytes = 0

    def __enter__(self) -> SpillQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the overflow file ------------------------------------------------------------

    def _open(self) -> h5py.File:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A 4 MiB chunk cache keeps the partly written last chunk in memory between appends.
            f = h5py.File(self.path, "w", libver="latest", locking=False, rdcc_nbytes=4 << 20)
            f.create_dataset(
                "data", shape=(0,), maxshape=(None,), dtype=np.uint8, chunks=(_DATA_CHUNK,)
            )
            f.create_dataset(
                "ends", shape=(0,), maxshape=(None,), dtype=np.int64, chunks=(_ENDS_CHUNK,)
            )
            self._file = f
        return self._file

    def _flush_tail(self) -> None:
        f = self._open()
        sizes = np.fromiter((b.size for b in self._tail), dtype=np.int64, count=len(self._tail))
        ends = self._written_bytes + np.cumsum(sizes)
        if self._tail_bytes:
            data = f["data"]
            data.resize((self._written_bytes + self._tail_bytes,))
            data[self._written_bytes :] = np.concatenate(self._tail)
        f["ends"].resize((self._written + len(self._tail),))
        f["ends"][self._written :] = ends
        self._written += len(self._tail)
        self._written_bytes += self._tail_bytes
        self.total_spilled += len(self._tail)
        self._tail.clear()
        self._tail_bytes = 0

    def _refill(self) -> None:
        """Move the next run of spilled items (at least one) into the empty head; once the
        file is drained, the tail is next in line."""
        if self.spilled_count:
            budget = min(self.memory_limit - self._tail_bytes, self._io_chunk)
            stop = min(self._written, self._read + _ENDS_WINDOW)
            window = self._file["ends"][self._read : stop]
            count = max(1, int(np.searchsorted(window - self._read_bytes, budget, side="right")))
            items = self._read_spilled(self._read + count, window[:count])
            self._head.extend(items)
            self._head_bytes += sum(b.nbytes for b in items)
            self._read += count
            self._read_bytes = int(window[count - 1])
            if self._read == self._written:
                self._drop_file()
        if not self.spilled_count:
            self._head.extend(self._tail)
            self._head_bytes += self._tail_bytes
            self._tail.clear()
            self._tail_bytes = 0

    def _read_spilled(self, stop: int, ends: np.ndarray | None = None) -> list[np.ndarray]:
        """Items [self._read, stop) from the file, as views into one read."""
        if ends is None:
            ends = self._file["ends"][self._read : stop]
        data = self._file["data"][self._read_bytes : int(ends[-1])]
        return np.split(data, (ends[:-1] - self._read_bytes).tolist())

    def _drop_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)
        self._written = self._written_bytes = self._read = self._read_bytes = 0
