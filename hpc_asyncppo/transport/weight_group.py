"""Who takes part in a weight sync, and how they meet: the weight group.

The trainer leader is rank 0. The other members are the processes that hold the inference
weights, every one of them: the HF engine's rollout rank itself, or every vLLM worker of
every rollout rank (each tensor-parallel worker included). Rollout rank ``r`` with ``W``
workers per rank has members ``1 + r * W ... 1 + r * W + W - 1`` (``member_rank``). Each
member receives the full tensors of every bucket (``weights.WeightReceiver``) and loads
them itself (vLLM's loader shards them for tensor parallelism), so the process that
drives a vLLM engine never holds a copy of the weights.

The group is *stateless*: a TCPStore at the leader's address and a process group built on
it directly, never registered with torch.distributed. It neither needs nor touches the
default process group (the whole MPI job on a rank, and nothing at all in a vLLM worker),
so a rank that never joins a weight sync cannot stall one. NCCL when every member has a
GPU of its own, gloo (through host memory) otherwise; the protocol above it is the same
code. Every collective on it, the rendezvous included, is bounded by ``timeout_s``.

A member that dies (a vLLM engine restarted inside its rollout rank) breaks the group: the
members meet again in a new one on the same store, its ``generation`` one higher
(``WeightGroupSpec.regrouped``; the trainer leader orders it, ``trainer/sync.py``), and
the generation it replaces is closed (``WeightGroup.close``).

Bounded on both backends, so that a failure is one error on one code path:
- *The join meets eagerly.* Gloo connects every pair as the group is built. NCCL would
  create its communicator only at the first broadcast, outside any join's bound, in
  blocking mode (no timeout at all): here it is created at once
  (``eager_connect_single_device``), non-blocking (``config.blocking = 0``: torch polls
  its creation against ``TORCH_NCCL_NONBLOCKING_TIMEOUT``, which ``nccl_environment``
  sets to the group's timeout, and aborts it past that), and both backends then complete
  a warm-up broadcast before ``open_weight_group`` returns.
- *A collective that fails or passes the timeout raises.* Torch's default NCCL error
  handling tears the process down from its watchdog; the group's NCCL backend is built
  with blocking wait (``TORCH_NCCL_BLOCKING_WAIT``, read as a backend is built), under
  which ``Work.wait`` blocks until completion or ``timeout_s``, aborts the communicator on
  a timeout or an error and raises ``DistBackendError``: a RuntimeError, as gloo's
  failures are, which the sync's recovery catches on both backends.
As read in ProcessGroupNCCL's source (a 2025 main, not 2.13's own text): both variables
are read per backend except the non-blocking timeout (once per process); under blocking
wait no watchdog runs for the backend, so none can end the process; a non-blocking
communicator made eagerly is waited for at the first collective (the warm-up). None of
this has run here: the suite runs gloo, and ``scripts/gpu_check.sh`` checks the NCCL side
(README, "Known limits")."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

_STORE_PREFIX = "hpc_asyncppo/weights"
NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"  # read once per process by torch
BLOCKING_WAIT_ENV = "TORCH_NCCL_BLOCKING_WAIT"  # read as each NCCL backend is built


@dataclass(frozen=True)
class WeightGroupSpec:
    """Where and how the weight group meets; plain values, so it can cross vLLM's RPC."""

    host: str
    port: int
    world_size: int  # 1 (the leader) + every member
    backend: str  # "nccl" or "gloo"
    timeout_s: float
    generation: int = 0  # how many times the members met anew (a member's engine restarted)

    def regrouped(self) -> WeightGroupSpec:
        """The next group of the same members, on the same store."""
        return replace(self, generation=self.generation + 1)

    def bucket_device(self, own: torch.device) -> torch.device:
        """Where a member's buckets travel: its own GPU under NCCL, host memory under gloo."""
        return own if self.backend == "nccl" else torch.device("cpu")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, values: dict) -> WeightGroupSpec:
        return cls(**{k: values[k] for k in cls.__dataclass_fields__})


