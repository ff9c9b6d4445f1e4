"""The gateway's HTTP side: three front doors on FastAPI, served by uvicorn in a thread of
the rollout rank. Each door only translates (``requests.py``: the fields; ``openai_chat``,
``openai_responses``, ``anthropic_messages``: each API's shapes); the sessions below them
are one (``sessions.py``).

Endpoints (each also under ``/sessions/{id}``, the base URL a session's client is bound
to; elsewhere the session is named by the ``X-Session-ID`` header)::

    POST /v1/chat/completions       OpenAI's Chat Completions (``stream=true``: server-sent
                                    events as the turn grows, on every door: ``streaming.py``)
    POST /v1/completions            a text prompt in, the completion out
    POST /v1/responses              OpenAI's Responses (the Agents SDK's default)
    POST /v1/messages               Anthropic's Messages (and ``/v1/messages/count_tokens``)
    GET  /v1/models, /v1/models/{id}   the model this run trains
    GET  /health                    200 while the rank serves
    POST /v1/sessions               (``data.agent=external``) take a session: its id, its
                                    base URL and its prompt row; 429 when every session in
                                    flight on the rank is taken (after ``claim_wait_s``, or
                                    the body's ``{"wait_s": seconds}`` if shorter)
    POST /v1/sessions/{id}/reward   end a session: ``{"reward": number, ...}``, or fail
                                    it: ``{"error": "why"}``

Every request but ``/health`` needs the run's token, as ``Authorization: Bearer TOKEN``
(every SDK) or ``x-api-key: TOKEN`` (RUN_DIR/gateway/token, readable by its owner only);
without it: 401 and nothing else. Every error, unknown routes and wrong methods included,
comes in its API's shape (Anthropic's under ``/v1/messages``, OpenAI's elsewhere, with
OpenAI's string ``code`` where it has one): malformed JSON or a field of the wrong type
400, an unknown or ended session 404, a body past ``gateway.max_request_mb`` 413, a
stopping run 503.

The rank writes its address to RUN_DIR/gateway/rank{i}.json once it listens. What it
keeps: the app and the server thread, and the Responses door's last conversations
(``openai_responses.STORED``); the sessions are ``sessions.py``'s.
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
from pathlib import Path
from typing import Any

from hpc_asyncppo.rollout.gateway import anthropic_messages, openai_chat, openai_responses
from hpc_asyncppo.rollout.gateway.addresses import address_path
from hpc_asyncppo.rollout.gateway.agents import AgentRow
from hpc_asyncppo.rollout.gateway.requests import Fields, RequestError
from hpc_asyncppo.rollout.gateway.sessions import Sessions
from hpc_asyncppo.rollout.gateway.streaming import Progress, TurnText

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"


def is_anthropic(path: str) -> bool:
    return "/v1/messages" in path


def make_app(sessions: Sessions, token: str, model: str, fields: Fields,
             max_request_bytes: int, claim_wait_s: float = 30.0):  # fmt: skip
    """The FastAPI app over ``sessions``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="hpc_asyncppo gateway", docs_url=None, redoc_url=None, openapi_url=None)
    responses = openai_responses.ResponsesDoor(fields)

    def piece(token_id: int) -> str:
        return sessions.tokenizer.decode([token_id])

    def error(exc: RequestError, path: str = "") -> JSONResponse:
        body = exc.anthropic_body() if is_anthropic(path) else exc.body()
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        what = {404: f"no route {request.url.path}: see the gateway's endpoints "
                     "(/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, "
                     "/v1/models)",
                405: f"{request.method} is not allowed on {request.url.path}"}  # fmt: skip
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = what.get(exc.status_code, str(exc.detail))
        return error(RequestError(exc.status_code, message, kind=kind), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return error(RequestError(422, f"the request is invalid: {exc.errors()}"),
                     request.url.path)  # fmt: skip

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        if path == "/health":
            return await call_next(request)
        given = request.headers.get("authorization", "")
        key = request.headers.get("x-api-key", "")
        if not (hmac.compare_digest(given.encode(), f"Bearer {token}".encode())
                or hmac.compare_digest(key.encode(), token.encode())):  # fmt: skip
            return error(RequestError(401, "the run's token is required, as Authorization: "
                                      "Bearer TOKEN or x-api-key (RUN_DIR/gateway/token)",
                                      kind="authentication_error"), path)  # fmt: skip
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_bytes:
            return error(_too_large(int(length), max_request_bytes), path)
        return await call_next(request)

    async def health() -> dict[str, Any]:
        return {"status": "ok", "sessions": sessions.in_flight}

    def model_row() -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 0, "owned_by": "hpc_asyncppo"}

    async def models(session: str | None = None) -> dict[str, Any]:
        return {"object": "list", "data": [model_row()]}

    async def one_model(name: str, session: str | None = None):
        if name != model:
            return error(RequestError(404, f"the model {name!r} does not exist: this run "
                                      f"serves {model!r}", "model", kind="not_found_error",
                                      code="model_not_found"))  # fmt: skip
        return model_row()

    async def read_body(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > max_request_bytes:
            raise _too_large(len(raw), max_request_bytes)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"the body is not JSON: {exc}") from None

    def session_of(request: Request, body: Any, session: str | None) -> str:
        session = session or request.headers.get(SESSION_HEADER) or (
            body.get("session_id") if isinstance(body, dict) else None)  # fmt: skip
        if not session:
            raise RequestError(400, "no session: call through a session's base URL "
                               "(/sessions/ID/v1) or send the X-Session-ID header")  # fmt: skip
        return session

    async def called(request: Request, session: str | None, door, stream_of):
        """A call through ``door`` (its body -> the ``Call`` and what the door keeps for
        its answer): without ``stream``, the body, that, and the sessions' ``Result``; with
        it, the streamed answer (``stream_of(call, kept, body)``: the door's writer)."""
        body = await read_body(request)
        call, kept = door(body)
        sid = session_of(request, body, session)
        if not body.get("stream"):
            return body, kept, await asyncio.wrap_future(sessions.post(sid, call))
        return await streamed(sid, call, stream_of(call, kept, body))

    async def streamed(sid: str, call: Any, writer: Any):
        """A streamed call: the door's events as the turn grows (``streaming.py``). Until
        the engine made its first tokens a refusal is the error it is without streaming;
        after, the stream ends with an error event."""
        loop = asyncio.get_running_loop()
        grown: asyncio.Queue = asyncio.Queue()

        def progress(p: Progress) -> None:  # on the rank's loop
            try:
                loop.call_soon_threadsafe(grown.put_nowait, p)
            except RuntimeError:  # the server is shutting down
                pass

        result = asyncio.wrap_future(sessions.post(sid, call, progress))
        first = await _next(grown, result)
        if first is None and isinstance(result.exception(), RequestError):
            raise result.exception()
        text = TurnText(sessions.tokenizer, call, sessions.parser)

        async def stream():
            item = first
            size = item.prompt_tokens if item is not None else len(result.result().prompt_ids)
            events = writer.start(size)
            while item is not None:
                events += writer.pieces(text.feed(item))
                yield _sse(events)
                events, item = [], await _next(grown, result)
            try:
                answered = result.result()
            except RequestError as exc:
                yield _sse(events + writer.error(exc))
                return
            yield _sse(events + writer.finish(answered, text.finish(answered.answer)))
            if writer.done:
                yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def chat(request: Request, session: str | None = None):
        try:
            out = await called(request, session, lambda b: (fields.chat(b), None),
                               lambda c, _, b: openai_chat.ChatStream(model, piece, c))  # fmt: skip
        except RequestError as exc:
            return error(exc)
        if isinstance(out, StreamingResponse):
            return out
        return openai_chat.chat_body(out[2], model, piece)

    async def completions(request: Request, session: str | None = None):
        try:
            out = await called(request, session, lambda b: (fields.completion(b), None),
                               lambda c, _, b: openai_chat.CompletionStream(model, piece, c))  # fmt: skip
        except RequestError as exc:
            return error(exc)
        if isinstance(out, StreamingResponse):
            return out
        return openai_chat.completion_body(out[2], model, piece)

    async def respond(request: Request, session: str | None = None):
        try:
            out = await called(request, session, responses.call, lambda c, kept, b:
                               openai_responses.ResponseStream(responses, model, kept, b, piece))  # fmt: skip
        except RequestError as exc:
            return error(exc)
        if isinstance(out, StreamingResponse):
            return out
        body, messages, result = out
        return responses.body(result, model, messages, body, piece)

    async def messages(request: Request, session: str | None = None):
        try:
            out = await called(request, session,
                               lambda b: (anthropic_messages.call_of(b, fields), None),
                               lambda c, _, b: anthropic_messages.MessageStream(model))  # fmt: skip
        except RequestError as exc:
            return error(exc, request.url.path)
        if isinstance(out, StreamingResponse):
            return out
        return anthropic_messages.message_body(out[2], model)

    async def count_tokens(request: Request, session: str | None = None):
        path = request.url.path
        try:
            body = await read_body(request)
            if isinstance(body, dict):
                body = {**body, "max_tokens": 1}
            call = anthropic_messages.call_of(body, fields)
            ids = sessions.conversation("count_tokens").first(call.messages, call.tools,
                                                              call.chat_template_kwargs)  # fmt: skip
        except RequestError as exc:
            return error(exc, path)
        return {"input_tokens": len(ids)}

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
        or fail it with ``error`` (the agent could not finish)."""
        try:
            body = await read_body(request)
        except RequestError as exc:
            return error(exc)
        if not isinstance(body, dict) or not ("reward" in body or "error" in body):
            return error(RequestError(400, 'the body is {"reward": number, ...} or '
                                      '{"error": "why the agent failed"}', "reward"))  # fmt: skip
        try:
            await asyncio.wrap_future(sessions.end(session, body))
        except RequestError as exc:
            return error(exc)
        return {"session_id": session, "ended": True}

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/sessions", claim, methods=["POST"])
    app.add_api_route("/v1/sessions/{session}/reward", reward, methods=["POST"])
    for prefix in ("", "/sessions/{session}"):
        app.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])
        app.add_api_route(prefix + "/v1/models/{name:path}", one_model, methods=["GET"])
        app.add_api_route(f"{prefix}/v1/chat/completions", chat, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/responses", respond, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/messages", messages, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/messages/count_tokens", count_tokens, methods=["POST"])
    return app


def _sse(events: list[tuple[str | None, dict[str, Any]]]) -> str:
    """Server-sent events: ``event:`` where the API names them, and the data."""
    return "".join((f"event: {name}\n" if name else "") + f"data: {json.dumps(data)}\n\n"
                   for name, data in events)  # fmt: skip


async def _next(grown: asyncio.Queue, result: asyncio.Future) -> Progress | None:
    """The turn's growth since the last call (every report queued, as one), or None once
    its answer (or refusal) came: growth reported after that is in the answer."""
    reports = []
    if grown.empty():
        if result.done():
            return None
        getter = asyncio.ensure_future(grown.get())
        await asyncio.wait({getter, result}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            return None
        reports.append(getter.result())
    while not grown.empty():
        reports.append(grown.get_nowait())
    last = reports[-1]
    return Progress([t for p in reports for t in p.tokens], last.prompt_tokens, last.thinking)


def _too_large(size: int, limit: int) -> RequestError:
    return RequestError(413, f"the request has {size} bytes, more than gateway.max_request_mb "
                        f"allows ({limit})", kind="invalid_request_error")  # fmt: skip


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
