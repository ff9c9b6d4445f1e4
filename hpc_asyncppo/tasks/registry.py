"""A task looked up by ``data.task``: a registered name or an import path
``package.module:function`` whose function takes the ``DataConfig`` and returns a Task;
``data.reward_fn`` swaps the reward without touching the task. The registered tasks are
imported when asked for (a task module imports ``base.py``, never this one)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from hpc_asyncppo.config import ConfigError, DataConfig
from hpc_asyncppo.tasks.base import Prompt, RewardFn, Task, import_object


class _WithReward:
    def __init__(self, task: Task, reward_fn: RewardFn):
        self._task, self._reward_fn = task, reward_fn

    def prompts(self) -> Sequence[Prompt]:
        return self._task.prompts()

    def vocabulary(self) -> list[str]:
        return self._task.vocabulary()

    def reward(self, prompt: Prompt, response_text: str) -> float:
        return float(self._reward_fn(prompt, response_text))

    def __getattr__(self, name: str) -> Any:  # the task's own: chat_template, respond
        return getattr(self._task, name)


def load_task(data: DataConfig) -> Task:
    from hpc_asyncppo.tasks.jsonl import JsonlTask
    from hpc_asyncppo.tasks.long_tail import LongTailTask
    from hpc_asyncppo.tasks.next_digit import NextDigitTask
    from hpc_asyncppo.tasks.tool_lookup import ToolLookupTask
    from hpc_asyncppo.tasks.verl_dataset import VerlDatasetTask

    registry: dict[str, Callable[[DataConfig], Task]] = {
        "next_digit": NextDigitTask,
        "jsonl": JsonlTask,
        "verl": VerlDatasetTask,
        "tool_lookup": ToolLookupTask,
        "long_tail": LongTailTask,
    }
    if data.task in registry:
        task = registry[data.task](data)
    elif ":" in data.task:
        task = import_object(data.task, "data.task")(data)  # type: ignore[operator]
    else:
        raise ConfigError(
            f"data.task={data.task!r} is not a registered task ({', '.join(registry)}) "
            "nor an import path package.module:function"
        )
    if data.reward_fn:
        task = _WithReward(task, import_object(data.reward_fn, "data.reward_fn"))  # type: ignore[arg-type]
    return task


def load_agent(data: DataConfig) -> Callable[..., Any] | None:
    """``data.agent``'s function (``rollout/gateway/agents.py`` runs it), None for
    ``external`` (agents elsewhere claim the sessions); ConfigError naming data.agent if
    it does not import or is not a function."""
    if data.agent == "external":
        return None
    agent = import_object(data.agent, "data.agent")
    if not callable(agent):
        raise ConfigError(f"data.agent={data.agent!r} is not a function")
    return agent


def load_val_task(data: DataConfig) -> Task:
    """The task over the held-out prompts of ``data.val`` (read as ``data.train`` is), with
    the task's own reward. ConfigError or DatasetError naming data.val if it is unusable."""
    from pathlib import Path

    from hpc_asyncppo.tasks.jsonl import DatasetError

    if not Path(data.val).is_file():
        raise ConfigError(f"data.val={data.val!r}: no such file")
    try:
        return load_task(dataclasses.replace(data, train=data.val))
    except (ConfigError, DatasetError) as exc:  # the readers name data.train: say which file
        raise type(exc)(str(exc).replace("data.train=", "data.val=")) from None
