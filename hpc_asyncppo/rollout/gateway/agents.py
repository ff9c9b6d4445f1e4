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
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hpc_asyncppo.rollout.gateway.sessions import Session, Sessions
from hpc_asyncppo.tasks import Prompt

# the agents' clients drop a connection idle this long: before the gateway's server
# (uvicorn, 5 s) closes it, which a request sent at that moment would meet as an error
KEEPALIVE_S = 2.0


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
    """Starts ``agent`` for each new session (``Sessions.start_agent``): a plain function on
    a pool of threads (``threads``: the sessions a rank holds at once, and as many spare
    for agents that outlive their session's timeout), a coroutine function on one event
    loop shared by every session. Each thread keeps one HTTP client for the sessions it
    runs (an ``openai`` client building its own costs about 10 ms of CPU, and one pool
    shared by every thread spends its time on its lock)."""

    def __init__(
        self, agent: Callable[..., Any], port: Callable[[], int], token: str, threads: int
    ):
        """``port``: the gateway's, once it listens."""
        self.agent, self.port, self.token = agent, port, token
        self.sessions: Sessions | None = None  # set by the rank once both exist
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per call
        self.is_async = inspect.iscoroutinefunction(agent)
        self.pool = ThreadPoolExecutor(max_workers=2 * threads, thread_name_prefix="agent")
        self.local = threading.local()  # each thread's httpx.Client
        self.loop: asyncio.AbstractEventLoop | None = None
        self.async_http: Any = None  # httpx.AsyncClient, on ``loop``

    def start(self, session: Session) -> None:
        if not self.is_async:
            self.pool.submit(self._run, session)
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

        if getattr(self.local, "http", None) is None:  # idle connections closed before
            limits = httpx.Limits(keepalive_expiry=KEEPALIVE_S)  # the server closes them
            self.local.http = httpx.Client(timeout=None, limits=limits)
        client = openai.OpenAI(
            base_url=self._url(session), api_key=self.token, max_retries=0,
            http_client=self.local.http,
        )  # fmt: skip
        try:
            outcome = self.agent(client, AgentRow.of(session.prompt, session.id))
        except Exception as exc:  # noqa: BLE001 - an agent's failure ends its session only
            outcome = exc
        if self.sessions is not None:
            self.sessions.end(session.id, outcome)

    async def _run_async(self, session: Session) -> None:
        import httpx
        import openai

        if self.async_http is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None,
                                  keepalive_expiry=KEEPALIVE_S)  # fmt: skip
            self.async_http = httpx.AsyncClient(timeout=None, limits=limits)
        client = openai.AsyncOpenAI(
            base_url=self._url(session), api_key=self.token, max_retries=0,
            http_client=self.async_http,
        )  # fmt: skip
        try:
            outcome = await self.agent(client, AgentRow.of(session.prompt, session.id))
        except Exception as exc:  # noqa: BLE001 - an agent's failure ends its session only
            outcome = exc
        if self.sessions is not None:
            self.sessions.end(session.id, outcome)
