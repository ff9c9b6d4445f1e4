"""A response's loss mask, as the samples carry it (multi-turn only): 1 on the model's own
tokens, 0 on observations (a tool's or an environment's answer: context, never trained).
Both roles read it: the rollout rank to continue a cut group, the trainer to count turns."""

from __future__ import annotations

import numpy as np


def observation_spans(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) runs of 0 in one response's loss mask: its observations."""
    edges = np.diff(np.concatenate([[1], np.asarray(loss_mask, dtype=np.int8), [1]]))
    return list(
        zip(np.flatnonzero(edges == -1).tolist(), np.flatnonzero(edges == 1).tolist(), strict=True)
    )
