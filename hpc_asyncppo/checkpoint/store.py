"""The checkpoint file format: one HDF5 file holding a nested state tree and JSON metadata
(a checkpoint is a folder of such files, one per rank's part: ``protocol``).

No pickle anywhere: every value is a typed HDF5 dataset, so opening an untrusted checkpoint
cannot run code. File layout (HDF5 1.10 format, whose metadata blocks carry checksums):

  /            attrs format = "hpc_asyncppo.checkpoint", format_version = 1
  /meta        uint8: the metadata as UTF-8 JSON (step, param_version, counters, ...)
  /manifest    uint8: JSON list of every dataset path in write order (finds missing ones)
  /tree/...    the state tree: a dict is a group, a leaf is a dataset

Every dataset carries ``kind`` and ``crc32``: the zlib CRC-32 of each consecutive
``crc32_block`` bytes of its stored data (one value for data up to 64 MiB; blocks let
several threads checksum one large tensor). Leaves:

  torch    a tensor; dtypes numpy lacks (bfloat16, float8, bool, complex) are stored as
           their bit pattern (uint of the same width) with the torch dtype in ``dtype``
  numpy    a numeric or bool numpy array (``scalar`` = 1 for a numpy scalar)
  json     None, bool, int, float, str, or a list/tuple of those (``container``)
  buffers  (a group) a list of 1-D uint8 arrays, e.g. encoded sample groups, stored as one
           concatenated ``data`` dataset plus ``ends`` offsets: thousands cost two datasets

Groups have kind ``dict`` (children named by escaped key; an int key is marked on the
child by ``key_type`` = "int", so optimizer state dicts load back), ``list`` or ``tuple``
(children named 0..n-1).

Why one long file: the format has one writer and two readers (whole and row-sliced), and
each must agree with the layout above byte for byte; split, the agreement would span files.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import uuid
import zlib
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote

import h5py
import numpy as np
import torch

log = logging.getLogger(__name__)

FORMAT = "hpc_asyncppo.checkpoint"
# A part file's format (its attrs); the manifest's is protocol.MANIFEST_FORMAT_VERSION.
PART_FORMAT_VERSION = 1
# Lowest format 1.10: checksummed metadata. Highest 1.10: any HDF5 >= 1.10 can read the file.
_LIBVER = ("v110", "v110")
_SCALARS = (type(None), bool, int, float, str)
CRC_BLOCK = 64 << 20
_CRC_THREADS = min(8, os.cpu_count() or 1)  # zlib.crc32 releases the GIL

_NATIVE_TORCH = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
}
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED_TORCH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SIGNED_NP = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


class CheckpointError(RuntimeError):
    """A checkpoint is unreadable, corrupt, of an unknown format, or for another model."""


# --- saving -----------------------------------------------------------------------------


def save_checkpoint(path: str | Path, tree: dict, meta: dict) -> int:
    """Write ``tree`` and ``meta`` to ``path`` atomically; returns the file's checksum (the
    CRC-32 of its datasets' CRC-32s, what ``verify_checkpoint`` returns).

    The file is written under a temporary name in the same directory, fsynced, renamed,
    and the directory fsynced: after a crash ``path`` is either absent, the old file, or
    the complete new one. On any error the temporary file is removed and the error raised.

    HDF5 writes through a Python file object (h5py's fileobj driver), not its own: a full
    disk is then an ``OSError`` (errno 28) of this process, wherever HDF5 writes. Through
    its own driver the last metadata flush fails at close as a ``RuntimeError`` and leaves
    the library with a file it can neither flush nor close: the process then crashes at
    exit (SIGSEGV, seen on a filled tmpfs with h5py 3.x), so a rank that ran out of disk
    at a preemption would die instead of stopping as preempted.
    """
    path = Path(path)
    meta_bytes = _json_array(meta, "meta")  # a bad meta fails before any file exists
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w+b") as raw:
            with (
                h5py.File(raw, "w", libver=_LIBVER, track_order=True, locking=False) as f,
                ThreadPoolExecutor(_CRC_THREADS, thread_name_prefix="crc32") as pool,
            ):
                writer = _Writer(f, pool)
                writer.write(tree, meta_bytes)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException as exc:  # also KeyboardInterrupt / SystemExit from a signal handler
        tmp.unlink(missing_ok=True)
        if type(exc) is RuntimeError:  # any other failure h5py reports this way
            raise CheckpointError(f"writing {path} failed: {' '.join(str(exc).split())}") from exc
        raise
    fsync_dir(path.parent)
    return file_checksum(writer.crcs)


def file_checksum(crcs: dict[str, list[int]]) -> int:
    """CRC-32 of every dataset's CRC-32s in path order: one number for a whole file."""
    text = json.dumps(sorted(crcs.items()))
    return zlib.crc32(text.encode())


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # some filesystems cannot fsync a directory
            raise
    finally:
        os.close(fd)


def _json_array(value: Any, what: str) -> np.ndarray:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serialisable: {exc}") from None
    return np.frombuffer(text.encode(), dtype=np.uint8)


def _crc_blocks(pool: ThreadPoolExecutor, arr: np.ndarray, block: int) -> list[Future[int]]:
    """CRC-32 of each ``block`` bytes of ``arr`` (one block if empty), computed on ``pool``."""
    flat = arr.reshape(-1).view(np.uint8)
    return [
        pool.submit(zlib.crc32, flat[start : start + block])
        for start in range(0, max(flat.size, 1), block)
    ]


def _escape(key: str) -> str:
    """An HDF5 link name for a dict key ('/' is a path separator, '.' alone means 'here')."""
    if key == "":
        return "%empty"  # cannot collide: a literal '%' is always escaped as %25
    name = key.replace("%", "%25").replace("/", "%2F")
    return "%2E" + name[1:] if name.startswith(".") else name


def _unescape(name: str) -> str:
    return "" if name == "%empty" else unquote(name)


def _set_attrs(obj: h5py.HLObject, attrs: dict[str, str | int]) -> None:
    for key, value in attrs.items():
        # Fixed-length byte strings, never variable-length ones (no object dtypes anywhere).
        obj.attrs[key] = np.bytes_(value.encode()) if isinstance(value, str) else np.int64(value)


def _tensor_to_array(t: torch.Tensor, where: str) -> tuple[np.ndarray, dict[str, str | int]]:
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"cannot store {where}: {t.layout} / quantized tensors are not supported")
    t = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    attrs: dict[str, str | int] = {"kind": "torch", "dtype": str(t.dtype).removeprefix("torch.")}
    if t.dtype in _NATIVE_TORCH:
        return t.numpy(), attrs
    width = t.element_size()
    if width in _BITS:
        return t.view(_SIGNED_TORCH[width]).numpy().view(_BITS[width]), attrs
    attrs["shape"] = json.dumps(list(t.shape))
    return t.reshape(-1).view(torch.uint8).numpy(), attrs


