"""Prompts longer than ``data.max_prompt_length``: found once, when the run directory is made.

With ``data.filter_overlong_prompts`` (verl's name; the default) they are dropped: their
indices go to RUN_DIR/overlong_prompts.json, and the trainer leader and every rollout rank
leave them out of the prompt list the data order walks, so a long row can never stop a run halfway. Without it the
run is refused before it starts, naming the first one. Kept prompts keep their ``index``
(part of every sample's uid).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_asyncppo.config import ConfigError, DataConfig
from hpc_asyncppo.paths import OVERLONG
from hpc_asyncppo.tasks.base import Prompt, tokenize_prompt


def find_overlong(
    prompts: Sequence[Prompt], tokenizer: Any, max_length: int, tools: list[dict] | None = None
) -> list[tuple[int, int]]:
    """(prompt index, token count) of every prompt longer than ``max_length`` tokens
    (``tools``: multi-turn, the tool schemas the chat template adds)."""
    lengths = ((p.index, len(tokenize_prompt(tokenizer, p, tools))) for p in prompts)
    return [(index, n) for index, n in lengths if n > max_length]


def check_overlong(
    prompts: Sequence[Prompt], overlong: list[tuple[int, int]], data: DataConfig
) -> None:
    """ConfigError if the overlong prompts cannot simply be dropped."""
    if not overlong:
        return
    source = f"data.train={data.train!r}" if data.train else f"data.task={data.task!r}"
    index, length = overlong[0]
    if not data.filter_overlong_prompts:
        raise ConfigError(
            f"{source}: prompt {index} has {length} tokens, more than data.max_prompt_length="
            f"{data.max_prompt_length} ({len(overlong)} such prompts); raise data.max_prompt_length "
            "or set data.filter_overlong_prompts=true to drop them"
        )
    if len(overlong) == len(prompts):
        raise ConfigError(
            f"{source}: every prompt is longer than data.max_prompt_length={data.max_prompt_length} "
            f"tokens (prompt {index} has {length}); raise data.max_prompt_length"
        )


def write_overlong(run_dir: Path, overlong: list[tuple[int, int]], max_length: int) -> None:
    record = {"max_prompt_length": max_length, "dropped": [[i, n] for i, n in overlong]}
    (run_dir / OVERLONG).write_text(json.dumps(record) + "\n")


def usable_prompts(prompts: Sequence[Prompt], run_dir: Path) -> list[Prompt]:
    """The task's prompts minus those RUN_DIR/overlong_prompts.json lists (all if absent)."""
    path = run_dir / OVERLONG
    if not path.exists():
        return list(prompts)
    dropped = {index for index, _ in json.loads(path.read_text())["dropped"]}
    return [p for p in prompts if p.index not in dropped]
