"""Which GPUs each rank sees: a rollout rank exactly its ``rollout.tensor_parallel_size``,
a trainer rank exactly one, on its own node.

The rank sets ``CUDA_VISIBLE_DEVICES`` to its set itself, before anything initialises CUDA
(torch caches the device list on first use) and before vLLM starts, so its vLLM workers
(child processes) inherit it. Then every rank works on ``cuda:0`` of what it sees.

- Under srun (``SLURM_LOCALID``): if Slurm already bound this task's GPUs
  (``--gpus-per-task``, which the batch script writes), the task sees exactly its set and
  keeps it; otherwise (``--gres`` clusters) it sees the node's GPUs and takes its slice by
  local rank.
- Under our mpirun (``--cluster local``, one machine): rollout ranks take the first GPUs,
  trainer ranks the next ones; when both do not fit (a one-GPU workstation) each role
  starts again at the first GPU, so the roles share GPUs (the weight broadcast then goes
  through host memory, see ``topology.py``).

An existing ``CUDA_VISIBLE_DEVICES`` is respected: the sets index into it. Pure functions
here (no torch), so they are unit-tested without a GPU; ``bind_gpus`` is the one that
reads and writes the environment. They take the ``slurm:`` section and the rollout's
tensor parallel size, not the whole config: the rule a layout must
satisfy (``slurm_layout_problem``, ``gpus_per_rank``) is the config's
(``config/slurm.py``), which refuses a broken layout at load.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping, MutableMapping, Sequence

from hpc_asyncppo.config.slurm import ROLLOUT, TRAINER, SlurmConfig, gpus_per_rank


class GpuLayoutError(ValueError):
    """A rank cannot get its GPUs; the message is one line saying what to change."""


def gpu_set(
    role: str,
    local_rank: int,
    tasks_per_node: int,
    gpus_per_node: int,
    tensor_parallel_size: int = 1,
    visible: Sequence[object] | None = None,
) -> list[int]:
    """The GPUs a rank of a Slurm component must see: indices into ``visible`` (what the
    task sees now, e.g. parsed ``CUDA_VISIBLE_DEVICES``), or GPU numbers 0.. when it is None.

    ``local_rank`` is the rank's index among its component's ``tasks_per_node`` tasks on
    the node (``SLURM_LOCALID``). No GPUs (``gpus_per_node`` 0): []. Raises GpuLayoutError.
    """
    if not gpus_per_node:
        return []
    need = gpus_per_rank(role, tensor_parallel_size)
    devices = list(range(len(visible))) if visible is not None else list(range(gpus_per_node))
    if len(devices) == need:
        # Slurm bound exactly this task's set (--gpus-per-task): keep it, whatever
        # SLURM_LOCALID says (it need not count this component's tasks only).
        return devices
    if not 0 <= local_rank < tasks_per_node:
        raise GpuLayoutError(f"local rank {local_rank} is not one of {tasks_per_node} per node")
    if tasks_per_node * need > len(devices):
        raise GpuLayoutError(
            f"{tasks_per_node} {role} rank(s) per node need {need} GPU(s) each but the node "
            f"shows {len(devices)}: lower the ranks per node or rollout.tensor_parallel_size"
        )
    return devices[local_rank * need : (local_rank + 1) * need]


def local_gpu_set(
    world_rank: int,
    rollout_ranks: int,
    train_ranks: int,
    tensor_parallel_size: int,
    gpus: int,
) -> list[int]:
    """The GPUs (indices among the machine's ``gpus`` visible ones) a rank of a one-machine
    mpirun job must see: rollout ranks [0, R) first, trainer ranks after them; when both
    roles do not fit, each starts at GPU 0 and rollout ranks wrap around (shared GPUs).
    Trainer ranks never share (NCCL needs one GPU per rank). Raises GpuLayoutError."""
    if not gpus:
        return []
    tp = tensor_parallel_size
    if tp > gpus:
        raise GpuLayoutError(
            f"rollout.tensor_parallel_size={tp} but this machine shows {gpus} GPU(s): lower it"
        )
    if train_ranks > gpus:
        raise GpuLayoutError(
            f"{train_ranks} trainer ranks but this machine shows {gpus} GPU(s); NCCL needs a GPU "
            f"per trainer rank: use --train-ranks {gpus} or fewer"
        )
    if world_rank < rollout_ranks:
        first = world_rank * tp
        return [(first + k) % gpus for k in range(tp)]
    trainer = world_rank - rollout_ranks
    fits = rollout_ranks * tp + train_ranks <= gpus
    return [rollout_ranks * tp + trainer if fits else trainer]


def parse_visible(value: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of entries (numbers, UUIDs, MIG ids); None if unset."""
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def node_gpu_count(env: Mapping[str, str]) -> int:
    """GPUs this process may use, without initialising CUDA: the entries of
    ``CUDA_VISIBLE_DEVICES`` if set, else the /dev/nvidiaN device files."""
    visible = parse_visible(env.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None:
        return len(visible)
    return sum(bool(re.fullmatch(r"/dev/nvidia\d+", p)) for p in glob.glob("/dev/nvidia*"))


def rank_gpus(
    slurm: SlurmConfig,
    tensor_parallel_size: int,
    world_rank: int,
    world_size: int,
    rollout_ranks: int,
    env: Mapping[str, str],
    gpus_here: int,
) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entries this rank must see; [] for a CPU rank."""
    role = ROLLOUT if world_rank < rollout_ranks else TRAINER
    tp = tensor_parallel_size
    visible = parse_visible(env.get("CUDA_VISIBLE_DEVICES"))
    if visible is None:
        visible = [str(i) for i in range(gpus_here)]
    if "SLURM_LOCALID" in env and "HPC_ASYNCPPO_ROLLOUT_RANKS" not in env:
        component = slurm.rollout if role == ROLLOUT else slurm.train
        if not component.gpus_per_node:
            return []
        at = gpu_set(
            role,
            int(env["SLURM_LOCALID"]),
            component.tasks_per_node,
            component.gpus_per_node,
            tp,
            visible,
        )
    else:
        at = local_gpu_set(world_rank, rollout_ranks, world_size - rollout_ranks, tp, len(visible))
    return [visible[i] for i in at]


def bind_gpus(
    slurm: SlurmConfig,
    tensor_parallel_size: int,
    world_rank: int,
    world_size: int,
    rollout_ranks: int,
    env: MutableMapping[str, str] = os.environ,
) -> list[int | str]:
    """Restrict this rank to its GPUs (``CUDA_VISIBLE_DEVICES``) before CUDA is initialised;
    returns them as the rank record lists them (numbers where they are numbers)."""
    gpus_here = node_gpu_count(env)
    entries = rank_gpus(
        slurm, tensor_parallel_size, world_rank, world_size, rollout_ranks, env, gpus_here
    )
    if entries:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(entries)
        env["HPC_ASYNCPPO_GPUS"] = env["CUDA_VISIBLE_DEVICES"]  # topology: use cuda:0
    return [int(e) if e.isdigit() else e for e in entries]
