"""What the rollout loop needs from a generation engine (``RolloutEngine``), and how an
engine says it died (``EngineDied``); ``engine_factory.py`` picks one of the two.

``hf`` (transformers ``generate``: any device, one batch at a time) and ``vllm``
(continuous batching, in-place weight updates, interruptible for partial rollout). Both
take token-id prompts and return ``Generation``s laid out alike: ids right-padded with the
pad token, lengths that count the EOS, log-probs 0 and versions -1 past the length.

An engine whose own processes die under the rank (vLLM's engine core: killed, crashed, or
killed for a stall) raises ``EngineDied``; its groups' tokens so far stay readable
(``unfinished``), and the rollout rank restarts it in place (``rollouter.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol

import numpy as np
import torch

from hpc_asyncppo.rollout.generation import Generation, PartialGroup, ResponseGroup
from hpc_asyncppo.transport.weight_group import WeightGroupSpec
from hpc_asyncppo.transport.weights import WeightUpdate


class EngineDied(RuntimeError):
    """The engine's processes are gone (the message says which, and how); the engine object
    still answers ``unfinished`` and ``close``, nothing else."""


class RolloutEngine(Protocol):
    eos_id: int
    pad_id: int
    tokenizer: Any  # the model's HF tokenizer (chat template, decoding)
    # hf: checked between two tokens, a true value ends the step with the tokens so far
    should_stop: Callable[[], bool] | None
    # multi-turn (rollout/turns.py): the tokens that end the model's turn (EOS, the end of a
    # tool call); the response then waits (``Response.waiting``) until the rollout rank
    # appends an observation or ends it. Empty: single-turn
    turn_ends: frozenset[int]
    groups: dict[Hashable, ResponseGroup]  # the groups in flight, as the engine keeps them

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: np.ndarray) -> str: ...

    @property
    def in_flight(self) -> int:
        """Prompt groups submitted and not yet returned by ``step``."""
        ...

    def submit(
        self, key: Hashable, prompt: list[int], n: int, temperature: float | None = None
    ) -> None:
        """Queue n responses to ``prompt`` at ``temperature`` (None: rollout.temperature;
        0: greedy); ``step`` returns them under ``key``."""
        ...

    def resume(self, key: Hashable, partial: PartialGroup) -> None:
        """Continue a group from its tokens so far (a checkpoint's partial response)."""
        ...

    def unfinished(self) -> list[tuple[Hashable, PartialGroup]]:
        """The groups in flight with their tokens so far (after ``interrupt``)."""
        ...

    def step(self) -> list[tuple[Hashable, Generation]]:
        """Advance generation (hf: to the end; vllm: one decoding step); finished groups."""
        ...

    def interrupt(self) -> None:
        """Cut running generations, keeping their tokens; they resume at the next ``step``
        under whatever weights are loaded then (a no-op for hf, where nothing runs)."""
        ...

    def generate(self, prompts: list[list[int]], n: int) -> list[Generation]:
        """Sample n responses for every prompt, to completion."""
        ...

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load a whole set of weights from this process (tests, tools: no weight group)."""
        ...

    # A sync goes from the trainer leader to the engine's members of the weight group
    # (``transport/weight_group.py``): hf, the rank itself; vllm, each of its workers.
    stages_weights: bool  # True: receive_staged / load_staged may overlap generation (hf)

    def join_weights(self, spec: WeightGroupSpec, first_rank: int) -> None:
        """The engine's members join the weight group from rank ``first_rank`` on."""
        ...

    def update_weights(self, expected: int, digest: bool = False) -> WeightUpdate:
        """Receive the sync announced as version ``expected`` and load it, with no request
        running; ``digest``: each member hashes what it loaded."""
        ...

    def close(self) -> None: ...
