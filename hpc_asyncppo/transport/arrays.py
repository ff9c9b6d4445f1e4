"""A flat byte codec for a dict of numpy arrays plus JSON metadata (no pickle).

Layout: b"HAPA" | uint32 header length | JSON header | padding to 8 bytes | array bytes.
The header lists each array's name, dtype, shape and byte offset; decoding returns views
into the received buffer (no copy).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

MAGIC = b"HAPA"
_ALLOWED_KINDS = "biuf"  # bool, ints, floats: no object arrays can cross the wire


class WireError(ValueError):
    """A received buffer is not a valid message."""


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


def pack_arrays(arrays: dict[str, np.ndarray], meta: dict[str, Any] | None = None) -> np.ndarray:
    """Encode ``arrays`` and JSON-serialisable ``meta`` into one contiguous uint8 buffer."""
    entries, offset = [], 0
    for name, arr in arrays.items():
        if arr.dtype.kind not in _ALLOWED_KINDS:
            raise TypeError(f"array {name!r} has dtype {arr.dtype}; only numeric arrays travel")
        entries.append([name, arr.dtype.str, list(arr.shape), offset])
        offset = _align(offset + arr.nbytes)
    header = json.dumps({"meta": meta or {}, "arrays": entries}).encode()
    start = _align(8 + len(header))
    buf = np.zeros(start + offset, dtype=np.uint8)
    buf[:4] = np.frombuffer(MAGIC, dtype=np.uint8)
    buf[4:8] = np.frombuffer(struct.pack("<I", len(header)), dtype=np.uint8)
    buf[8 : 8 + len(header)] = np.frombuffer(header, dtype=np.uint8)
    for (_, _, _, off), arr in zip(entries, arrays.values(), strict=True):
        flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        buf[start + off : start + off + flat.size] = flat
    return buf


def unpack_arrays(buf: np.ndarray | bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Inverse of ``pack_arrays``: (arrays, meta). Raises WireError on a malformed buffer."""
    raw = np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, bytes | bytearray) else buf
    if raw.size < 8 or raw[:4].tobytes() != MAGIC:
        raise WireError("bad magic: not an hpc_asyncppo array message")
    (hlen,) = struct.unpack("<I", raw[4:8].tobytes())
    if 8 + hlen > raw.size:
        raise WireError(f"header length {hlen} exceeds message size {raw.size}")
    try:
        header = json.loads(raw[8 : 8 + hlen].tobytes())
    except ValueError as exc:
        raise WireError(f"unreadable header: {exc}") from None
    start = _align(8 + hlen)
    arrays = {}
    for name, dtype_str, shape, off in header["arrays"]:
        dtype = np.dtype(dtype_str)
        if dtype.kind not in _ALLOWED_KINDS:
            raise WireError(f"array {name!r}: dtype {dtype_str} not allowed")
        count = int(np.prod(shape, dtype=np.int64))
        end = start + off + count * dtype.itemsize
        if end > raw.size:
            raise WireError(f"array {name!r} runs past the end of the message")
        arrays[name] = raw[start + off : end].view(dtype).reshape(shape)
    return arrays, header["meta"]
