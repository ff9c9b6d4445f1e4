"""The gateway's HTTP side: OpenAI's endpoints on FastAPI, served by uvicorn in a thread of
the rollout rank.

Endpoints (each also under ``/sessions/{id}``, the base URL a session's client is bound
to; elsewhere the session is named by the ``X-Session-ID`` header)::

    GET  /v1/models                 the model this run trains
    POST /v1/chat/completions       messages (and tools) in, the model's turn out: text or
                                    tool_calls (hermes underneath); ``stream=true`` as
                                    server-sent events
    POST /v1/completions            a text prompt in, the completion out
    POST /v1/sessions               (``data.agent=external``) take a session: its id, its
                                    base URL and its prompt row; 429 when every session in
                                    flight on the rank is taken (after ``claim_wait_s``, or
                                    the body's ``{"wait_s": seconds}`` if shorter)
    POST /v1/sessions/{id}/reward   end a session: ``{"reward": number, ...}``, or fail
                                    it (its group is dropped): ``{"error": "why"}``

Every answer also carries the exact tokens (``prompt_token_ids``, and per choice
``token_ids``, ``token_logprobs``, ``token_versions``: the weights version that sampled
each), as vLLM's ``return_token_ids`` does. Sampling is the run's own (the
``rollout.*`` knobs, which the trainer's log-probs assume): a request's ``temperature``
or ``top_p`` must be absent or equal to the run's, ``n`` 1; ``max_tokens`` (or
``max_completion_tokens``) limits the call's turn, and the session's room
(``rollout.response_length``, the model's and observation tokens together) limits every
turn: a turn stopped by either ends with ``finish_reason: "length"``.

Every request needs ``Authorization: Bearer TOKEN`` (RUN_DIR/gateway/token, readable by
its owner only); without it: 401 and nothing else. Bad input gets OpenAI's error body:
malformed JSON or unknown fields 400, an unknown or ended session 404, a body past
``gateway.max_request_mb`` 413, a stopping run 503.

The rank writes its address to RUN_DIR/gateway/rank{i}.json once it listens. What it
keeps: the app and the server thread; the sessions are ``sessions.py``'s.
"""

# no "from __future__ import annotations": FastAPI reads the handlers' annotations
import asyncio
import dataclasses
import hmac
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from hpc_asyncppo.rollout.gateway.addresses import address_path
from hpc_asyncppo.rollout.gateway.agents import AgentRow
from hpc_asyncppo.rollout.gateway.chat import RequestError, normalize, openai_message
from hpc_asyncppo.rollout.gateway.sessions import Result, Sessions

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
# the fields each endpoint reads; any other is refused (400), those the run fixes checked
_COMMON = {"model", "stream", "stream_options", "n", "temperature", "top_p", "max_tokens",
           "max_completion_tokens", "seed", "user", "metadata", "stop", "logprobs",
           "top_logprobs", "extra_headers", "store", "session_id"}  # fmt: skip
FIELDS = {
    "chat": _COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls"},
    "completion": _COMMON | {"prompt", "echo"},
}


def check_body(kind: str, body: Any, sampling: dict[str, float]) -> dict[str, Any]:
    """A request body as the sessions take it (messages normalized); RequestError (400)
    names the first field that is wrong."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise RequestError(400, f"unknown fields: {', '.join(unknown)}", unknown[0])
    if body.get("n", 1) != 1:
        raise RequestError(400, "n must be 1: a group's n samples are n sessions", "n")
    for name, value in sampling.items():
        asked = body.get(name)
        if asked is not None and abs(float(asked) - value) > 1e-6:
            raise RequestError(400, f"{name}={asked}: this run samples at rollout.{name}="
                               f"{value:g} (the trainer's log-probs assume it)", name)  # fmt: skip
    limits = []
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):  # fmt: skip
            raise RequestError(400, f"{name} must be a positive integer", name)
        limits += [value] if value is not None else []
    max_tokens = min(limits, default=None)  # the turn's limit; the room's end bounds it too
    if kind == "completion":
        if not isinstance(body.get("prompt"), str):
            raise RequestError(400, "prompt must be a string", "prompt")
        return {"prompt": body["prompt"], "max_tokens": max_tokens}
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and t.get("type") == "function" for t in tools)):  # fmt: skip
        raise RequestError(400, "tools must be a list of {type: function, function: {...}}",
                           "tools")  # fmt: skip
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise RequestError(400, "tool_choice: auto (the model decides) or none", "tool_choice")
    if body.get("tool_choice") == "none":
        tools = None
    return {"messages": normalize(body.get("messages")), "tools": tools, "max_tokens": max_tokens}


def answer_body(result: Result, model: str, kind: str) -> dict[str, Any]:
    """A call's answer as OpenAI's body: ``chat.completion`` (``kind`` chat: the model's
    message) or ``text_completion`` (its text), with the exact tokens."""
    a = result.answer
    chat = kind == "chat"
    said = {"message": openai_message(a.message)} if chat else {"text": a.text}
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "session_id": result.session,
        "prompt_token_ids": result.prompt_ids,
        "choices": [
            {
                "index": 0,
                **said,
                "finish_reason": a.finish_reason,
                "logprobs": None,
                **_tokens(result),
            }
        ],  # fmt: skip
        "usage": _usage(result),
    }


def _tokens(result: Result) -> dict[str, Any]:
    return {"token_ids": result.token_ids, "token_logprobs": result.log_probs,
            "token_versions": result.versions}  # fmt: skip


def _usage(result: Result) -> dict[str, int]:
    p, c = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def chat_chunks(result: Result, model: str) -> list[dict[str, Any]]:
    """The answer as ``chat.completion.chunk`` events: the role, the text, the tool calls,
    then the finish reason (with the exact tokens and usage)."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}  # fmt: skip
    message = openai_message(result.answer.message)

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                     "logprobs": None, **extra}]}  # fmt: skip

    out = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        out.append(chunk({"content": message["content"]}))
    for k, call in enumerate(message.get("tool_calls", [])):
        out.append(chunk({"tool_calls": [{"index": k, **call}]}))
    last = chunk({}, result.answer.finish_reason, **_tokens(result))
    last.update(session_id=result.session, prompt_token_ids=result.prompt_ids,
                usage=_usage(result))  # fmt: skip
    out.append(last)
    return out


