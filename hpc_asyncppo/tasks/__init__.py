"""Tasks: where prompts come from and how responses are scored.

A task is looked up by ``data.task``: a registered name (``TASKS``) or an import path
``package.module:function`` whose function takes the ``DataConfig`` and returns a Task.
``data.reward_fn`` (``package.module:function(prompt, response_text) -> float``) swaps the
reward without touching the task, so a user adds a dataset file and a reward function
without editing the trainer.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hpc_asyncppo.config import ConfigError, DataConfig


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the task's prompt list; part of every sample's uid
    text: str  # what the tokenizer encodes (when there are no chat messages)
    ground_truth: str  # what the reward compares against
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) chat turns, if any
    data_source: str = ""  # where the row comes from (verl's data_source): validation's groups
    # multi-turn (verl's extra_info.tools_kwargs): tool name -> {"create_kwargs": {...}},
    # what each tool's ``create`` gets for this prompt's trajectories
    tools_kwargs: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)


def tokenize_prompt(tokenizer: Any, prompt: Prompt, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a prompt: chat messages through the model's chat template (with the
    generation prompt and, multi-turn, the ``tools``' JSON schemas, which the template
    describes to the model: Qwen2.5's in its system message), plain text as it is."""
    if prompt.messages is not None and getattr(tokenizer, "chat_template", None):
        messages = [{"role": role, "content": content} for role, content in prompt.messages]
        extra = {"tools": tools} if tools else {}
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **extra
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt.text, add_special_tokens=False)["input_ids"]


class Task(Protocol):
    def prompts(self) -> Sequence[Prompt]: ...

    def reward(self, prompt: Prompt, response_text: str) -> float: ...

    def vocabulary(self) -> list[str]:
        """Words of the tiny default tokenizer; tasks meant for real models return []."""
        ...


class Environment(Task, Protocol):
    """A task that answers back (multi-turn: ``rollout.multi_turn.enable=true``): after a
    model turn without a tool call, ``respond`` gets the response so far (the model's turns
    and every observation, as text) and returns the environment's plain-text answer (the
    next user message, through the chat template) or None to end the trajectory. It runs
    on the rollout rank's loop, between two engine steps: keep it quick (a slow
    environment is a tool)."""

    def respond(self, prompt: Prompt, response_text: str) -> str | None: ...


RewardFn = Callable[[Prompt, str], float]


def import_object(spec: str, key: str) -> object:
    """``package.module:name`` -> the object; ConfigError naming ``key`` if it doesn't resolve."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}={spec!r} must look like package.module:function")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{key}={spec!r} cannot be imported: {exc}") from None


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
    from hpc_asyncppo.tasks.next_digit import NextDigitTask
    from hpc_asyncppo.tasks.tool_lookup import ToolLookupTask
    from hpc_asyncppo.tasks.verl_dataset import VerlDatasetTask

    registry: dict[str, Callable[[DataConfig], Task]] = {
        "next_digit": NextDigitTask,
        "jsonl": JsonlTask,
        "verl": VerlDatasetTask,
        "tool_lookup": ToolLookupTask,
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
