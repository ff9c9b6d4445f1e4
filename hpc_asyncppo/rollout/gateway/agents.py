"""``data.agent=package.module:function``: the user's agent, run once per session on the
rollout rank.

The function gets an ``openai`` client bound to its session (its base URL is the
session's: ``http://127.0.0.1:PORT/sessions/ID/v1``, with the run's token) and the
prompt row, and returns the session's reward: a number, or a dict with ``reward`` and
extra numbers to log. A coroutine function gets an ``AsyncOpenAI`` client instead and
runs on its own event loop. Each session runs in a thread of its own (agents block on
their calls, which the rank's loop answers); what it raises, or a return that is no
number, fails the session (``sessions.py``), never the rank.

The row (``AgentRow``) carries what the task knows of the prompt: the chat messages (a
plain-text prompt as one user message), the ground truth and the tools' kwargs, as
verl's dataset rows do; the agent computes the reward from it.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpc_asyncppo.rollout.gateway.sessions import Session, Sessions
from hpc_asyncppo.tasks import Prompt


@dataclass(frozen=True)
class AgentRow:
    """What an agent is given of its prompt row."""

    index: int  # the row's index in the task (part of every sample's uid)
    messages: list[dict[str, str]]
    ground_truth: str
    data_source: str
    tools_kwargs: dict[str, Any]
    session_id: str

    @classmethod
    def of(cls, prompt: Prompt, session_id: str) -> AgentRow:
        if prompt.messages is not None:
            messages = [{"role": role, "content": text} for role, text in prompt.messages]
        else:
            messages = [{"role": "user", "content": prompt.text}]
        return cls(prompt.index, messages, prompt.ground_truth, prompt.data_source,
                   dict(prompt.tools_kwargs or {}), session_id)  # fmt: skip


class AgentRunner:
    """Starts ``agent`` for each new session (``Sessions.start_agent``)."""

    def __init__(self, agent: Callable[..., Any], port: Callable[[], int], token: str):
        """``port``: the gateway's, once it listens."""
        self.agent, self.port, self.token = agent, port, token
        self.sessions: Sessions | None = None  # set by the rank once both exist
        self.is_async = inspect.iscoroutinefunction(agent)

    def start(self, session: Session) -> None:
        threading.Thread(
            target=self._run, args=(session,), name=f"agent {session.id}", daemon=True
        ).start()

    def _run(self, session: Session) -> None:
        import openai

        url = f"http://127.0.0.1:{self.port()}/sessions/{session.id}/v1"
        row = AgentRow.of(session.prompt, session.id)
        try:
            if self.is_async:

                async def run() -> Any:
                    async with openai.AsyncOpenAI(base_url=url, api_key=self.token,
                                                  max_retries=0) as client:  # fmt: skip
                        return await self.agent(client, row)

                outcome = asyncio.run(run())
            else:
                with openai.OpenAI(base_url=url, api_key=self.token, max_retries=0) as client:
                    outcome = self.agent(client, row)
        except Exception as exc:  # noqa: BLE001 - an agent's failure ends its session only
            outcome = exc
        if self.sessions is not None:
            self.sessions.end(session.id, outcome)
