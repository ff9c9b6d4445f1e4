"""Command-line side of the Slurm backend: flags, rank counts and the checks made before a run directory exists.

``hpc_asyncppo.submit`` adds these flags to its parser. Every flag is a shortcut for a
config key (``--partition-rollout a100`` is ``slurm.rollout.partition=a100``), so a
cluster's settings can equally live in a YAML under ``configs/``; a flag wins over the
YAML, a ``key=value`` override wins over the flag.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from hpc_asyncppo.config import Config, ConfigError
from hpc_asyncppo.launch.slurm.checks import check_against_partitions, check_options
from hpc_asyncppo.launch.slurm.cluster import SlurmError, query_partitions

# flag (without --) -> (config key, type, help)
FLAGS: dict[str, tuple[str, type, str]] = {
    "partition-rollout": ("slurm.rollout.partition", str, "partition of the rollout ranks"),
    "partition-train": ("slurm.train.partition", str, "partition of the trainer ranks"),
    "nodes-rollout": ("slurm.rollout.nodes", int, "nodes for the rollout ranks"),
    "nodes-train": ("slurm.train.nodes", int, "nodes for the trainer ranks"),
    "ntasks-per-node-rollout": ("slurm.rollout.ntasks_per_node", int, "rollout ranks per node"),
    "ntasks-per-node-train": ("slurm.train.ntasks_per_node", int, "trainer ranks per node"),
    "gpus-per-node-rollout": ("slurm.rollout.gpus_per_node", int, "GPUs per rollout node"),
    "gpus-per-node-train": ("slurm.train.gpus_per_node", int, "GPUs per trainer node"),
    "time": ("slurm.time", str, "time limit, e.g. 4:00:00"),
    "account": ("slurm.account", str, "account to charge"),
    "qos": ("slurm.qos", str, "quality of service"),
    "job-name": ("slurm.job_name", str, "job name"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Slurm", "one heterogeneous job: rollout ranks on one partition, trainer ranks on another"
    )
    for flag, (key, kind, text) in FLAGS.items():
        group.add_argument(
            f"--{flag}",
            type=kind,
            default=None,
            metavar=kind.__name__.upper(),
            help=f"{text} ({key})",
        )
    group.add_argument(
        "--dry-run", action="store_true", help="print the batch script, submit nothing"
    )
    group.add_argument(
        "--wait", action="store_true", help="follow the job until it ends; exit with its status"
    )


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The Slurm flags given, as ``key=value`` overrides (strings quoted for omegaconf)."""
    overrides = []
    for flag, (key, kind, _) in FLAGS.items():
        value = getattr(args, flag.replace("-", "_"), None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value) if kind is str else value}")
    return overrides


def rank_counts(cfg: Config) -> tuple[int, int]:
    """(rollout ranks, trainer ranks) the job will have: nodes x tasks per node of each component."""
    check_options(cfg.slurm)
    return cfg.slurm.rollout.ranks, cfg.slurm.train.ranks


def check_submittable(cfg: Config, args: argparse.Namespace) -> None:
    """Everything that would make sbatch fail or the run break, checked before anything is written.

    Raises ConfigError (one line). ``--dry-run`` needs no cluster: only the values are checked.
    """
    check_options(cfg.slurm)
    if getattr(args, "dry_run", False):
        return
    # A resumed run's directory gets the same checks as a new one's.
    given = getattr(args, "resume", None) or getattr(args, "run_dir", None)
    run_dir = Path(given or cfg.slurm.run_root).resolve()
    if any(ch.isspace() for ch in str(run_dir)):
        # The run directory goes into #SBATCH --output=..., which sbatch splits at spaces.
        raise ConfigError(f"run directory {str(run_dir)!r} must not contain spaces")
    if run_dir == Path("/tmp") or Path("/tmp") in run_dir.parents:
        raise ConfigError(
            f"run directory {run_dir} is under /tmp, which each node has its own of; "
            "use --run-dir or slurm.run_root on a filesystem all nodes see"
        )
    for command in ("sbatch", "srun"):
        if shutil.which(command) is None:
            raise ConfigError(
                f"{command} not found on PATH: submit from a Slurm login node, "
                "or run here without Slurm with --cluster local"
            )
    try:
        partitions = query_partitions()
    except SlurmError as exc:
        raise ConfigError(f"cannot ask Slurm about its partitions: {exc}") from None
    check_against_partitions(cfg.slurm, partitions)
