"""Agents for the gateway's runs (``data.agent=tests.integration.agents:...``, importable
from the repository root, the job's working directory)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from examples.lookup_agent import LOOKUP
from examples.lookup_agent import run as lookup
from hpc_asyncppo.runtime.faults import RUN_DIR_ENV

# the gated session's first answer, as it got it before the stop and after the resume
GATED = "gated_first_answer.json"
GATED_AGAIN = "gated_first_answer_again.json"


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
    without a call (17, ...); on a training prompt whose index is 1 mod 5 it starts over
    once (``_starting_over``)."""
    if row.index % 7 == 3:
        kind = (row.index // 7) % 3
        if kind == 0:
            raise RuntimeError(f"injected agent failure on prompt {row.index}")
        if kind == 1:
            return {"reward": "garbage"}
        return 1.0
    return _starting_over(_Slow(client), row)


def starts_over(row) -> bool:
    return row.index % 5 == 1 and not row.session_id.startswith("val-")


def _starting_over(client, row):
    """The lookup agent, which on prompts that ``starts_over`` first makes a call whose
    answer it throws away, then runs from the prompt again: a call that does not extend
    the conversation, so every such session is two sequences. (The first call has a seed
    of its own: the same body again would be a client's retry, answered with the same
    turn.)"""
    if starts_over(row):
        client.chat.completions.create(model="policy", messages=list(row.messages),
                                       tools=[LOOKUP], parallel_tool_calls=False, seed=1)  # fmt: skip
    return lookup(client, row)


class _Gate(_Slow):
    """The first session of a run to get an answer (``GATED`` in the run directory names
    it, created once) waits after that answer until its rank's process ends, so a stop
    finds it with one turn recorded. Run again after a resume, the same session writes the first
    answer it gets then (``GATED_AGAIN``) and goes on."""

    def __init__(self, client, session_id: str):
        super().__init__(client)
        self.session_id, self.calls = session_id, 0
        self.run_dir = Path(os.environ[RUN_DIR_ENV])

    def create(self, **kwargs):
        answer = super().create(**kwargs)
        self.calls += 1
        if self.calls == 1:
            extra = answer.choices[0].model_extra
            first = {
                "session": self.session_id,
                "prompt_token_ids": answer.model_extra["prompt_token_ids"],
                **{k: extra[k] for k in ("token_ids", "token_logprobs", "token_versions")},
            }
            gated, mine = self.run_dir / GATED, self.run_dir / f"{GATED}.{self.session_id}"
            if gated.exists():
                if json.loads(gated.read_text())["session"] == self.session_id:
                    (self.run_dir / GATED_AGAIN).write_text(json.dumps(first))
                return answer
            mine.write_text(json.dumps(first))
            try:
                os.link(mine, gated)  # whole, and only the run's first: it waits for the stop
            except FileExistsError:
                return answer
            finally:
                mine.unlink()
            time.sleep(600)  # the stop ends this process first (tests/harness.py HANG_S)
            raise RuntimeError("the gated session was never stopped")
        return answer


def gated_slow_and_failing(client, row):
    """``slow_and_failing``, one training session of which waits for the stop (``_Gate``;
    a validation's waiting would hold the next sync)."""
    if row.index % 7 == 3 or row.session_id.startswith("val-"):
        return slow_and_failing(client, row)
    return _starting_over(_Gate(client, row.session_id), row)


def raises_key_error(client, row):
    """A broken agent, as a new user writes one: it reads a key the row does not have."""
    return row.tools_kwargs["missing"]["answer"]
