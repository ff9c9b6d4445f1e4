"""Slurm options of a run (the ``slurm:`` section of the config).

One heterogeneous job: component 0 holds the rollout ranks (``slurm.rollout``),
component 1 the trainer ranks (``slurm.train``). Empty strings and zeros mean "leave it
to the cluster" (the option is not written into the batch script). Values are checked
in ``hpc_asyncppo.launch.slurm.checks`` (this module must not import the config).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
