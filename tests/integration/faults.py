"""Reward functions that misbehave on purpose, for the failure tests (and one that gives
half the prompts no learning signal, for dynamic sampling).

Used as ``data.reward_fn=tests.integration.faults:...`` (importable from the repository root,
the working directory of the job). Under mpirun the world rank is OMPI_COMM_WORLD_RANK.
"""

from __future__ import annotations

import os
import time

from hpc_asyncppo.tasks.next_digit import NextDigitTask

_calls = 0
_reward = NextDigitTask.reward


def raise_on_rank1(prompt, response_text: str) -> float:
    """The default reward, except that world rank 1 raises after 64 calls (8 groups)."""
    global _calls
    if os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
        _calls += 1
        if _calls > 64:
            raise RuntimeError("injected failure in the reward function")
    return _reward(None, prompt, response_text)


def slow(prompt, response_text: str) -> float:
    """The default reward, slowly: keeps a run going long enough to kill one of its ranks."""
    time.sleep(0.002)
    return _reward(None, prompt, response_text)


def slower(prompt, response_text: str) -> float:
    """The default reward, 20 ms a call: a run of a few steps lasts long enough to preempt."""
    time.sleep(0.02)
    return _reward(None, prompt, response_text)


def flat_on_even_prompts(prompt, response_text: str) -> float:
    """0 for every response to an even-numbered prompt (a group dynamic sampling drops),
    the default reward otherwise."""
    if prompt.index % 2 == 0:
        return 0.0
    return _reward(None, prompt, response_text)
