"""Agents for the gateway's runs (``data.agent=tests.integration.agents:...``, importable
from the repository root, the job's working directory)."""

from __future__ import annotations

import time

from examples.lookup_agent import run as lookup


class _Slow:
    """An ``openai`` client whose agent thinks 20 ms after each answer: a session spends
    most of its life between two calls, where a stop finds it."""

    def __init__(self, client):
        self.client = client
        self.chat = self
        self.completions = self

    def create(self, **kwargs):
        answer = self.client.chat.completions.create(**kwargs)
        time.sleep(0.02)
        return answer


def slow_and_failing(client, row):
    """The example lookup agent, a little slow, and failing on every prompt whose index is
    3 mod 7 in its own way: it raises (3), returns no number (10), or ends its session
    without a call (17, ...)."""
    if row.index % 7 == 3:
        kind = (row.index // 7) % 3
        if kind == 0:
            raise RuntimeError(f"injected agent failure on prompt {row.index}")
        if kind == 1:
            return {"reward": "garbage"}
        return 1.0
    return lookup(_Slow(client), row)
