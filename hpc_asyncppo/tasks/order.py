"""The data order, owned by the trainer leader: which prompt goes out next, to any rank.

One seeded shuffle of the prompts per epoch, computed once when the epoch starts, and a
global cursor into it: the order does not depend on how many rollout ranks there are, so
a run resumes on any number of them and continues the same epoch. Each prompt handed out
is a *draw*, one integer that names it: ``epoch * num_prompts + position`` (position in
the list of usable prompts both sides derive from the task). The leader sends a draw with
each credit; the rollout rank that gets it generates that prompt's group.

Draws handed out and not turned into groups (a rank's unused credits at a checkpoint) come
back through ``give_back`` and go out again first, in their original order, so that no
prompt is skipped or repeated in an epoch. The state (``state_dict``) is three small
things: the epoch, the position in its shuffle, and the draws given back and not yet
handed out again; the shuffle itself is recomputed from the seed.

Cost: O(num_prompts) once per epoch (the shuffle, held as one int64 array of the
positions: 8 bytes per prompt), O(1) per draw.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np


def epoch_order(num_prompts: int, seed: int, epoch: int) -> np.ndarray:
    """The positions of the prompts in ``epoch``'s order: a seeded shuffle (the same one a
    single rollout rank walked before the leader owned the order)."""
    order = list(range(num_prompts))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return np.asarray(order, dtype=np.int64)


class PromptOrder:
    def __init__(self, num_prompts: int, seed: int):
        if num_prompts <= 0:
            raise ValueError("no prompts to train on")
        self.num_prompts, self.seed = num_prompts, seed
        self.epoch, self.position = 0, 0
        self.returned: deque[int] = deque()  # draws given back, to hand out again first
        self.shuffles = 0  # how many epoch orders were computed (one per epoch reached)
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def take(self) -> int:
        """The next draw."""
        if self.returned:
            return self.returned.popleft()
        if self.position >= self.num_prompts:
            self.epoch, self.position = self.epoch + 1, 0
        if self._order_epoch != self.epoch:
            self._order = epoch_order(self.num_prompts, self.seed, self.epoch)
            self._order_epoch = self.epoch
            self.shuffles += 1
        draw = self.epoch * self.num_prompts + int(self._order[self.position])
        self.position += 1
        return draw

    def give_back(self, draws: list[int]) -> None:
        """Draws handed out that will not be generated (their credits were void): they go
        out again before any new one, oldest first."""
        self.returned.extend(draws)
        self.returned = deque(sorted(self.returned, key=self._rank_in_order))

    def _rank_in_order(self, draw: int) -> tuple[int, int]:
        epoch, position = self.split(draw)
        if epoch == self._order_epoch and self._order is not None:
            # where in the epoch's order it was: a small list, sorted once per checkpoint
            return epoch, int(np.flatnonzero(self._order == position)[0])
        return epoch, position

    def split(self, draw: int) -> tuple[int, int]:
        """(epoch, position) of a draw."""
        return divmod(draw, self.num_prompts)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "returned": np.asarray(list(self.returned), dtype=np.int64),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.returned = deque(int(d) for d in np.asarray(state["returned"]).reshape(-1))
