"""The run directory: created before any rank starts, read by every rank and by the tools.

RUN_DIR/config.yaml        the resolved config (the ranks read only this)
RUN_DIR/model/             the tiny default model, when model.path was empty
RUN_DIR/ranks/rank{i}.json where each rank ran (host, Slurm partition, pid) and its state
RUN_DIR/errors/rank{i}.txt one line per failed rank: what went wrong
RUN_DIR/logs/              per-rank logs and the launcher's log
RUN_DIR/checkpoints/       HDF5 checkpoints (hpc_asyncppo.checkpoint)
RUN_DIR/preempted          present while the run is stopped on a signal with a checkpoint, to resume
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from hpc_asyncppo.config import Config, ConfigError, to_yaml

CONFIG = "config.yaml"
PREEMPTED = "preempted"


def default_run_dir(cfg: Config, root: str | Path = "runs") -> Path:
    return (
        Path(root)
        / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.data.task.split(':')[-1]}-{cfg.async_training.mode}"
    )


def prepare_run_dir(cfg: Config, run_dir: Path) -> Config:
    """Create ``run_dir``, build the tiny model if needed, write config.yaml; returns the config as written."""
    from hpc_asyncppo.tasks import load_task

    run_dir = run_dir.resolve()
    if (run_dir / CONFIG).exists():
        raise FileExistsError(
            f"{run_dir} already holds a run (config.yaml exists); choose another --run-dir"
        )
    task = load_task(cfg.data)  # fails early on a bad dataset or task, before anything is written
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(
            f"model.path={cfg.model.path!r} is not a Hugging Face model folder (no config.json)"
        )
    for sub in ("ranks", "errors", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    if not cfg.model.path:
        from hpc_asyncppo.models.tiny import build_tiny_model

        model_dir = build_tiny_model(
            run_dir / "model", task.vocabulary(), cfg.model.tiny, cfg.trainer.seed
        )
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_dir)))
    (run_dir / CONFIG).write_text(to_yaml(cfg))
    return cfg


def write_rank_info(run_dir: Path, rank: int, world_size: int, role: str, state: str) -> None:
    from hpc_asyncppo.launch.slurm.placement import slurm_placement

    info = {
        "rank": rank,
        "world_size": world_size,
        "role": role,
        **slurm_placement(rank),  # host, and under Slurm the node, partition, job, het group
        "pid": os.getpid(),
        "state": state,
        "time": time.time(),
    }
    path = run_dir / "ranks" / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def read_rank_info(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank*.json"))]


def write_rank_error(run_dir: Path, rank: int, message: str) -> None:
    (run_dir / "errors").mkdir(parents=True, exist_ok=True)
    (run_dir / "errors" / f"rank{rank}.txt").write_text(message.strip() + "\n")


def rank_errors(run_dir: Path) -> list[str]:
    """One line per rank that recorded a failure, in rank order."""
    files = sorted((run_dir / "errors").glob("rank*.txt"), key=lambda p: int(p.stem[4:]))
    return [p.read_text().strip().splitlines()[0] for p in files if p.read_text().strip()]
