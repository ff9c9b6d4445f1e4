"""Datasets in verl's layout, from parquet or JSONL: what real RL-for-LM runs train on.

Each row: ``prompt`` (a list of chat messages {"role", "content"}, or a plain string),
``reward_model.ground_truth``, and ``data_source`` (which picks the reward, e.g.
"openai/gsm8k"; ``data.reward_fn`` overrides it); multi-turn, ``extra_info.tools_kwargs``
(tool name -> {"create_kwargs": {...}}) for the tools' ``create``. The model's chat template is applied
when the rollout tokenizes the prompt. A malformed row is an error naming file, row, field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpc_asyncppo.config import ConfigError, DataConfig
from hpc_asyncppo.tasks.base import Prompt
from hpc_asyncppo.tasks.gsm8k import gsm8k_reward
from hpc_asyncppo.tasks.jsonl import DatasetError

REWARDS_BY_SOURCE: dict[str, Callable[[Prompt, str], float]] = {
    "openai/gsm8k": gsm8k_reward,
    "gsm8k": gsm8k_reward,
}


def _rows(path: Path) -> list[Any]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise DatasetError(f"{path}: not a readable parquet file ({exc})") from None
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    return rows


def _messages(value: Any, where: str) -> tuple[tuple[str, str], ...] | str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise DatasetError(
            f"{where}: field 'prompt' must be a non-empty list of chat messages or a string"
        )
    messages = []
    for i, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                f"{where}: field 'prompt[{i}]' must be {{'role': str, 'content': str}}"
            )
        messages.append((message["role"], message["content"]))
    return tuple(messages)


def parse_row(row: Any, where: str) -> tuple[tuple[tuple[str, str], ...] | str, str, str]:
    """(messages or text, ground truth, data source) of one row; DatasetError if malformed."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be an object")
    if "prompt" not in row:
        raise DatasetError(f"{where}: field 'prompt' missing")
    prompt = _messages(row["prompt"], where)
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise DatasetError(f"{where}: field 'reward_model.ground_truth' missing")
    source = row.get("data_source", "")
    if not isinstance(source, str):
        raise DatasetError(f"{where}: field 'data_source' must be a string")
    return prompt, str(reward_model["ground_truth"]), source


class VerlDatasetTask:
    def __init__(self, data: DataConfig):
        if not data.train:
            raise ConfigError("data.task=verl needs data.train=PATH (.parquet or .jsonl)")
        path = Path(data.train)
        if not path.is_file():
            raise ConfigError(f"data.train={data.train!r}: no such file")
        self._prompts, self._sources = [], []
        for i, row in enumerate(_rows(path)):
            prompt, truth, source = parse_row(row, f"{path}: row {i}")
            # multi-turn: what each tool's create() gets for this row (verl's field)
            extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
            kwargs = (
                extra.get("tools_kwargs") if isinstance(extra.get("tools_kwargs"), dict) else None
            )
            if isinstance(prompt, str):
                self._prompts.append(
                    Prompt(i, prompt, truth, data_source=source, tools_kwargs=kwargs)
                )
            else:
                text = "\n".join(content for _, content in prompt)
                self._prompts.append(
                    Prompt(i, text, truth, messages=prompt, data_source=source, tools_kwargs=kwargs)
                )
            self._sources.append(source)
        if not self._prompts:
            raise DatasetError(f"{path}: no rows")
        unknown = sorted({s for s in self._sources if s not in REWARDS_BY_SOURCE})
        if unknown and not data.reward_fn:
            raise ConfigError(
                f"data.train={data.train!r}: no reward for data_source {unknown[0]!r} "
                f"(known: {', '.join(REWARDS_BY_SOURCE)}); set data.reward_fn=package.module:function"
            )

    def prompts(self) -> Sequence[Prompt]:
        return self._prompts

    def vocabulary(self) -> list[str]:
        return sorted({w for p in self._prompts for w in (p.text + " " + p.ground_truth).split()})

    def reward(self, prompt: Prompt, response_text: str) -> float:
        return REWARDS_BY_SOURCE[self._sources[prompt.index]](prompt, response_text)
