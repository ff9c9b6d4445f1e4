"""Who is who: the MPI and torch.distributed layout every rank builds at start.

World ranks [0, R) are rollout ranks, [R, R+T) trainer ranks; rank R is the trainer
leader. MPI: COMM_WORLD split by role, and an intercommunicator between the two sides
(samples). torch.distributed over all ranks (rendezvous address sent over MPI), with one
group: the trainer ranks (gradient all-reduce). Weights travel in a group of their own,
made apart from torch.distributed's world (``transport/weight_group.py``): the trainer
leader and every process holding inference weights (each vLLM worker, or the HF
engine's rank); this layout only says where it meets and with which backend. The same
layout under mpirun (local) and srun (one Slurm het step).

With CUDA, each rank works on the first GPU of the set it bound itself to (``gpus.py``:
a rollout rank sees its tensor_parallel_size GPUs, a trainer rank one) and the groups use
NCCL, which needs a GPU per rank. Where the weight group would share a GPU (a rollout
rank's GPUs include the trainer leader's, on a one-GPU workstation), it uses gloo through
host memory instead; trainer ranks sharing a GPU are refused with an error saying so.
Every group is bounded by a timeout: the trainer group and the default group by
``timeout_s`` (``timeouts.weight_sync_s``), the weight group likewise.

The ranks meet first in a barrier polled with sleeps (``transport/waits.py``), bounded by
``timeouts.start_s``: ranks finish their imports seconds apart (more under Slurm, where the
components start apart), and Open MPI's blocking collectives spin a core while they wait,
taking it from the ranks still importing on a shared node.
"""

from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from hpc_asyncppo.transport.waits import wait_request
from hpc_asyncppo.transport.weight_group import (
    WeightGroupSpec,
    group_size,
    nccl_environment,
    serve_store,
)

ROLLOUT, TRAINER = "rollout", "trainer"


