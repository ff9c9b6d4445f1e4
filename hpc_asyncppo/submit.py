"""Start a run: ``python -m hpc_asyncppo.submit [flags] [key=value ...]``.

``--cluster local`` runs every rank here under mpirun; ``--cluster slurm`` (the default)
submits one heterogeneous Slurm job. Everything after the flags is a config override
(omegaconf dotted keys). The config is loaded and validated before anything starts: a bad
key or value is one line on stderr and exit code 2.

``--resume RUN_DIR`` starts the same run again: the ranks continue from its newest valid
checkpoint (or from scratch if it has none), with its config.yaml plus any overrides given
(e.g. ``trainer.total_steps=600`` to train longer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from hpc_asyncppo.config import (
    Config,
    ConfigError,
    check_resume_compatible,
    config_warnings,
    load_config,
    to_yaml,
)
from hpc_asyncppo.launch.rundir import (
    RunDirError,
    default_run_dir,
    prepare_run_dir,
    report_resume_point,
)
from hpc_asyncppo.launch.slurm import cli as slurm_cli
from hpc_asyncppo.memory import check_memory
from hpc_asyncppo.paths import CONFIG, LAUNCH


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (not usage + error) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def parse_args(argv: list[str], prog: str = "python -m hpc_asyncppo.submit") -> argparse.Namespace:
    parser = OneLineParser(
        prog=prog,
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
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue this run from its newest valid checkpoint",
    )
    parser.add_argument(
        "--rollout-ranks",
        type=int,
        default=None,
        help="local: rollout ranks (default 1, or the resumed run's)",
    )
    parser.add_argument(
        "--train-ranks",
        type=int,
        default=None,
        help="local: trainer ranks (default 1, or the resumed run's)",
    )
    slurm_cli.add_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser.parse_args(argv)


def local_rank_counts(args: argparse.Namespace) -> tuple[int, int]:
    """--rollout-ranks/--train-ranks, else the resumed run's counts, else 1 and 1."""
    previous = {}
    if args.resume is not None and (args.resume / LAUNCH).is_file():
        try:
            previous = json.loads((args.resume / LAUNCH).read_text())
        except json.JSONDecodeError:
            raise ConfigError(
                f"--resume {args.resume}: {LAUNCH} is not valid JSON; give --rollout-ranks and "
                "--train-ranks"
            ) from None
    counts = []
    for flag, given, key in (
        ("--rollout-ranks", args.rollout_ranks, "rollout_ranks"),
        ("--train-ranks", args.train_ranks, "train_ranks"),
    ):
        count = previous.get(key, 1) if given is None else given  # not `or`: 0 is an error
        if count < 1:
            raise ConfigError(f"{flag} {count}: a run needs at least 1")
        counts.append(count)
    return counts[0], counts[1]


def base_config(args: argparse.Namespace) -> str | Path | None:
    """The YAML the overrides apply to: --config, or the resumed run's own config.yaml."""
    if args.resume is None:
        return args.config
    if args.config or args.run_dir:
        raise ConfigError(
            "--resume RUN_DIR takes the run's own config.yaml: drop --config and --run-dir"
        )
    if not args.resume.is_dir():
        raise ConfigError(f"--resume {args.resume}: no such directory")
    if not (args.resume / CONFIG).is_file():
        raise ConfigError(
            f"--resume {args.resume}: no {CONFIG} there, so it is not a run directory"
        )
    return args.resume / CONFIG


def write_atomically(files: dict[Path, str]) -> None:
    """Write every file under a temporary name first, then rename them all: a full disk
    leaves the old files as they were."""
    tmps = {path: path.with_name(f".{path.name}.tmp") for path in files}
    try:
        for path, text in files.items():
            tmps[path].write_text(text)
    except OSError:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        raise
    for path, tmp in tmps.items():
        tmp.replace(path)


def prepare(args: argparse.Namespace) -> tuple[Config, Path, int, int, int | None] | int:
    """Config, run directory and rank counts, every check made and the run directory
    written; or the exit code of a dry run. Raises on bad input, having written nothing."""
    # A flag is a shortcut for a config key; an explicit key=value wins over it.
    flags = slurm_cli.flag_overrides(args) if args.cluster == "slurm" else []
    overrides = flags + list(args.overrides)
    base = base_config(args)
    cfg = load_config(base, overrides)
    if args.cluster == "local":
        rollout_ranks, train_ranks = local_rank_counts(args)
    else:
        rollout_ranks, train_ranks = slurm_cli.rank_counts(cfg)
    cfg = load_config(base, overrides, rollout_ranks, train_ranks)
    check_memory(cfg, train_ranks)
    if args.resume is not None:
        check_resume_compatible(load_config(base), cfg)
    for line in config_warnings(cfg):
        print(f"warning: {line}", file=sys.stderr)
    if args.cluster == "slurm":
        # partitions, sizes, sbatch: checked before anything is written
        slurm_cli.check_submittable(cfg, args)
    root = cfg.slurm.run_root if args.cluster == "slurm" else "runs"
    run_dir = (args.resume or args.run_dir or default_run_dir(cfg, root)).resolve()
    if getattr(args, "dry_run", False):
        from hpc_asyncppo.launch.slurm.submit import submit_slurm

        return submit_slurm(cfg, run_dir, args)  # prints the script; writes nothing
    launch = {"cluster": args.cluster, "rollout_ranks": rollout_ranks, "train_ranks": train_ranks}
    resume_step = None
    if args.resume is not None:
        resume_step = report_resume_point(run_dir)
        write_atomically(
            {run_dir / CONFIG: to_yaml(cfg), run_dir / LAUNCH: json.dumps(launch) + "\n"}
        )
    else:
        cfg = prepare_run_dir(cfg, run_dir, {LAUNCH: json.dumps(launch) + "\n"})
    return cfg, run_dir, rollout_ranks, train_ranks, resume_step


def main(argv: list[str] | None = None, prog: str = "python -m hpc_asyncppo.submit") -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    # Not transformers' own switch: importing transformers here would cost seconds.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        prepared = prepare(args)
    except (ConfigError, FileExistsError, ValueError) as exc:  # the input is wrong
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RunDirError, OSError) as exc:  # the input is fine, the filesystem is not
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if isinstance(prepared, int):
        return prepared
    cfg, run_dir, rollout_ranks, train_ranks, resume_step = prepared
    print(f"run directory: {run_dir}", flush=True)
    if args.cluster == "local":
        from hpc_asyncppo.launch.local import run_local

        print(
            f"starting {rollout_ranks} rollout rank(s) and {train_ranks} trainer rank(s) under mpirun",
            flush=True,
        )
        return run_local(cfg, run_dir, rollout_ranks, train_ranks, resume_step)
    from hpc_asyncppo.launch.slurm.submit import submit_slurm

    return submit_slurm(cfg, run_dir, args)


if __name__ == "__main__":
    code = main()
    # A local run's last act is done (its end in goodput.jsonl): without the interpreter's
    # teardown, which takes most of a second with torch loaded, the attempt ends when
    # goodput.jsonl says it did.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
