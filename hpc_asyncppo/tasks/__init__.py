"""Tasks: where prompts come from and how responses are scored.

A task is looked up by ``data.task`` (``registry.py``): a registered name or an import
path ``package.module:function`` whose function takes the ``DataConfig`` and returns a Task
(``base.py``). ``data.reward_fn`` (``package.module:function(prompt, response_text) ->
float``) swaps the reward without touching the task, so a user adds a dataset file and a
reward function without editing the trainer.

This file only re-exports the names callers use; the task modules import ``base.py``.
"""

from hpc_asyncppo.tasks.base import (
    Environment,
    Prompt,
    RewardFn,
    Task,
    import_object,
    tokenize_prompt,
)
from hpc_asyncppo.tasks.registry import load_task, load_val_task

__all__ = [
    "Environment",
    "Prompt",
    "RewardFn",
    "Task",
    "import_object",
    "load_task",
    "load_val_task",
    "tokenize_prompt",
]
