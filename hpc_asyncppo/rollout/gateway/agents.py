"""``data.agent=package.module:function``: the user's agent, run once per session on the
rollout rank.

The function gets an ``openai`` client bound to its session (its base URL is the
session's: ``http://127.0.0.1:PORT/sessions/ID/v1``, with the run's token) and the
prompt row, and returns the session's reward: a number, or a dict with ``reward`` and
extra numbers to log. A coroutine function gets an ``AsyncOpenAI`` client instead and
runs on one event loop shared by the sessions; a plain function runs in a thread per
session (agents block on their calls, which the rank's loop answers). What it raises, or
a return that is no number, fails the session (``sessions.py``), never the rank.

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
    """Starts ``agent`` for each new session (``Sessions.start_agent``): a plain function in
    a thread of its own, a coroutine function on one event loop shared by every session.
    Their clients share one HTTP connection pool (an ``openai`` client per session would
    build its own, about 10 ms of CPU each)."""

    def __init__(self, agent: Callable[..., Any], port: Callable[[], int], token: str):
        """``port``: the gateway's, once it listens."""
        self.agent, self.port, self.token = agent, port, token
        self.sessions: Sessions | None = None  # set by the rank once both exist
        self.is_async = inspect.iscoroutinefunction(agent)
        self.http: Any = None  # httpx.Client, or httpx.AsyncClient on ``loop``
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, session: Session) -> None:
        if not self.is_async:
            threading.Thread(
                target=self._run, args=(session,), name=f"agent {session.id}", daemon=True
            ).start()
            return
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, name="agents", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._run_async(session), self.loop)

    def _url(self, session: Session) -> str:
        return f"http://127.0.0.1:{self.port()}/sessions/{session.id}/v1"

    def _run(self, session: Session) -> None:
        import httpx
        import openai

        if self.http is None:
            self.http = httpx.Client(timeout=None, limits=httpx.Limits(max_connections=None))
        client = openai.OpenAI(
            base_url=self._url(session), api_key=self.token, max_retries=0, http_client=self.http
        )
        try:
            outcome = self.agent(client, AgentRow.of(session.prompt, session.id))
        except Exception as exc:  # noqa: BLE001 - an agent's failure ends its session only
            outcome = exc
        if self.sessions is not None:
            self.sessions.end(session.id, outcome)

    async def _run_async(self, session: Session) -> None:
        import httpx
        import openai

        if self.http is None:
            self.http = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))
        client = openai.AsyncOpenAI(
            base_url=self._url(session), api_key=self.token, max_retries=0, http_client=self.http
        )
        try:
            outcome = await self.agent(client, AgentRow.of(session.prompt, session.id))
        except Exception as exc:  # noqa: BLE001 - an agent's failure ends its session only
            outcome = exc
        if self.sessions is not None:
            self.sessions.end(session.id, outcome)
