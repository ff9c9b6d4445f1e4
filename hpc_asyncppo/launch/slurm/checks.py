"""Checks of the ``slurm:`` config section: alone (any machine), then against the cluster.

Every failure is a ``ConfigError`` whose one-line message names the key and what to do.
"""

from __future__ import annotations

import re

from hpc_asyncppo.config import ConfigError
from hpc_asyncppo.config.slurm import ComponentConfig, SlurmConfig
from hpc_asyncppo.launch.slurm.cluster import Partition

COMPONENTS = ("rollout", "train")
GPU_REQUESTS = ("gpus-per-task", "gpus-per-node", "gres")
# Flag that sets each component key, so that messages can say what to change.
FLAGS = {"partition": "--partition-{c}", "nodes": "--nodes-{c}"}

_NAME = re.compile(r"[A-Za-z0-9_.+\-]*")
_TIME = re.compile(r"|\d+|\d+:\d\d?(:\d\d?)?|\d+-\d\d?(:\d\d?){0,2}|INFINITE|UNLIMITED")
_MEM = re.compile(r"|\d+[KMGT]?")
_SIGNAL = re.compile(r"|([BR]:)?(SIG)?[A-Z0-9]+(@\d+)?")


def _match(pattern: re.Pattern[str], key: str, value: str, what: str) -> None:
    if not pattern.fullmatch(value):
        raise ConfigError(f"slurm.{key}={value!r} is not {what}")


def _check_options_list(key: str, values: list[str]) -> None:
    for value in values:
        if not value.startswith("-") or "\n" in value:
            raise ConfigError(
                f"slurm.{key} entry {value!r} is not one option like '--exclusive' or '--mail-type=END'"
            )


def _check_component(name: str, c: ComponentConfig) -> None:
    if c.nodes < 1:
        raise ConfigError(f"slurm.{name}.nodes={c.nodes} must be >= 1")
    for key in ("ntasks_per_node", "gpus_per_node", "cpus_per_task", "gpu_memory_gb"):
        if getattr(c, key) < 0:
            raise ConfigError(f"slurm.{name}.{key}={getattr(c, key)} must be >= 0")
    _match(_NAME, f"{name}.partition", c.partition, "a partition name")
    _match(_NAME, f"{name}.gpu_type", c.gpu_type, "a GPU type name (e.g. a100)")
    _match(_MEM, f"{name}.mem", c.mem, "a memory size like 200G, 64000M or 0")
    if re.search(r"\s", c.constraint):
        raise ConfigError(f"slurm.{name}.constraint={c.constraint!r} must not contain spaces")
    if c.gpu_type and not c.gpus_per_node:
        raise ConfigError(
            f"slurm.{name}.gpu_type={c.gpu_type!r} needs slurm.{name}.gpus_per_node >= 1"
        )
    _check_options_list(f"{name}.extra_sbatch", c.extra_sbatch)


def check_options(cfg: SlurmConfig) -> None:
    """Values that are wrong on any cluster. Raises ConfigError."""
    for name in COMPONENTS:
        _check_component(name, getattr(cfg, name))
    if not cfg.job_name or re.search(r"\s", cfg.job_name):
        raise ConfigError(f"slurm.job_name={cfg.job_name!r} must be one word")
    _match(_TIME, "time", cfg.time, "a Slurm time limit (minutes, HH:MM:SS or D-HH:MM:SS)")
    _match(_NAME, "account", cfg.account, "an account name")
    _match(_NAME, "qos", cfg.qos, "a QOS name")
    _match(_SIGNAL, "signal", cfg.signal, "a signal spec like USR2@90")
    if not cfg.mpi or not _NAME.fullmatch(cfg.mpi):
        raise ConfigError(
            f"slurm.mpi={cfg.mpi!r} is not an srun MPI plugin name (pmix, pmi2, none...)"
        )
    if cfg.gpu_request not in GPU_REQUESTS:
        raise ConfigError(
            f"slurm.gpu_request={cfg.gpu_request!r} is not one of: {', '.join(GPU_REQUESTS)}"
        )
    _check_options_list("extra_sbatch", cfg.extra_sbatch)
    _check_options_list("srun_args", cfg.srun_args)
    if "\n" in cfg.python:
        raise ConfigError("slurm.python must be one command")
    if not cfg.run_root:
        raise ConfigError("slurm.run_root must name a directory on a shared filesystem")


def _flag(key: str, component: str) -> str:
    return FLAGS[key].format(c=component)


def check_against_partitions(cfg: SlurmConfig, partitions: dict[str, Partition]) -> None:
    """Requests this cluster can never grant (unknown partition, too many nodes). Raises ConfigError."""
    names = ", ".join(sorted(partitions)) or "none"
    for name in COMPONENTS:
        c: ComponentConfig = getattr(cfg, name)
        if c.partition:
            part = partitions.get(c.partition)
            if part is None:
                raise ConfigError(
                    f"slurm.{name}.partition={c.partition!r}: no such partition on this cluster "
                    f"(partitions: {names}); set {_flag('partition', name)}"
                )
        else:
            part = next((p for p in partitions.values() if p.default), None)
            if part is None:
                raise ConfigError(
                    f"slurm.{name}.partition is empty and this cluster has no default partition "
                    f"(partitions: {names}); set {_flag('partition', name)}"
                )
        limit = (
            part.total_nodes if part.max_nodes is None else min(part.total_nodes, part.max_nodes)
        )
        if c.nodes > limit:
            raise ConfigError(
                f"slurm.{name}.nodes={c.nodes} but partition {part.name!r} allows at most {limit} "
                f"node(s) per job; lower {_flag('nodes', name)} or pick another partition"
            )