def member_rank(rollout_rank: int, worker: int, workers_per_rank: int) -> int:
    """The weight-group rank of ``worker`` (0 .. W-1, e.g. a TP rank) of ``rollout_rank``."""
    if not 0 <= worker < workers_per_rank:
        raise ValueError(f"worker {worker} of a rank with {workers_per_rank} workers")
    return 1 + rollout_rank * workers_per_rank + worker


def group_size(rollout_ranks: int, workers_per_rank: int) -> int:
    return 1 + rollout_ranks * workers_per_rank


class WeightGroup:
    """A joined weight group: ``broadcast`` (asynchronous, a ``Work`` to wait on) is all a
    sync needs. Holds the store: rank 0 serves it for as long as the group lives.

    ``close`` aborts it when a newer generation replaces it: its communicators and their
    buffers go at once (NCCL: device memory and channels per communicator), and a
    collective still posted on it ends instead of holding them. A group merely dropped
    would be shut down by its destructor, which under NCCL waits for every posted
    collective: on a group broken by a dead member, forever. A closed group refuses
    further broadcasts at once (a RuntimeError, as a broken sync raises)."""

    def __init__(self, group: dist.ProcessGroup, store: dist.Store, spec: WeightGroupSpec):
        self.group, self.store, self.spec = group, store, spec
        self.closed = False

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work:
        if self.closed:
            raise RuntimeError(
                f"the weight group's generation {self.spec.generation} is closed: a newer "
                "generation replaced it"
            )
        return self.group.broadcast(tensor, src)

    def close(self) -> None:
        """Abort the group (idempotent): see the class's docstring."""
        if not self.closed:
            self.closed = True
            self.group.abort()


def serve_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The leader's store of the weight group, on a port the system picks (``.port``), bound
    at once and held until the group opens: a port only chosen early and bound when the
    group opens (after the policy or vLLM has started, seconds later) can be taken by then
    (seen: EADDRINUSE with two test workers' jobs on one host)."""
    return dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def nccl_environment(timeout_s: float) -> None:
    """Bound a non-blocking NCCL communicator's creation by ``timeout_s`` (torch's default:
    30 minutes) in this process and the processes it starts (vLLM's workers), unless the
    user set it. Torch reads it once per process, at the first non-blocking communicator:
    a rank calls this before its first process group."""
    os.environ.setdefault(NONBLOCKING_TIMEOUT_ENV, str(math.ceil(timeout_s)))


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def open_weight_group(
    spec: WeightGroupSpec, rank: int, store: dist.TCPStore | None = None
) -> WeightGroup:
    """Join the weight group as ``rank`` (0: the leader, which serves the store: ``store``,
    from ``serve_store``, or one made here on ``spec.port``). Returns once every member has
    joined and a warm-up broadcast has gone through (NCCL: its communicator exists);
    raises within about ``spec.timeout_s`` otherwise (the module's docstring)."""
    timeout = timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(
            spec.host,
            spec.port,
            spec.world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    prefixed = dist.PrefixStore(f"{_STORE_PREFIX}/{spec.generation}", store)
    group = dist.ProcessGroup(prefixed, rank, spec.world_size)
    if spec.backend == "nccl":
        nccl_environment(spec.timeout_s)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.config.blocking = 0
        with _environment(BLOCKING_WAIT_ENV, "1"):
            backend = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
        kind = dist.ProcessGroup.BackendType.NCCL
        device = torch.device("cuda", torch.cuda.current_device())
    elif spec.backend == "gloo":
        backend = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
        kind, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        raise ValueError(f"weight group backend {spec.backend!r}: valid are nccl, gloo")
    backend._set_sequence_number_for_group()
    group._set_default_backend(kind)
    group._register_backend(torch.device(device.type), kind, backend)
    joined = WeightGroup(group, store, spec)
    try:
        if spec.backend == "nccl":
            backend.eager_connect_single_device(device)
        joined.broadcast(torch.zeros(1, device=device), 0).wait()  # the warm-up
    except BaseException:
        joined.close()
        raise
    return joined
