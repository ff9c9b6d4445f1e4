"""The learning-rate schedule: linear warm-up, then constant or cosine decay.

The rate is a pure function of the number of optimizer steps taken (``lr_factor``), so the
schedule's whole state is that count; it is saved in the checkpoint (``state_dict``) and a
resumed run continues the curve exactly.
"""

from __future__ import annotations

import math

import torch

from hpc_asyncppo.config import ActorConfig


def lr_factor(update: int, warmup: int, total: int, kind: str, min_ratio: float) -> float:
    """Multiplier of ``actor.lr`` for optimizer step ``update`` (0 for the first one).

    Warm-up (verl's and Hugging Face's convention): update / warmup for the first ``warmup``
    steps. Then ``constant``: 1; ``cosine``: from 1 down to ``min_ratio`` at step ``total``
    (and ``min_ratio`` after it).
    """
    if update < warmup:
        return update / warmup
    if kind == "constant":
        return 1.0
    if kind != "cosine":
        raise ValueError(f"unknown lr schedule {kind!r}; valid: constant, cosine")
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule:
    """Sets the optimizer's learning rate before each step; ``total`` optimizer steps in the run."""

    def __init__(self, optimizer: torch.optim.Optimizer, actor: ActorConfig, total: int):
        self.optimizer, self.actor, self.total = optimizer, actor, total
        self.updates = 0

    def current_lr(self) -> float:
        a = self.actor
        return a.lr * lr_factor(
            self.updates, a.lr_warmup_steps, self.total, a.lr_scheduler, a.min_lr_ratio
        )

    def before_step(self) -> float:
        """Set the rate of the step about to be taken; returns it."""
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def after_step(self) -> None:
        self.updates += 1

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
