"""What a task is: its ``Prompt``s, the ``Task`` protocol (prompts, reward, vocabulary),
an ``Environment`` (a task that answers back), and how a prompt becomes token ids. Task
modules import these from here; ``registry.py`` looks a task up by ``data.task``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hpc_asyncppo.config import ConfigError


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