def _numpy_to_array(a: np.ndarray, where: str) -> tuple[np.ndarray, dict[str, str | int]]:
    if a.dtype.kind not in "biufc":
        raise TypeError(f"cannot store {where}: numpy dtype {a.dtype} (numeric and bool only)")
    attrs: dict[str, str | int] = {"kind": "numpy", "dtype": a.dtype.str}
    a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
    if a.dtype.kind in "iuf":
        return a, attrs
    if a.dtype.itemsize in _BITS:
        return a.view(_BITS[a.dtype.itemsize]), attrs
    attrs["shape"] = json.dumps(list(a.shape))
    return a.reshape(-1).view(np.uint8), attrs


def _is_buffer_list(value: list) -> bool:
    return bool(value) and all(
        isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 1 for x in value
    )


class _Writer:
    """Writes the tree, one leaf at a time; each leaf's checksums run on worker threads
    (zlib.crc32 releases the GIL) while HDF5 writes it. A leaf may be a function returning
    the value (e.g. a tensor gathered from shards): it is called when its turn comes, in the
    tree's order, and its value is released once written."""

    def __init__(self, f: h5py.File, pool: ThreadPoolExecutor):
        self.f, self.pool = f, pool
        self.manifest: list[str] = []
        self.crcs: dict[str, list[int]] = {}

    def write(self, tree: dict, meta_bytes: np.ndarray) -> None:
        if not isinstance(tree, dict):
            raise TypeError(f"the checkpoint tree must be a dict, got {type(tree).__name__}")
        _set_attrs(self.f, {"format": FORMAT, "format_version": PART_FORMAT_VERSION})
        self.dataset(self.f, "meta", meta_bytes, {"kind": "json"})
        self.node(self.f, "tree", tree, "tree")
        manifest = _json_array(self.manifest, "manifest")
        self.dataset(self.f, "manifest", manifest, {"kind": "json"}, listed=False)

    def dataset(
        self,
        group: h5py.Group,
        name: str,
        arr: np.ndarray,
        attrs: dict[str, str | int],
        listed: bool = True,
    ) -> h5py.Dataset:
        # Checksums run while HDF5 writes the same (unchanging) memory.
        crcs = _crc_blocks(self.pool, arr, CRC_BLOCK)
        ds = group.create_dataset(name, data=arr)
        _set_attrs(ds, attrs)
        self.crcs[ds.name] = [crc.result() for crc in crcs]
        ds.attrs["crc32"] = np.array(self.crcs[ds.name], dtype=np.uint32)
        ds.attrs["crc32_block"] = np.int64(CRC_BLOCK)
        if listed:
            self.manifest.append(ds.name)
        return ds

    def group(self, parent: h5py.Group, name: str, kind: str) -> h5py.Group:
        g = parent.create_group(name, track_order=True)
        _set_attrs(g, {"kind": kind})
        return g

    def node(self, parent: h5py.Group, name: str, value: Any, where: str) -> h5py.HLObject:
        if callable(value):  # a lazy leaf (see the class docstring)
            value = value()
        if isinstance(value, torch.Tensor):
            return self.dataset(parent, name, *_tensor_to_array(value, where))
        if isinstance(value, np.ndarray | np.generic):
            arr, attrs = _numpy_to_array(np.asarray(value), where)
            if isinstance(value, np.generic):
                attrs["scalar"] = 1
            return self.dataset(parent, name, arr, attrs)
        if isinstance(value, dict):
            return self.dict_node(parent, name, value, where)
        if isinstance(value, list) and _is_buffer_list(value):
            return self.buffers(parent, name, value)
        if isinstance(value, list | tuple):
            container = "tuple" if isinstance(value, tuple) else "list"
            if all(isinstance(x, _SCALARS) for x in value):
                arr = _json_array(list(value), where)
                return self.dataset(parent, name, arr, {"kind": "json", "container": container})
            g = self.group(parent, name, container)
            for i, item in enumerate(value):
                self.node(g, str(i), item, f"{where}/{i}")
            return g
        if isinstance(value, _SCALARS):
            return self.dataset(parent, name, _json_array(value, where), {"kind": "json"})
        raise TypeError(
            f"cannot store {where}: {type(value).__name__} (supported: torch.Tensor, numpy "
            "arrays, dict, list, tuple, None, bool, int, float, str)"
        )

    def dict_node(self, parent: h5py.Group, name: str, value: dict, where: str) -> h5py.Group:
        g = self.group(parent, name, "dict")
        for key, item in value.items():
            if isinstance(key, int | np.integer) and not isinstance(key, bool):
                link = str(int(key))
            elif isinstance(key, str):
                link = _escape(key)
            else:
                raise TypeError(f"cannot store {where}: key {key!r} is not a str or an int")
            if link in g:
                raise TypeError(f"cannot store {where}: keys {key!r} and {link!r} collide")
            child = self.node(g, link, item, f"{where}/{key}")
            if not isinstance(key, str):
                _set_attrs(child, {"key_type": "int"})
        return g

    def buffers(self, parent: h5py.Group, name: str, items: list[np.ndarray]) -> h5py.Group:
        g = self.group(parent, name, "buffers")
        ends = np.cumsum([x.size for x in items], dtype=np.int64)
        self.dataset(g, "data", np.concatenate(items), {"kind": "numpy", "dtype": "|u1"})
        self.dataset(g, "ends", ends, {"kind": "numpy", "dtype": ends.dtype.str})
        return g


