"""Flow and staleness control in one: how many prompt groups each rollout rank may start.

verl's rule (DESIGN.md): at most ``max_required_groups`` = required * (1 + staleness_threshold)
* trigger_parameter_sync_step groups may be produced since the last weight sync and not yet
trained on. The leader enforces it by granting credits: a rollout rank starts a group only
with a credit. At each sync the budget restarts from what is still outstanding (queued at the
leader or granted and not yet received), as in verl. Because the trainer's queue can never
hold more than the budget, the same credits bound the leader's memory: no side can overrun
the other. The controller is pure bookkeeping (no MPI), so it is tested alone.

In a checkpoint (``state_dict``: the ``credits`` state, in the manifest) it keeps only the
count of groups trained; what is queued and in flight comes back with the intake's queue
and cut groups (``Intake.load_state_dict`` calls ``resume``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class CreditController:
    def __init__(self, rollout_ranks: int, max_outstanding: int, total_groups: int):
        self.max_outstanding = max_outstanding  # the staleness budget, in groups
        self.total_groups = total_groups  # groups the whole run trains on
        self.in_flight = [0] * rollout_ranks  # granted to each rank, not yet received
        self.queued = 0  # received, not yet trained or dropped
        self.trained = 0
        self.used = 0  # budget used since the last sync

    @property
    def outstanding(self) -> int:
        return self.queued + sum(self.in_flight)

    def grant(self) -> list[int]:
        """New credits per rank, spread to the ranks with the fewest groups in flight."""
        remaining = self.total_groups - self.trained - self.outstanding
        count = max(0, min(self.max_outstanding - self.used, remaining))
        grants = [0] * len(self.in_flight)
        for _ in range(count):
            rank = min(range(len(self.in_flight)), key=lambda r: self.in_flight[r])
            self.in_flight[rank] += 1
            grants[rank] += 1
        self.used += count
        return grants

    def received(self, rank: int) -> None:
        if self.in_flight[rank] <= 0:
            raise RuntimeError(f"rollout rank {rank} sent a group it had no credit for")
        self.in_flight[rank] -= 1
        self.queued += 1

    def consumed(self, trained: int, dropped: int) -> None:
        self.queued -= trained + dropped
        self.trained += trained

    def refund(self, count: int = 1) -> None:
        """``count`` groups dropped by dynamic sampling give their budget back, so they are
        refilled before the next sync (which only comes after the step they were meant for):
        neither trained nor waiting, they no longer hold back the rollout."""
        self.used = max(0, self.used - count)

    def revoke_unused(self, kept: list[int] | None = None) -> None:
        """Rollout ranks dropped their unused credits (a checkpoint); each still generates
        ``kept[rank]`` groups it had started (cut, in the checkpoint), which stay in flight."""
        kept = kept or [0] * len(self.in_flight)
        self.used -= sum(self.in_flight) - sum(kept)
        self.in_flight = list(kept)

    def resume(self, queued: int, in_flight: list[int] | None = None) -> None:
        """After a restore: ``queued`` groups waiting, ``in_flight[rank]`` started groups
        each rank continues from the checkpoint (none if not given)."""
        self.queued = queued
        if in_flight is not None:
            self.in_flight = list(in_flight)

    def synced(self) -> None:
        """A new weight version: the budget restarts from what is still outstanding."""
        self.used = self.outstanding

    def state_dict(self) -> dict:
        """The groups trained: the one count a resume cannot rebuild (the manifest's
        ``groups_trained``)."""
        return {"groups_trained": self.trained}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.trained = int(state["groups_trained"])
