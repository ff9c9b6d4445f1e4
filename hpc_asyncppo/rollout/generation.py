"""What both rollout engines produce and the trainer consumes: ``Generation`` (a prompt's n
responses, their log-probs and per-token weight versions), ``PartialGroup`` (a group cut
before its end: what a checkpoint keeps of it), the dtype names of ``model.dtype``, and
where a response ends."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Generation:
    """The n responses to one prompt. Shapes: (n, L) for ids, log-probs and versions, (n,) for
    lengths. ``versions``: the weights version that sampled each token (-1 past the length)."""

    response_ids: np.ndarray
    response_lengths: np.ndarray
    log_probs: np.ndarray
    versions: np.ndarray


@dataclass
class PartialGroup:
    """A group whose n responses have not all finished: ``sofar`` holds each response's
    tokens, log-probs and versions so far (``response_lengths``: how many; the EOS
    included once ``finished``). An engine continues it from there (``resume``)."""

    prompt: list[int]
    sofar: Generation
    finished: np.ndarray  # (n,) bool

    @property
    def tokens(self) -> int:
        """Response tokens sampled so far, over the n responses."""
        return int(self.sofar.response_lengths.sum())


def response_lengths(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Tokens up to and including the first EOS, or the full width if there is none. (B, L) -> (B,)"""
    is_eos = responses == eos_id
    first = torch.where(is_eos.any(dim=1), is_eos.float().argmax(dim=1), responses.shape[1] - 1)
    return first + 1