# --- loading and verifying --------------------------------------------------------------


def load_checkpoint(path: str | Path) -> tuple[dict, dict]:
    """(tree, meta) from a checkpoint; raises CheckpointError (one line) if anything is off.

    Tensors come back on the CPU with their exact dtype and bits; int dict keys stay ints.
    """
    reader = _read(Path(path), build=True)
    return reader.tree, reader.meta


def verify_checkpoint(path: str | Path) -> int:
    """Check format, manifest and every checksum without building tensors; returns the
    file's checksum (``save_checkpoint``'s)."""
    return file_checksum(_read(Path(path), build=False).crcs)


@dataclass
class CheckpointSummary:
    """What ``describe_checkpoint`` found in a verified file."""

    path: Path
    format_version: int
    meta: dict
    tensor_count: int  # torch and numpy leaves
    tensor_bytes: int
    file_bytes: int
    buffers: dict[str, list[np.ndarray]] = field(default_factory=dict)  # tree path -> items


def describe_checkpoint(path: str | Path) -> CheckpointSummary:
    """Verify a checkpoint and summarise it (sizes, counts, buffer lists) for inspection."""
    path = Path(path)
    reader = _read(path, build=False)
    return CheckpointSummary(
        path=path,
        format_version=reader.format_version,
        meta=reader.meta,
        tensor_count=reader.tensor_count,
        tensor_bytes=reader.tensor_bytes,
        file_bytes=path.stat().st_size,
        buffers=reader.buffers,
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _read(path: Path, build: bool) -> _Reader:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    reader = _Reader(path, build)
    try:
        with (
            h5py.File(path, "r", locking=False) as f,
            ThreadPoolExecutor(_CRC_THREADS, thread_name_prefix="crc32") as pool,
        ):
            reader.read(f, pool)
    except CheckpointError:
        raise
    except Exception as exc:  # h5py raises OSError, KeyError, ValueError... on damaged files
        raise CheckpointError(
            f"checkpoint {path}: unreadable HDF5 at '{reader.where}': {_one_line(exc)}"
        ) from None
    return reader


def _attr(obj: h5py.HLObject, name: str, default: Any = None) -> Any:
    value = obj.attrs.get(name, default)
    return value.decode() if isinstance(value, bytes) else value


class _Reader:
    """Walks the file. When building, the checksums of large leaves run on worker threads
    while the next datasets are read, and are all checked before the tree is returned;
    small datasets (JSON, offsets) are checked before they are parsed."""

    def __init__(self, path: Path, build: bool):
        self.path, self.build = path, build
        self.pool: ThreadPoolExecutor | None = None
        self.checksums: list[tuple[str, np.ndarray, list[Future[int]]]] = []
        self.where = "/"
        self.seen: set[str] = set()
        self.crcs: dict[str, list[int]] = {}
        self.bytes_read = 0
        self.format_version = 0
        self.meta: dict = {}
        self.tree: dict = {}
        self.tensor_count = self.tensor_bytes = 0
        self.buffers: dict[str, list[np.ndarray]] = {}

    def fail(self, name: str, what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.path}: dataset '{name}' {what}")

    def read(self, f: h5py.File, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        fmt, version = _attr(f, "format"), _attr(f, "format_version")
        if fmt != FORMAT:
            raise CheckpointError(f"checkpoint {self.path}: not an {FORMAT} file (format={fmt!r})")
        if version != PART_FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {self.path}: format version {version}, this code reads {PART_FORMAT_VERSION}"
            )
        self.format_version = int(version)
        manifest = json.loads(self.array(self.get(f, "manifest")).tobytes())
        self.meta = json.loads(self.array(self.get(f, "meta")).tobytes())
        self.tree = self.node(self.get(f, "tree"))
        for name, stored, crcs in self.checksums:
            self.check(name, stored, crcs)
        missing = [name for name in manifest if name not in self.seen]
        if missing:
            raise self.fail(missing[0], "is missing")
        extra = self.seen - set(manifest) - {"/manifest", "/meta"}
        if extra:
            raise self.fail(sorted(extra)[0], "is not in the manifest")

    def get(self, group: h5py.Group, name: str) -> h5py.HLObject:
        self.where = f"{group.name.rstrip('/')}/{name}"
        obj = group.get(name)
        if obj is None:
            raise self.fail(self.where, "is missing")
        return obj

    def array(self, ds: h5py.Dataset, large: bool = False) -> np.ndarray:
        self.where = ds.name
        if not isinstance(ds, h5py.Dataset):
            raise self.fail(ds.name, "is a group, expected a dataset")
        if ds.dtype.kind not in "iuf":  # checked before reading: never touch an object dtype
            raise self.fail(ds.name, f"has dtype {ds.dtype}, only plain numbers are allowed")
        stored, block = ds.attrs.get("crc32"), ds.attrs.get("crc32_block")
        if stored is None or block is None or int(block) < 1:
            raise self.fail(ds.name, "has no checksum")
        stored = np.atleast_1d(stored)
        arr = np.empty(ds.shape, ds.dtype)
        try:
            ds.read_direct(arr)  # several times faster than ds[...] on large datasets
        except Exception as exc:
            raise self.fail(ds.name, f"is unreadable: {_one_line(exc)}") from None
        self.seen.add(ds.name)
        self.bytes_read += arr.nbytes
        crcs = _crc_blocks(self.pool, arr, int(block))
        if large and self.build:  # checked at the end, while the next datasets are read
            self.checksums.append((ds.name, stored, crcs))
        else:
            self.check(ds.name, stored, crcs)
        return arr

    def check(self, name: str, stored: np.ndarray, crcs: list[Future[int]]) -> None:
        computed = [crc.result() for crc in crcs]
        if len(computed) != len(stored):
            raise self.fail(name, f"has {len(stored)} checksums for {len(computed)} blocks")
        self.crcs[name] = computed
        for block, (want, got) in enumerate(zip(stored.tolist(), computed, strict=True)):
            if want != got:
                raise self.fail(
                    name,
                    f"fails its checksum (block {block}: stored {want:#010x}, read {got:#010x})",
                )

    def node(self, obj: h5py.HLObject) -> Any:
        self.where = obj.name
        kind = _attr(obj, "kind")
        if isinstance(obj, h5py.Group):
            if kind == "dict":
                return {self.key(obj[name], name): self.node(obj[name]) for name in obj}
            if kind in ("list", "tuple"):
                items = [self.node(self.get(obj, str(i))) for i in range(len(obj))]
                return tuple(items) if kind == "tuple" else items
            if kind == "buffers":
                return self.buffer_list(obj)
        elif kind == "json":
            value = json.loads(self.array(obj).tobytes())
            return tuple(value) if _attr(obj, "container") == "tuple" else value
        elif kind in ("torch", "numpy"):
            return self.leaf(obj, kind)
        raise self.fail(obj.name, f"has unknown kind {kind!r}")

    def key(self, obj: h5py.HLObject, name: str) -> str | int:
        return int(name) if _attr(obj, "key_type") == "int" else _unescape(name)

    def buffer_list(self, g: h5py.Group) -> list[np.ndarray]:
        data, ends = self.array(self.get(g, "data"), large=True), self.array(self.get(g, "ends"))
        if ends.ndim != 1 or (ends.size and ends[-1] != data.size):
            raise self.fail(g.name, "has offsets that do not match its data")
        starts = np.concatenate([[0], ends[:-1]])
        items = [data[s:e] for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
        self.buffers[g.name.removeprefix("/tree")] = items
        return items

    def leaf(self, ds: h5py.Dataset, kind: str) -> Any:
        arr = self.array(ds, large=True)
        dtype_name = _attr(ds, "dtype")
        try:
            value = _to_tensor(arr, ds) if kind == "torch" else _to_numpy(arr, ds)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise self.fail(
                ds.name, f"cannot become {kind} {dtype_name}: {_one_line(exc)}"
            ) from None
        self.tensor_count += 1
        self.tensor_bytes += arr.nbytes
        return value if self.build else None


def _stored_shape(arr: np.ndarray, ds: h5py.Dataset) -> tuple[int, ...]:
    shape = _attr(ds, "shape")
    return tuple(json.loads(shape)) if shape is not None else arr.shape


def _to_tensor(arr: np.ndarray, ds: h5py.Dataset) -> torch.Tensor:
    dtype = getattr(torch, _attr(ds, "dtype"), None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unknown torch dtype {_attr(ds, 'dtype')!r}")
    if not arr.dtype.isnative:  # written on a machine of the other byte order
        arr = arr.byteswap().view(arr.dtype.newbyteorder("="))
    if dtype in _NATIVE_TORCH:
        if arr.dtype != _NATIVE_TORCH[dtype]:
            raise TypeError(f"stored as {arr.dtype}")
        return torch.from_numpy(arr)
    if _attr(ds, "shape") is not None:
        return torch.from_numpy(arr).view(dtype).reshape(_stored_shape(arr, ds))
    width = arr.dtype.itemsize
    return torch.from_numpy(arr.view(_SIGNED_NP[width])).view(dtype)


def _to_numpy(arr: np.ndarray, ds: h5py.Dataset) -> np.ndarray | np.generic:
    dtype = np.dtype(_attr(ds, "dtype"))
    if dtype.kind not in "biufc":
        raise TypeError(f"numpy dtype {dtype} is not allowed")
    value = arr if arr.dtype == dtype else arr.reshape(-1).view(dtype)
    value = value.reshape(_stored_shape(arr, ds))
    return value[()] if _attr(ds, "scalar") else value


# --- reading parts of a checkpoint ------------------------------------------------------


class StateReader(Protocol):
    """What a restore reads from: values, child keys and rows of tensors by path;
    ``source`` names it in errors (the checkpoint folder)."""

    source: str

    def get(self, *path: str | int) -> Any:
        """The value at ``path`` (a subtree comes back whole), or None if absent."""
        ...

    def keys(self, *path: str | int) -> list[str | int] | None:
        """The keys of the dict at ``path``, or None if there is none."""
        ...

    def shape(self, path: tuple) -> tuple[int, ...] | None:
        """The whole tensor's shape at ``path``; None for a scalar or nothing."""
        ...

    def rows(self, path: tuple, rows: slice) -> torch.Tensor:
        """Rows ``rows`` (of the first dimension) of the whole tensor at ``path``."""
        ...


class TreeReader:
    """A ``StateReader`` over a tree in memory (tests, tools)."""

    def __init__(self, tree: dict, source: str = "in memory"):
        self.tree, self.source = tree, source

    def _at(self, path: tuple) -> Any:
        node: Any = self.tree
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def get(self, *path: str | int) -> Any:
        return self._at(path)

    def keys(self, *path: str | int) -> list[str | int] | None:
        node = self._at(path)
        return list(node) if isinstance(node, dict) else None

    def shape(self, path: tuple) -> tuple[int, ...] | None:
        node = self._at(path)
        return tuple(node.shape) if isinstance(node, torch.Tensor) and node.dim() else None

    def rows(self, path: tuple, rows: slice) -> torch.Tensor:
        return self._at(path)[rows]


class CheckpointReader:
    """Reads single values from a checkpoint file, each verified against its checksums as it
    is read: a rank takes what it needs, one tensor at a time, and keeps nothing else.

    Use it as a context manager. It checks the file's format, not its completeness: verify
    the whole file once first (``verify_checkpoint``, done by the trainer leader on resume).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file: h5py.File | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.meta: dict = {}
        self.bytes_read = 0  # of datasets, verified: what this reader took from the file

    def __enter__(self) -> CheckpointReader:
        try:
            self._file = h5py.File(self.path, "r", locking=False)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {self.path}: unreadable: {_one_line(exc)}") from None
        self._pool = ThreadPoolExecutor(_CRC_THREADS, thread_name_prefix="crc32")
        reader = self._reader()
        fmt, version = _attr(self._file, "format"), _attr(self._file, "format_version")
        if fmt != FORMAT or version != PART_FORMAT_VERSION:
            self.__exit__()
            raise CheckpointError(
                f"checkpoint {self.path}: not an {FORMAT} file of version {PART_FORMAT_VERSION}"
            )
        self.meta = json.loads(reader.array(reader.get(self._file, "meta")).tobytes())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        if self._file is not None:
            self._file.close()
        self._file = self._pool = None

    def _reader(self) -> _Reader:
        reader = _Reader(self.path, build=True)
        reader.pool = self._pool
        return reader

    def _find(self, path: tuple) -> h5py.HLObject | None:
        node = self._file["tree"]
        for key in path:
            link = str(int(key)) if isinstance(key, int) else _escape(str(key))
            if not isinstance(node, h5py.Group) or link not in node:
                return None
            node = node[link]
        return node

    def get(self, *path: str | int) -> Any:
        obj = self._find(path)
        if obj is None:
            return None
        reader = self._reader()
        try:
            value = reader.node(obj)
            for name, stored, crcs in reader.checksums:
                reader.check(name, stored, crcs)
            self.bytes_read += reader.bytes_read
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {self.path}: unreadable HDF5 at '{reader.where}': {_one_line(exc)}"
            ) from None
        return value

    def keys(self, *path: str | int) -> list[str | int] | None:
        obj = self._find(path)
        if not isinstance(obj, h5py.Group) or _attr(obj, "kind") != "dict":
            return None
        reader = self._reader()
        return [reader.key(obj[name], name) for name in obj]


# --- model compatibility ----------------------------------------------------------------


def _describe(t: Any) -> tuple[tuple[int, ...], str]:
    dtype = t.dtype
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype.name
    return tuple(t.shape), name


def check_compatible(
    checkpoint_tensors: Mapping[str, Any],
    model_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    source: str | Path | None = None,
) -> None:
    """Raise CheckpointError naming the first tensor missing on either side or whose
    shape or dtype differs. ``model_tensors``: e.g. ``model.named_parameters()`` or a
    state dict; tensors may be torch or numpy."""
    prefix = f"checkpoint {source}" if source is not None else "checkpoint"
    model = dict(model_tensors)
    for name, tensor in model.items():
        if name not in checkpoint_tensors:
            raise CheckpointError(f"{prefix} has no tensor {name!r}, which the model has")
        (ckpt_shape, ckpt_dtype), (shape, dtype) = (
            _describe(checkpoint_tensors[name]),
            _describe(tensor),
        )
        if ckpt_shape != shape:
            raise CheckpointError(
                f"{prefix}: tensor {name!r} has shape {ckpt_shape}, the model has {shape}"
            )
        if ckpt_dtype != dtype:
            raise CheckpointError(
                f"{prefix}: tensor {name!r} has dtype {ckpt_dtype}, the model has {dtype}"
            )
    for name in checkpoint_tensors:
        if name not in model:
            raise CheckpointError(f"{prefix} has tensor {name!r}, which the model does not have")


# --- random number generators -----------------------------------------------------------


def rng_state() -> dict:
    """This process's RNG states (Python, NumPy global, torch CPU, CUDA if present) as a
    checkpoint tree: numbers and tensors only."""
    version, mt, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": {"version": version, "mt": np.array(mt, dtype=np.int64), "gauss": gauss_next},
        "numpy": {
            "name": name,
            "keys": keys.copy(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` captured (after a round trip through a checkpoint)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["mt"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["name"], npy["keys"], npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda", [])
    if cuda and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if len(cuda) != count:
            log.warning("checkpoint has CUDA RNG states for %d devices, this process sees %d: "
                        "restoring the first %d", len(cuda), count, min(len(cuda), count))  # fmt: skip
        for device, s in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(s, device)
