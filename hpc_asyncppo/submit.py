"""Start a run: ``python -m hpc_asyncppo.submit [flags] [key=value ...]``.

``--cluster local`` runs every rank here under mpirun; ``--cluster slurm`` (the default)
submits one heterogeneous Slurm job. Everything after the flags is a config override
(omegaconf dotted keys). The config is loaded and validated before anything starts: a bad
key or value is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpc_asyncppo.config import ConfigError, load_config
from hpc_asyncppo.launch.rundir import default_run_dir, prepare_run_dir
from hpc_asyncppo.launch.slurm import cli as slurm_cli


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hpc_asyncppo.submit",
        description="Fully asynchronous PPO/GRPO training: rollout ranks and trainer ranks, MPI between them.",
    )
    parser.add_argument(
        "--cluster", choices=("local", "slurm"), default="slurm", help="where the ranks run"
    )
    parser.add_argument("--config", default=None, help="YAML config: a path or a name in configs/")
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="run directory (default: runs/<time>-<task>-<mode>)",
    )
    parser.add_argument(
        "--rollout-ranks", type=int, default=1, help="local: rollout ranks (default 1)"
    )
    parser.add_argument(
        "--train-ranks", type=int, default=1, help="local: trainer ranks (default 1)"
    )
    slurm_cli.add_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        overrides = list(args.overrides)
        if args.cluster == "slurm":
            overrides += slurm_cli.flag_overrides(args)
        cfg = load_config(args.config, overrides)
        if args.cluster == "local":
            rollout_ranks, train_ranks = args.rollout_ranks, args.train_ranks
        else:
            rollout_ranks, train_ranks = slurm_cli.rank_counts(cfg)
        cfg = load_config(args.config, overrides, rollout_ranks, train_ranks)
        if args.cluster == "slurm":
            slurm_cli.check_submittable(
                cfg, args
            )  # partitions, sizes, sbatch: before anything is written
        run_dir = args.run_dir or default_run_dir(cfg)
        cfg = prepare_run_dir(cfg, run_dir)
    except (ConfigError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_dir = run_dir.resolve()
    print(f"run directory: {run_dir}", flush=True)
    if args.cluster == "local":
        from hpc_asyncppo.launch.local import run_local

        print(
            f"starting {rollout_ranks} rollout rank(s) and {train_ranks} trainer rank(s) under mpirun",
            flush=True,
        )
        return run_local(cfg, run_dir, rollout_ranks, train_ranks)
    from hpc_asyncppo.launch.slurm.submit import submit_slurm

    return submit_slurm(cfg, run_dir, args)


if __name__ == "__main__":
    sys.exit(main())