@dataclass
class Topology:
    world_rank: int
    world_size: int
    rollout_ranks: int
    role: str
    local: MPI.Intracomm  # this role's ranks
    inter: MPI.Intercomm  # rollout side <-> trainer side
    trainer_group: dist.ProcessGroup | None  # gradient all-reduce (trainer ranks only)
    weights: WeightGroupSpec  # where the weight group meets (leader = its rank 0)
    weights_store: dist.TCPStore | None  # the leader's, already serving (serve_store)
    workers_per_rank: int  # weight-group members per rollout rank (vLLM: its TP workers)
    device: torch.device

    @property
    def train_ranks(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def leader(self) -> int:
        """World rank of the trainer leader."""
        return self.rollout_ranks

    @property
    def is_leader(self) -> bool:
        return self.world_rank == self.leader

    @property
    def local_rank(self) -> int:
        return self.local.Get_rank()


def rollout_rank_count() -> int:
    """R, from our launcher's variable or Slurm's size of het group 0."""
    value = os.environ.get("HPC_ASYNCPPO_ROLLOUT_RANKS") or os.environ.get(
        "SLURM_NTASKS_HET_GROUP_0"
    )
    if not value:
        raise RuntimeError(
            "cannot tell rollout ranks from trainer ranks: set HPC_ASYNCPPO_ROLLOUT_RANKS "
            "or run inside a Slurm heterogeneous job step"
        )
    return int(value)


def role_of(world_rank: int, rollout_ranks: int) -> str:
    return ROLLOUT if world_rank < rollout_ranks else TRAINER


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def bcast_text(world: MPI.Intracomm, text: str, root: int) -> str:
    """Broadcast a short string as bytes (no pickle)."""
    buf = np.zeros(4096, dtype=np.uint8)
    if world.Get_rank() == root:
        raw = text.encode()
        if len(raw) > buf.size:
            raise ValueError(f"cannot broadcast {len(raw)} bytes of text (at most {buf.size})")
        buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    world.Bcast([buf, MPI.BYTE], root=root)
    return buf.tobytes().rstrip(b"\0").decode()


def _rendezvous_host() -> str:
    host = os.environ.get("HPC_ASYNCPPO_RENDEZVOUS_HOST")
    if host:
        return host
    if os.environ.get("SLURM_JOB_ID"):
        return socket.gethostname()
    return "127.0.0.1"


def build_topology(
    rollout_ranks: int, timeout_s: float, workers_per_rank: int = 1, start_s: float = 1800.0
) -> Topology:
    """Collective over COMM_WORLD. ``workers_per_rank``: how many processes of each rollout
    rank hold its inference weights (vLLM: ``tensor_parallel_size``; HF: 1, the rank).
    ``start_s``: how long a rank waits for the last one to finish its start-up."""
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if not 0 < rollout_ranks < size:
        raise RuntimeError(
            f"{size} ranks cannot hold {rollout_ranks} rollout ranks and >= 1 trainer rank"
        )
    waiting = f"every one of the job's {size} ranks to finish starting (timeouts.start_s)"
    wait_request(world.Ibarrier(), start_s, waiting)
    role = role_of(rank, rollout_ranks)
    local = world.Split(0 if role == ROLLOUT else 1, rank)
    remote_leader = rollout_ranks if role == ROLLOUT else 0
    inter = local.Create_intercomm(0, world, remote_leader, tag=7)

    leader = rollout_ranks
    here = _rendezvous_host()
    weights_size = group_size(rollout_ranks, workers_per_rank)
    # the leader's weight-group store is bound now and kept (serve_store says why)
    store = serve_store(here, weights_size, timeout_s) if rank == leader else None
    address, weights_port = bcast_text(
        world, f"{here}:{_free_port()} {store.port}" if store is not None else "", root=leader
    ).split()
    device = _pick_device()
    nccl_environment(timeout_s)  # before any process group here or in vLLM's workers
    # A CPU tensor on the default group goes through gloo, a CUDA tensor through NCCL.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    trainer_ranks = list(range(rollout_ranks, size))
    weights_backend = "gloo"
    if device.type == "cuda":
        gpus = _gpus_of_every_rank(world, device)
        if shared := _sharing([g[:1] for g in gpus], trainer_ranks):
            raise RuntimeError(
                f"trainer ranks {shared} share one GPU; NCCL needs a GPU "
                "per trainer rank: request as many GPUs per node as trainer tasks per node"
            )
        # NCCL refuses two members on one GPU: then the weights go through host memory.
        # the leader sends from its own GPU; a rollout rank's workers use every GPU it sees
        members = [g if r < rollout_ranks else g[:1] for r, g in enumerate(gpus)]
        weights_backend = "gloo" if _sharing(members, [leader, *range(rollout_ranks)]) else "nccl"
    weights = WeightGroupSpec(
        host=address.rsplit(":", 1)[0],
        port=int(weights_port),
        world_size=weights_size,
        backend=weights_backend,
        timeout_s=timeout_s,
    )
    # new_group is collective over the whole world: every rank creates it.
    trainer_group = dist.new_group(trainer_ranks, timeout=timedelta(seconds=timeout_s))
    return Topology(
        world_rank=rank,
        world_size=size,
        rollout_ranks=rollout_ranks,
        role=role,
        local=local,
        inter=inter,
        trainer_group=trainer_group if role == TRAINER else None,
        weights=weights,
        weights_store=store,
        workers_per_rank=workers_per_rank,
        device=device,
    )


def _pick_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if os.environ.get("HPC_ASYNCPPO_GPUS"):
        # The rank bound itself to its GPU set (launch/gpus.py): its first is cuda:0.
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    # Not bound (topology built outside rank.py): pick by local rank.
    local_rank = (
        os.environ.get("SLURM_LOCALID") or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or "0"
    )
    torch.cuda.set_device(int(local_rank) % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


MAX_GPUS_PER_RANK = 16


def _gpus_of_every_rank(world: MPI.Intracomm, device: torch.device) -> list[list[int]]:
    """Per world rank, numbers naming the node and GPUs it works on (equal numbers: the
    same GPU): its own device first, then the other GPUs it sees (a rollout rank's vLLM
    workers use all of them)."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    order = [device.index or 0] + [
        i for i in range(torch.cuda.device_count()) if i != (device.index or 0)
    ]
    ids = [
        zlib.crc32(f"{node}/{torch.cuda.get_device_properties(i).uuid}".encode()) for i in order
    ][:MAX_GPUS_PER_RANK]
    mine = np.full(MAX_GPUS_PER_RANK, -1, dtype=np.int64)
    mine[: len(ids)] = ids
    every = np.zeros((world.Get_size(), MAX_GPUS_PER_RANK), dtype=np.int64)
    world.Allgather([mine, MPI.INT64_T], [every, MPI.INT64_T])
    return [[int(g) for g in row if g >= 0] for row in every]


def _sharing(gpus: list[list[int]], ranks: list[int]) -> list[int]:
    """The ranks among ``ranks`` with a GPU that another of them also uses."""
    seen: dict[int, set[int]] = {}
    for r in ranks:
        for g in gpus[r]:
            seen.setdefault(g, set()).add(r)
    return sorted({r for group in seen.values() if len(group) > 1 for r in group})


def close_topology(topo: Topology) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    topo.inter.Free()
    topo.local.Free()
