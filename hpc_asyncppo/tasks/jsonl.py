"""A task read from a JSONL file: one {"prompt": str, "ground_truth": str} object per line,
with an optional "data_source" string (validation reports each source on its own).

The reward comes from ``data.reward_fn`` (required for this task). A malformed row is an
error that names the file, the line and the field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from hpc_asyncppo.config import ConfigError, DataConfig
from hpc_asyncppo.tasks.base import Prompt


class DatasetError(ValueError):
    """A dataset row is malformed; the message names file, row and field."""


def read_jsonl_prompts(path: Path) -> list[Prompt]:
    prompts = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: a row must be a JSON object")
            for field in ("prompt", "ground_truth"):
                if not isinstance(row.get(field), str):
                    raise DatasetError(f"{path}:{lineno}: field '{field}' missing or not a string")
            source = row.get("data_source", "")
            if not isinstance(source, str):
                raise DatasetError(f"{path}:{lineno}: field 'data_source' must be a string")
            prompts.append(
                Prompt(len(prompts), row["prompt"], row["ground_truth"], data_source=source)
            )
    if not prompts:
        raise DatasetError(f"{path}: no rows")
    return prompts


class JsonlTask:
    def __init__(self, data: DataConfig):
        if not data.train:
            raise ConfigError("data.task=jsonl needs data.train=PATH.jsonl")
        if not data.reward_fn:
            raise ConfigError("data.task=jsonl needs data.reward_fn=package.module:function")
        path = Path(data.train)
        if not path.is_file():
            raise ConfigError(f"data.train={data.train!r}: no such file")
        self._prompts = read_jsonl_prompts(path)

    def prompts(self) -> Sequence[Prompt]:
        return self._prompts

    def vocabulary(self) -> list[str]:
        return sorted({w for p in self._prompts for w in (p.text + " " + p.ground_truth).split()})

    def reward(self, prompt: Prompt, response_text: str) -> float:
        raise NotImplementedError("JsonlTask's reward is data.reward_fn (wrapped by load_task)")
