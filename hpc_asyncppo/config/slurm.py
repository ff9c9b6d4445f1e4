"""The ``slurm:`` section of the config, and the GPU layout its counts must give.

One heterogeneous job: component 0 holds the rollout ranks (``slurm.rollout``),
component 1 the trainer ranks (``slurm.train``). Empty strings and zeros mean "leave it
to the cluster" (the option is not written into the batch script). Values against the
cluster are checked at submit (``launch/slurm/checks.py``).

The layout rule: each rank gets its own GPUs, a rollout rank exactly
``rollout.tensor_parallel_size``, a trainer rank one, every requested GPU in one rank's
set (``slurm_layout_problem``). The config's validation refuses a layout that breaks it;
``launch/gpus.py`` binds each rank to its set by the same count (``gpus_per_rank``).
Pure functions (no torch), so the launcher's validation stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLLOUT, TRAINER = "rollout", "trainer"  # as topology.ROLLOUT/TRAINER (that module imports torch)


@dataclass
class ComponentConfig:
    partition: str = ""  # Slurm partition; empty: the cluster's default partition
    nodes: int = 1  # nodes of this component
    ntasks_per_node: int = 0  # ranks per node; 0: one per GPU (gpus_per_node), or 1 without GPUs
    gpus_per_node: int = 0  # GPUs per node; 0: ask for none
    gpu_type: str = ""  # GPU type in the request (a100 -> --gpus-per-task=a100:2); empty: any type
    gpu_memory_gb: float = (
        0.0  # memory of each GPU (GB): checked against the run's needs; 0: unchecked
    )
    cpus_per_task: int = 0  # CPUs per rank (--cpus-per-task); 0: the partition's default
    mem: str = ""  # memory per node (--mem), e.g. 200G; "0": all of it; empty: partition default
    constraint: str = ""  # node features (--constraint), e.g. "a100&ib"; empty: none
    extra_sbatch: list[str] = field(default_factory=list)  # this component's extra options

    @property
    def tasks_per_node(self) -> int:
        """Ranks per node: as set, else one per GPU, else one."""
        return self.ntasks_per_node or self.gpus_per_node or 1

    @property
    def ranks(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass
class SlurmConfig:
    rollout: ComponentConfig = field(default_factory=ComponentConfig)  # component 0: rollout ranks
    train: ComponentConfig = field(default_factory=ComponentConfig)  # component 1: trainer ranks
    job_name: str = "hpc_asyncppo"  # job name shown by squeue
    time: str = ""  # time limit (minutes, HH:MM:SS or D-HH:MM:SS); empty: the partition's default
    account: str = ""  # account charged (--account); empty: your default account
    qos: str = ""  # quality of service (--qos); empty: the default QOS
    # How GPUs are asked: gpus-per-node (every task of a node sees all its GPUs and binds its
    # own set by SLURM_LOCALID, so NCCL keeps peer-to-peer/NVLink between ranks) | gres
    # (--gres=gpu:N, the same binding) | gpus-per-task (Slurm binds each task's set; where
    # devices are constrained per task, NCCL loses P2P between the node's ranks).
    gpu_request: str = "gpus-per-node"
    mpi: str = "pmix"  # srun --mpi plugin (srun --mpi=list shows the cluster's)
    signal: str = "USR2@90"  # warning signal before the time limit (--signal): the ranks checkpoint and requeue; empty: none
    extra_sbatch: list[str] = field(default_factory=list)  # more #SBATCH options for the whole job
    setup: list[str] = field(default_factory=list)  # shell lines before srun: module load, exports
    srun_args: list[str] = field(default_factory=list)  # more srun options: --cpu-bind=none
    python: str = ""  # interpreter the ranks run; empty: the one running submit
    run_root: str = "runs"  # where run directories go: a filesystem every node sees


def gpus_per_rank(role: str, tensor_parallel_size: int) -> int:
    """GPUs one rank of ``role`` must see: its engine's TP size (rollout) or one (trainer)."""
    if role not in (ROLLOUT, TRAINER):
        raise ValueError(f"unknown role {role!r}")
    return tensor_parallel_size if role == ROLLOUT else 1


def layout_problem(role: str, tasks_per_node: int, gpus_per_node: int, tp: int) -> str | None:
    """Why ``tasks_per_node`` ranks of ``role`` cannot split ``gpus_per_node`` GPUs into one
    set each (every GPU in exactly one rank's set); None if they can, or without GPUs."""
    if not gpus_per_node:
        return None
    need = gpus_per_rank(role, tp)
    used = tasks_per_node * need
    if used == gpus_per_node:
        return None
    key = "rollout" if role == ROLLOUT else "train"
    each = f"rollout.tensor_parallel_size={tp} GPU(s) each" if role == ROLLOUT else "one GPU each"
    fix = f"set slurm.{key}.gpus_per_node={used}"
    if gpus_per_node % need == 0:
        fix = f"set slurm.{key}.ntasks_per_node={gpus_per_node // need} (or {fix[4:]})"
    return (
        f"slurm.{key}: {tasks_per_node} {role} rank(s) per node x {each} = {used} GPU(s), but "
        f"slurm.{key}.gpus_per_node={gpus_per_node}: {fix}"
    )


def slurm_layout_problem(slurm: SlurmConfig, tensor_parallel_size: int) -> str | None:
    """Why the Slurm components cannot give each rank its own GPUs (a rollout rank
    ``tensor_parallel_size``, a trainer rank one, every requested GPU in one rank's set);
    None if they can. The config's validation raises it as a ConfigError."""
    rollout, train = slurm.rollout, slurm.train
    if min(rollout.gpus_per_node, train.gpus_per_node, rollout.ntasks_per_node,
           train.ntasks_per_node) < 0:  # fmt: skip
        return None  # launch/slurm/checks.py refuses negative counts, naming the key
    if rollout.gpus_per_node:
        gpus_per_rank = rollout.gpus_per_node // rollout.tasks_per_node
        if tensor_parallel_size > gpus_per_rank:
            return (
                f"rollout.tensor_parallel_size={tensor_parallel_size} but each rollout "
                f"rank has {gpus_per_rank} GPU(s) (slurm.rollout.gpus_per_node="
                f"{rollout.gpus_per_node} over {rollout.tasks_per_node} ranks per node); lower it "
                "or set slurm.rollout.ntasks_per_node to gpus_per_node / tensor_parallel_size"
            )
    for role, c in ((ROLLOUT, rollout), (TRAINER, train)):
        problem = layout_problem(role, c.tasks_per_node, c.gpus_per_node, tensor_parallel_size)
        if problem:
            return problem
    if bool(rollout.gpus_per_node) != bool(train.gpus_per_node):
        # One side on CPUs would put NCCL and gloo ranks in one weight-broadcast group.
        return (
            f"GPUs on one component only (slurm.rollout.gpus_per_node={rollout.gpus_per_node}, "
            f"slurm.train.gpus_per_node={train.gpus_per_node}): request GPUs for both, or neither"
        )
    return None
