"""The Messages door: ``POST /v1/messages`` and ``/v1/messages/count_tokens``, Anthropic's
API as the ``anthropic`` SDK sends it.

In: ``system`` (a string or text blocks: a system message first), ``messages`` whose
content is a string or blocks (``text``; the model's ``tool_use`` blocks as its earlier
calls; a user turn's ``tool_result`` blocks as tool messages, before its text;
``thinking`` blocks are skipped), ``tools`` with ``input_schema``, ``tool_choice``
(``auto``, ``any``: a call required, ``tool``: that one, ``none``;
``disable_parallel_tool_use``), ``max_tokens``, ``stop_sequences``, sampling fields
(``temperature``, ``top_p``, ``top_k``: the run's own, as every door takes them),
``stream``. These become a chat ``Call`` (``requests.py``) on the same sessions.

Out: a ``message`` with content blocks (``thinking`` for ``<think>`` text, ``text``,
``tool_use`` per call with the session's ids), ``stop_reason`` (``end_turn``,
``tool_use``, ``max_tokens``, ``stop_sequence`` with the string), usage; with
``stream: true`` Anthropic's events as the turn grows (``MessageStream``: message_start,
content_block_start/delta/stop, message_delta, message_stop). The exact tokens are under ``hpc_asyncppo``. Errors come in
Anthropic's shape (``{"type": "error", "error": {...}}``: ``server.py``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from hpc_asyncppo.rollout.gateway.openai_responses import exact
from hpc_asyncppo.rollout.gateway.requests import Call, Fields, RequestError, function_tool
from hpc_asyncppo.rollout.gateway.sessions import Result
from hpc_asyncppo.rollout.gateway.streaming import REASONING

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
_READ = {"system", "messages", "tools", "tool_choice", "stop_sequences", "max_tokens"}
_NO_OP = {"thinking", "container", "mcp_servers", "context_management", "anthropic_version"}


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat messages."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: a non-empty list", "messages")
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError(400, f"{where}: a message is {{role: user | assistant, "
                               "content}}", "messages")  # fmt: skip
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(400, f"{where}.content: a string or a list of blocks", "messages")
        texts, calls, results = [], [], []
        for k, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": block.get("input") or {}}})  # fmt: skip
            elif kind == "tool_result" and m["role"] == "user":
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                "content": _text(block.get("content"), f"{where}.content.{k}")})  # fmt: skip
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise RequestError(400, f"{where}.content.{k}: blocks of type {kind!r} are not "
                                   "served here (text, tool_use, tool_result)", "messages")  # fmt: skip
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": "".join(texts) or None,
                        **({"tool_calls": calls} if calls else {})})  # fmt: skip
        else:
            out += results
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
    return out


def call_of(body: Any, fields: Fields) -> Call:
    """A Messages body as a ``Call``."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if not (isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool)):
        raise RequestError(400, "max_tokens: Field required (a positive integer)", "max_tokens")
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _READ | _NO_OP}
    chat["messages"] = chat_messages(body)
    chat["max_tokens"] = body["max_tokens"]
    chat["tools"] = _tools(body.get("tools"))
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool",
                                                                     "none"):  # fmt: skip
            raise RequestError(400, "tool_choice: {type: auto | any | tool | none}", "tool_choice")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice["type"], {"type": "function", "function": {"name": choice.get("name")}}
        )
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    return fields.chat(chat)


def message_body(result: Result, model: str) -> dict[str, Any]:
    a = result.answer
    content: list[dict[str, Any]] = []
    if a.reasoning:
        content.append({"type": "thinking", "thinking": a.reasoning, "signature": ""})
    if a.message.get("content"):
        content.append({"type": "text", "text": a.message["content"]})
    for c in a.message.get("tool_calls", []):
        content.append({"type": "tool_use", "id": c["id"], "name": c["name"],
                        "input": c["arguments"]})  # fmt: skip
    stop = "stop_sequence" if a.stop_sequence else STOP_REASONS[a.finish_reason]
    return {
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
        "model": model, "content": content, "stop_reason": stop,
        "stop_sequence": a.stop_sequence,
        "usage": {"input_tokens": len(result.prompt_ids), "output_tokens": len(result.token_ids),
                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        "hpc_asyncppo": exact(result),
    }  # fmt: skip


class MessageStream:
    """A streamed message, as Anthropic's events: ``message_start``, a thinking block and a
    text block opened as their text comes (``thinking_delta``, ``text_delta``), each
    stopped when the next begins or the turn ends, a ``tool_use`` block per call, then
    ``message_delta`` (the stop reason, usage, the exact tokens) and ``message_stop``."""

    done = False

    def __init__(self, model: str):
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex}"
        self.blocks: list[str] = []  # the kinds of the blocks opened, in order
        self.open = False

    def start(self, prompt_tokens: int) -> list[tuple[str, dict[str, Any]]]:
        start = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                 "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                           "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}  # fmt: skip
        return [("message_start", {"type": "message_start", "message": start})]

    def pieces(self, pieces: list[tuple[str, str]]) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for kind, text in pieces:
            if not self.open or self.blocks[-1] != kind:
                out += self._stop()
                self.blocks.append(kind)
                self.open = True
                block = ({"type": "thinking", "thinking": "", "signature": ""}
                         if kind == REASONING else {"type": "text", "text": ""})  # fmt: skip
                out.append(self._event("content_block_start", content_block=block))
            delta = ({"type": "thinking_delta", "thinking": text} if kind == REASONING
                     else {"type": "text_delta", "text": text})  # fmt: skip
            out.append(self._event("content_block_delta", delta=delta))
        return out

    def _event(self, kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "index": len(self.blocks) - 1, **data}

    def _stop(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.open:
            return []
        self.open = False
        return [self._event("content_block_stop")]

    def finish(self, result: Result, rest: list[tuple[str, str]]
               ) -> list[tuple[str, dict[str, Any]]]:  # fmt: skip
        out = self.pieces(rest)
        out += self._stop()
        message = message_body(result, self.model)
        for block in message["content"][len(self.blocks) :]:
            if block["type"] != "tool_use":
                continue
            self.blocks.append("tool_use")
            out.append(self._event("content_block_start", content_block={**block, "input": {}}))
            out.append(self._event("content_block_delta", delta={
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}))  # fmt: skip
            out.append(self._event("content_block_stop"))
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": message["stop_reason"],
                                                "stop_sequence": message["stop_sequence"]},
                                      "usage": {"output_tokens": message["usage"]["output_tokens"]},
                                      "hpc_asyncppo": message["hpc_asyncppo"]}))  # fmt: skip
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def error(self, exc: RequestError) -> list[tuple[str, dict[str, Any]]]:
        return [("error", exc.anthropic_body())]


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         for b in content):  # fmt: skip
        return "".join(str(b.get("text", "")) for b in content)
    raise RequestError(400, f"{where}: a string or a list of text blocks", "messages")


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise RequestError(400, "tools must be a list", "tools")
    out = []
    for k, t in enumerate(tools):
        if not (isinstance(t, dict) and isinstance(t.get("name"), str)
                and t.get("type", "custom") == "custom"):  # fmt: skip
            raise RequestError(400, f"tools.{k}: only client tools ({{name, description, "
                               "input_schema}}) are served here", "tools")  # fmt: skip
        out.append(function_tool(t["name"], t.get("input_schema"), t.get("description")))
    return out
