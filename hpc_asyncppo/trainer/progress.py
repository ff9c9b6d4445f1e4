"""The trainer leader's counters: where the run is, in one object that checkpoints itself.

``state_dict()`` is what the checkpoint's manifest records of them (the ``progress``
state: eight numbers, the same keys as before this object existed, so older checkpoints
load); ``load_state_dict`` takes a manifest. The time of this attempt counts from ``start()``; ``elapsed_s`` adds the
attempts before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Progress:
    step: int = 0  # trainer steps done
    version: int = 0  # the newest weight version sent
    synced_step: int = 0  # the step after which that version's weights were sent
    samples_trained: int = 0
    samples_dropped: int = 0
    samples_filtered: int = 0  # of samples_dropped: by dynamic sampling
    idle_s: float = 0.0  # the leader's time waiting for samples, over every attempt
    elapsed_before_s: float = 0.0  # training time of earlier attempts of this job
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)  # tests inject one
    started_at: float = field(default=0.0)  # this attempt's start by ``clock``, not saved

    def __post_init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.started_at = self.clock()

    def add_wait(self, since: float) -> None:
        """The leader waited for samples from ``since`` (a ``clock()`` reading) until now."""
        self.idle_s += self.clock() - since

    def elapsed_s(self) -> float:
        return self.elapsed_before_s + self.clock() - self.started_at

    @property
    def unsynced(self) -> bool:
        """The weights trained past their version's broadcast (restored from a checkpoint
        taken between two syncs): they go out as a new version."""
        return self.synced_step != self.step

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "param_version": self.version,
            "synced_step": self.synced_step,
            "samples_trained": self.samples_trained,
            "samples_dropped": self.samples_dropped,
            "samples_filtered": self.samples_filtered,
            "elapsed_s": self.elapsed_s(),
            "idle_s": self.idle_s,
        }

    def load_state_dict(self, meta: Mapping[str, Any]) -> None:
        self.step, self.version = int(meta["step"]), int(meta["param_version"])
        self.synced_step = int(meta.get("synced_step", -1))  # absent: unknown, resent
        self.samples_trained = int(meta["samples_trained"])
        self.samples_dropped = int(meta["samples_dropped"])
        self.samples_filtered = int(meta.get("samples_filtered", 0))  # absent before recipes
        self.elapsed_before_s, self.idle_s = float(meta["elapsed_s"]), float(meta["idle_s"])
        self.start()