def make_app(sessions: Sessions, token: str, model: str, sampling: dict[str, float],
             max_request_bytes: int, claim_wait_s: float = 30.0):  # fmt: skip
    """The FastAPI app over ``sessions``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="hpc_asyncppo gateway", docs_url=None, redoc_url=None, openapi_url=None)

    def error(exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return error(RequestError(401, "a bearer token is required (RUN_DIR/gateway/token)",
                                      kind="authentication_error"))  # fmt: skip
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_bytes:
            return error(
                RequestError(
                    413,
                    f"the request has {length} bytes, more than "
                    f"gateway.max_request_mb allows ({max_request_bytes})",
                )
            )
        return await call_next(request)

    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model",
                                            "owned_by": "hpc_asyncppo"}]}  # fmt: skip

    async def serve(kind: str, request: Request, session: str | None):
        raw = await request.body()
        if len(raw) > max_request_bytes:
            return error(
                RequestError(
                    413,
                    f"the request has {len(raw)} bytes, more than "
                    f"gateway.max_request_mb allows ({max_request_bytes})",
                )
            )
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return error(RequestError(400, f"the body is not JSON: {exc}"))
        try:
            session = session or request.headers.get(SESSION_HEADER) or (
                body.get("session_id") if isinstance(body, dict) else None)  # fmt: skip
            if not session:
                raise RequestError(
                    400,
                    "no session: call through a session's base URL "
                    "(/sessions/ID/v1) or send the X-Session-ID header",
                )
            parsed = check_body(kind, body, sampling)
            result = await asyncio.wrap_future(sessions.post(session, kind, parsed))
        except RequestError as exc:
            return error(exc)
        if kind == "completion" or not body.get("stream"):
            return answer_body(result, model, kind)

        async def events():
            for c in chat_chunks(result, model):
                yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def chat(request: Request, session: str | None = None):
        return await serve("chat", request, session)

    async def completions(request: Request, session: str | None = None):
        return await serve("completion", request, session)

    async def claim(request: Request):
        """External agents: take a session, waiting up to ``claim_wait_s`` for one (or the
        body's ``wait_s``, if shorter: an agent polling several ranks asks for 0 or 1)."""
        try:
            wait_s = float(json.loads(await request.body() or b"{}").get("wait_s", claim_wait_s))
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError):
            wait_s = math.nan
        if not 0 <= wait_s < math.inf:
            return error(RequestError(400, 'the body is {} or {"wait_s": seconds}', "wait_s"))
        wait_s = min(wait_s, claim_wait_s)
        deadline = time.monotonic() + wait_s
        try:
            while (s := sessions.claim()) is None:
                if time.monotonic() > deadline:
                    raise RequestError(429, f"no session to claim: the {sessions.in_flight} "
                                       "sessions in flight on this rank (rollout."
                                       "prompts_per_generate x rollout.n) are all taken; "
                                       "retry", kind="rate_limit_error")  # fmt: skip
                await asyncio.sleep(0.05)
        except RequestError as exc:
            return error(exc)
        base = str(request.base_url).rstrip("/")
        row = AgentRow.of(s.prompt, s.id)
        return {"session_id": s.id, "base_url": f"{base}/sessions/{s.id}/v1",
                "row": dataclasses.asdict(row)}  # fmt: skip

    async def reward(session: str, request: Request):
        """External agents: end a session with its reward (a dict: reward, extra numbers),
        or fail it with ``error`` (the agent could not finish: its group is dropped)."""
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return error(RequestError(400, f"the body is not JSON: {exc}"))
        if not isinstance(body, dict) or not ("reward" in body or "error" in body):
            return error(RequestError(400, 'the body is {"reward": number, ...} or '
                                      '{"error": "why the agent failed"}', "reward"))  # fmt: skip
        try:
            await asyncio.wrap_future(sessions.end(session, body))
        except RequestError as exc:
            return error(exc)
        return {"session_id": session, "ended": True}

    app.add_api_route("/v1/sessions", claim, methods=["POST"])
    app.add_api_route("/v1/sessions/{session}/reward", reward, methods=["POST"])
    for prefix in ("", "/sessions/{session}"):
        app.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])
        app.add_api_route(f"{prefix}/v1/chat/completions", chat, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/completions", completions, methods=["POST"])
    return app


class Gateway:
    """The server of one rollout rank: listening once built, until ``close``."""

    def __init__(self, app: Any, host: str, port: int):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="gateway", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start on {host}:{self.port}")
            time.sleep(0.01)

    def write_address(self, run_dir: Path, rank: int) -> dict[str, Any]:
        host = socket.gethostname()
        row = {"rank": rank, "host": host, "port": self.port, "url": f"http://{host}:{self.port}/v1",
               "pid": os.getpid()}  # fmt: skip
        path = address_path(run_dir, rank)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(row) + "\n")
        tmp.replace(path)
        return row

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
