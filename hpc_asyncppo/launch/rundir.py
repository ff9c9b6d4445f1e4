"""The run directory: created before any rank starts, read by every rank and by the tools.

What it holds, and the names of its files and folders: ``hpc_asyncppo/paths.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_asyncppo.config import Config, ConfigError, to_yaml, tool_config_file
from hpc_asyncppo.paths import CHECKPOINTS, CONFIG, ERRORS, LOGS, MODEL, OVERLONG, RANKS, TOOLS

if TYPE_CHECKING:
    from hpc_asyncppo.tasks import Task


def default_run_dir(cfg: Config, root: str | Path = "runs") -> Path:
    return (
        Path(root)
        / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.data.task.split(':')[-1]}-{cfg.async_training.mode}"
    )


class RunDirError(RuntimeError):
    """The run directory cannot be written (permissions, a full disk); one line for the user."""


def prepare_run_dir(
    cfg: Config,
    run_dir: Path,
    extra_files: dict[str, str] | None = None,
    warn: Callable[[str], None] | None = None,
) -> Config:
    """Create ``run_dir``, build the tiny model if needed, drop (or refuse) overlong prompts,
    write config.yaml and ``extra_files``; returns the config as written.

    Raises ConfigError / DatasetError for bad input, RunDirError if the directory cannot be
    written. On any error nothing is left behind: a directory this call created is removed.
    """
    from hpc_asyncppo.tasks import load_task

    run_dir = run_dir.resolve()
    if (run_dir / CONFIG).exists():
        raise FileExistsError(
            f"{run_dir} already holds a run ({CONFIG} exists); choose another --run-dir"
        )
    task = load_task(cfg.data)  # fails early on a bad dataset or task, before anything is written
    needed = getattr(task, "min_response_length", 0)
    if cfg.rollout.response_length < needed:
        raise ConfigError(
            f"rollout.response_length={cfg.rollout.response_length} is too short for "
            f"data.task={cfg.data.task!r}, whose answers need {needed} tokens; "
            f"set rollout.response_length={needed} or more"
        )
    if cfg.data.val:
        from hpc_asyncppo.tasks import load_val_task

        load_val_task(cfg.data)
    if cfg.data.agent:
        from hpc_asyncppo.tasks.registry import load_agent

        load_agent(cfg.data)
    check_model_path(cfg.model.path)
    with removed_on_failure(run_dir):
        try:
            cfg, overlong = _write_run_dir(cfg, task, run_dir, extra_files or {})
        except OSError as exc:
            raise RunDirError(_cannot_write(run_dir, exc)) from None
    if overlong:
        (warn or _warn_on_stderr)(
            f"dropped {overlong} of {len(task.prompts())} prompts longer than "
            f"data.max_prompt_length={cfg.data.max_prompt_length} tokens (listed in {run_dir / OVERLONG})"
        )
    return cfg


def _write_run_dir(
    cfg: Config, task: Task, run_dir: Path, extra_files: dict[str, str]
) -> tuple[Config, int]:
    for sub in (RANKS, ERRORS, LOGS):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    tokenizer = None
    if not cfg.model.path:
        from hpc_asyncppo.models.tiny import TinyTokenizer, tiny_model

        model_dir = tiny_model(
            run_dir / MODEL,
            task.vocabulary(),
            cfg.model.tiny,
            cfg.trainer.seed,
            chat_template=getattr(task, "chat_template", None),
        )
        tokenizer = TinyTokenizer(model_dir)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_dir)))
    turns = cfg.rollout.multi_turn
    if turns.enable:  # the run keeps its own copy: a resume uses the tools it started with
        shutil.copyfile(tool_config_file(turns.tool_config_path), run_dir / TOOLS)
        turns = dataclasses.replace(turns, tool_config_path=str(run_dir / TOOLS))
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, multi_turn=turns))
    if (
        cfg.data.agent
    ):  # the gateways' secret, before any rank starts (rollout/gateway/addresses.py)
        from hpc_asyncppo.rollout.gateway.addresses import make_token

        make_token(run_dir)
    overlong = drop_overlong_prompts(cfg, task, run_dir, tokenizer)
    for name, text in {CONFIG: to_yaml(cfg), **extra_files}.items():
        (run_dir / name).write_text(text)
    return cfg, overlong


def check_model_path(path: str) -> None:
    """ConfigError unless ``path`` is empty (the tiny model) or a Hugging Face model folder."""
    if not path:
        return
    where = Path(path)
    if not where.exists():
        raise ConfigError(
            f"model.path={path!r} does not exist; set it to a Hugging Face model folder"
        )
    if not where.is_dir():
        raise ConfigError(
            f"model.path={path!r} is a file; set it to the folder holding config.json"
        )
    if not (where / "config.json").is_file():
        raise ConfigError(
            f"model.path={path!r} is not a Hugging Face model folder (no config.json)"
        )


def drop_overlong_prompts(cfg: Config, task: Task, run_dir: Path, tokenizer: Any = None) -> int:
    """Measure every prompt with the model's own tokenizer (``tokenizer``, or as the rollout
    ranks load it); record the overlong ones in run_dir, or refuse them. Returns how many
    were dropped."""
    from hpc_asyncppo.tasks.overlong import check_overlong, find_overlong, write_overlong
    from hpc_asyncppo.tools.base import tool_schemas

    try:
        if tokenizer is None:
            from transformers import AutoTokenizer  # seconds to import: only for a real model

            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a broken folder
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(
            f"model.path={cfg.model.path!r}: AutoTokenizer cannot load its tokenizer "
            f"({type(exc).__name__}: {first[:200]}); the folder needs the model's tokenizer "
            "files (tokenizer.json, tokenizer_config.json)"
        ) from None
    prompts = task.prompts()
    turns = cfg.rollout.multi_turn
    template = (
        getattr(tokenizer, "chat_template", None)
        or (
            Path(cfg.model.path) / "chat_template.jinja"  # the tiny model's (its task's)
        ).is_file()
    )
    if turns.enable and not template:
        raise ConfigError(
            f"rollout.multi_turn.enable=true: the model's tokenizer has no chat template "
            f"(model.path={cfg.model.path!r}, data.task={cfg.data.task!r}), and tool answers "
            "go back through it: use an instruct model, or for the tiny model a task that "
            "gives it one (data.task=tool_lookup)"
        )
    schemas = tool_schemas(turns.tool_config_path) if turns.enable else None
    overlong = find_overlong(prompts, tokenizer, cfg.data.max_prompt_length, schemas)
    check_overlong(prompts, overlong, cfg.data)
    if overlong:
        write_overlong(run_dir, overlong, cfg.data.max_prompt_length)
    return len(overlong)


@contextlib.contextmanager
def removed_on_failure(run_dir: Path) -> Iterator[None]:
    """Remove ``run_dir`` if the block fails and the directory did not exist before it."""
    existed = run_dir.exists()
    try:
        yield
    except BaseException:
        if not existed:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _cannot_write(run_dir: Path, exc: OSError) -> str:
    return (
        f"cannot write the run directory {run_dir}: {exc.strerror or exc}"
        f"{f' ({exc.filename})' if exc.filename else ''}; choose another --run-dir "
        "(or slurm.run_root) on a writable filesystem with free space"
    )


def _warn_on_stderr(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def write_rank_info(
    run_dir: Path,
    rank: int,
    world_size: int,
    role: str,
    state: str,
    gpus: list[int | str] | None = None,
) -> None:
    """``gpus``: the CUDA_VISIBLE_DEVICES entries the rank bound itself to ([]: CPU; None:
    not known yet)."""
    from hpc_asyncppo.launch.slurm.placement import slurm_placement

    info = {
        "rank": rank,
        "world_size": world_size,
        "role": role,
        "gpus": gpus,
        **slurm_placement(rank),  # host, and under Slurm the node, partition, job, het group
        "pid": os.getpid(),
        "state": state,
        "time": time.time(),
    }
    path = run_dir / RANKS / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def write_rank_error(run_dir: Path, rank: int, message: str) -> None:
    (run_dir / ERRORS).mkdir(parents=True, exist_ok=True)
    (run_dir / ERRORS / f"rank{rank}.txt").write_text(message.strip() + "\n")


def rank_errors(run_dir: Path) -> list[str]:
    """One line per rank that recorded a failure, in rank order: its whole message joined
    on one line (h5py, for one, puts "No space left on device" on a later line), without
    the traceback that follows it in the file."""
    files = sorted((run_dir / ERRORS).glob("rank*.txt"), key=lambda p: int(p.stem[4:]))
    return [line for line in (error_line(p.read_text()) for p in files) if line]


def error_line(text: str) -> str:
    """A recorded error's message (everything before its traceback) on one line."""
    message = text.split(_TRACEBACK, 1)[0]
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


_TRACEBACK = "Traceback (most recent call last):"


def report_resume_point(run_dir: Path) -> int:
    """Say which checkpoint the job will resume from, one line per broken one skipped, and
    return its step (0: none, the run starts over);
    ConfigError if there are checkpoints and none is complete (before any rank starts).
    Only the manifests are read (parts present, sizes): the ranks verify the data."""
    from hpc_asyncppo.checkpoint import protocol
    from hpc_asyncppo.checkpoint.store import CheckpointError

    found = protocol.list_checkpoints(run_dir)
    for folder in found:
        try:
            protocol.check_manifest(folder)
        except CheckpointError as exc:
            print(f"warning: {exc}; trying an older checkpoint", file=sys.stderr)
            continue
        print(f"resuming from {folder}", flush=True)
        return protocol.checkpoint_step(folder)
    if found:
        raise ConfigError(
            f"no valid checkpoint in {run_dir / CHECKPOINTS} (see the warnings above)"
        )
    print(f"no checkpoint in {run_dir}: starting it over", flush=True)
    return 0
