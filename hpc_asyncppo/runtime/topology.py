"""Who is who: the MPI and torch.distributed layout every rank builds at start.

World ranks [0, R) are rollout ranks, [R, R+T) trainer ranks; rank R is the trainer
leader. MPI: COMM_WORLD split by role, and an intercommunicator between the two sides
(samples). torch.distributed over all ranks (rendezvous address sent over MPI), with two
groups: the trainer ranks (gradient all-reduce) and {trainer leader} + rollout ranks
(weight broadcast). The same layout under mpirun (local) and srun (one Slurm het step).

With CUDA, each rank works on the first GPU of the set it bound itself to (``gpus.py``:
a rollout rank sees its tensor_parallel_size GPUs, a trainer rank one) and the groups use
NCCL, which needs a GPU per rank. Where the weight-broadcast group shares a GPU (a rollout
rank beside the trainer leader on a one-GPU workstation), that group uses gloo through
host memory instead; trainer ranks sharing a GPU are refused with an error saying so.
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
    sync_group: dist.ProcessGroup | None  # weight broadcast (leader + rollout ranks only)
    device: torch.device
    sync_device: torch.device  # where weight buckets travel: ``device``, or the CPU (gloo)

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


def build_topology(rollout_ranks: int, timeout_s: float) -> Topology:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if not 0 < rollout_ranks < size:
        raise RuntimeError(
            f"{size} ranks cannot hold {rollout_ranks} rollout ranks and >= 1 trainer rank"
        )
    role = role_of(rank, rollout_ranks)
    local = world.Split(0 if role == ROLLOUT else 1, rank)
    remote_leader = rollout_ranks if role == ROLLOUT else 0
    inter = local.Create_intercomm(0, world, remote_leader, tag=7)

    leader = rollout_ranks
    address = bcast_text(
        world, f"{_rendezvous_host()}:{_free_port()}" if rank == leader else "", root=leader
    )
    device = _pick_device()
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
    sync_ranks = [leader, *range(rollout_ranks)]
    sync_backend, sync_device = None, device
    if device.type == "cuda":
        gpus = _gpu_of_every_rank(world, device)
        if shared := _sharing(gpus, trainer_ranks):
            raise RuntimeError(
                f"trainer ranks {shared} share one GPU; NCCL needs a GPU "
                "per trainer rank: request as many GPUs per node as trainer tasks per node"
            )
        if _sharing(gpus, sync_ranks):
            # NCCL refuses two ranks on one GPU: broadcast the weights through host memory.
            sync_backend, sync_device = "gloo", torch.device("cpu")
    # new_group is collective over the whole world: every rank creates both groups.
    trainer_group = dist.new_group(trainer_ranks)
    sync_group = dist.new_group(sync_ranks, backend=sync_backend)
    return Topology(
        world_rank=rank,
        world_size=size,
        rollout_ranks=rollout_ranks,
        role=role,
        local=local,
        inter=inter,
        trainer_group=trainer_group if role == TRAINER else None,
        sync_group=sync_group if (role == ROLLOUT or rank == leader) else None,
        device=device,
        sync_device=sync_device,
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


def _gpu_of_every_rank(world: MPI.Intracomm, device: torch.device) -> np.ndarray:
    """A number per world rank naming its node and GPU (equal numbers: the same GPU)."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    mine = np.array([zlib.crc32(f"{node}/{uuid}".encode())], dtype=np.int64)
    every = np.zeros(world.Get_size(), dtype=np.int64)
    world.Allgather([mine, MPI.INT64_T], [every, MPI.INT64_T])
    return every


def _sharing(gpus: np.ndarray, ranks: list[int]) -> list[int]:
    """The ranks among ``ranks`` on a GPU that another of them also uses."""
    seen: dict[int, list[int]] = {}
    for r in ranks:
        seen.setdefault(int(gpus[r]), []).append(r)
    return sorted(r for group in seen.values() if len(group) > 1 for r in group)


def close_topology(topo: Topology) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    topo.inter.Free()
    topo.local.Free()
