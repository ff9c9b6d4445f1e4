"""Where a rollout rank is in the data: the order in which it takes prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class PromptCursor:
    """This rank's walk through the prompts: each epoch a seeded shuffle, every R-th prompt.

    Ranks never share a prompt within an epoch, so (seed, epoch, prompt index) is unique.
    """

    num_prompts: int
    rank: int
    num_ranks: int
    seed: int
    epoch: int = 0
    position: int = 0

    def _shard(self) -> list[int]:
        order = list(range(self.num_prompts))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order[self.rank :: self.num_ranks]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def next(self) -> tuple[int, int]:
        """(epoch, prompt index) of the next prompt."""
        shard = self._shard()
        if self.position >= len(shard):
            self.epoch, self.position = self.epoch + 1, 0
            shard = self._shard()
        index = shard[self.position]
        self.position += 1
        return self.epoch, index
