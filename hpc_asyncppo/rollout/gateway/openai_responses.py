"""The Responses door: ``POST /v1/responses``, what the OpenAI Agents SDK sends by default.

In: ``input`` (a string, or items: messages with text parts, ``function_call`` items as
the model's earlier calls, ``function_call_output`` items as their results; ``reasoning``
items are skipped, the model's reasoning is not part of what a later call repeats),
``instructions`` (a system message first), function ``tools`` (flat:
``{type: function, name, parameters}``), ``tool_choice``, ``parallel_tool_calls``,
``max_output_tokens``, ``text.format`` (a constraint not applied, said so), ``include:
["message.output_text.logprobs"]`` with ``top_logprobs`` (the turn's tokens' log-probs on
the message's text, as Chat Completions gives them), sampling fields
as every door takes them (``requests.py``), ``stream``. These become the chat messages and
fields of a ``Call``, so a stateless SDK that sends the whole input again each time
extends its session's conversation as a chat client does. ``previous_response_id``: the
input is appended to that response's conversation (this door keeps the last responses'
conversations, ``STORED`` of them per rank).

Out: a ``response`` object (``output``: a ``reasoning`` item for ``<think>`` text, a
``message`` item with the text, a ``function_call`` item per call, ids the session makes;
``status`` incomplete with ``max_output_tokens`` where the turn ended with "length"), or
with ``stream: true`` the Responses streaming events as the turn grows (``ResponseStream``),
ending with ``response.completed``.
The exact tokens are under ``hpc_asyncppo``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from hpc_asyncppo.rollout.gateway import openai_chat
from hpc_asyncppo.rollout.gateway.chat import openai_message
from hpc_asyncppo.rollout.gateway.requests import Call, Fields, RequestError, function_tool
from hpc_asyncppo.rollout.gateway.sessions import Result
from hpc_asyncppo.rollout.gateway.streaming import CONTENT, REASONING

STORED = 1024  # conversations kept for previous_response_id, per rank
# the Responses fields read here; the rest go through the chat table as they are
_READ = {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "text",
         "previous_response_id"}  # fmt: skip
_NO_OP = {"include", "store", "reasoning", "truncation", "background", "max_tool_calls",
          "conversation", "prompt"}  # fmt: skip


class ResponsesDoor:
    """Requests in, answers out; keeps the last ``STORED`` responses' conversations."""

    def __init__(self, fields: Fields):
        self.fields = fields
        self.stored: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self.lock = threading.Lock()

    def call(self, body: Any) -> tuple[Call, list[dict[str, Any]]]:
        """The ``Call``, and the conversation in chat messages (kept with the answer)."""
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        messages: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            with self.lock:
                known = self.stored.get(previous)
            if known is None:
                raise RequestError(400, f"previous_response_id {previous!r} is not one of the "
                                   f"last {STORED} responses of this rank: send the whole "
                                   "input", "previous_response_id")  # fmt: skip
            messages = [dict(m) for m in known]
        elif body.get("instructions"):
            messages.append({"role": "system", "content": _text(body["instructions"],
                                                                "instructions")})  # fmt: skip
        messages += input_messages(body.get("input"))
        chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _READ | _NO_OP}
        chat["messages"] = messages
        chat["tools"] = _tools(body.get("tools"))
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        include = body.get("include")
        if isinstance(include, list) and "message.output_text.logprobs" in include:
            chat["logprobs"] = True  # and top_logprobs, as the body has it
        call = self.fields.chat(chat)
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            call.not_applied.append("text.format")
        return call, messages

    def body(self, result: Result, model: str, messages: list[dict[str, Any]],
             request: dict[str, Any], piece: Any, rid: str | None = None,
             ids: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        """The ``response`` object; its conversation is kept for previous_response_id.
        ``piece``: a token id's text; ``rid``, ``ids``: the response's id and its items'
        (a stream made them first)."""
        rid = rid or new_id("resp")
        with self.lock:
            self.stored[rid] = [*messages, openai_message(result.answer.message)]
            while len(self.stored) > STORED:
                self.stored.popitem(last=False)
        incomplete = result.answer.finish_reason == "length"
        out = skeleton(rid, model, request)
        out.update({
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output_items(result, ids or {}, piece),
            "usage": {
                "input_tokens": len(result.prompt_ids),
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": len(result.token_ids),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(result.prompt_ids) + len(result.token_ids),
            },
            "hpc_asyncppo": exact(result),
        })  # fmt: skip
        return out


def new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def skeleton(rid: str, model: str, request: dict[str, Any]) -> dict[str, Any]:
    """A ``response`` as it stands before its turn: in progress, no output."""
    return {
        "id": rid, "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "incomplete_details": None, "error": None, "model": model,
        "output": [], "instructions": request.get("instructions"),
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "max_output_tokens": request.get("max_output_tokens"),
        "previous_response_id": request.get("previous_response_id"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "metadata": request.get("metadata") or {}, "store": False, "usage": None,
    }  # fmt: skip


def exact(result: Result) -> dict[str, Any]:
    """The exact tokens (and what was not done as asked), for the doors whose API has no
    place for them."""
    notes = result.notes()
    return {"session_id": result.session, "prompt_token_ids": result.prompt_ids,
            "token_ids": result.token_ids, "token_logprobs": result.log_probs,
            "token_versions": result.versions, "stop_sequence": result.answer.stop_sequence,
            **notes}  # fmt: skip


def output_items(result: Result, ids: dict[str, str], piece: Any = None) -> list[dict[str, Any]]:
    """The answer's items: its reasoning, its message (text, or none beside tool calls),
    a function call per call. ``ids``: those already made for the reasoning and message.
    ``piece`` (a token id's text): with ``include: ["message.output_text.logprobs"]``, the
    turn's tokens' log-probs (and ``top_logprobs``) on the text."""
    a, items = result.answer, []
    logprobs = (openai_chat.logprobs(result, piece, chat=True) or {}).get("content", [])
    if a.reasoning:
        items.append({"type": "reasoning", "id": ids.get(REASONING) or new_id("rs"),
                      "summary": [], "content": [{"type": "reasoning_text", "text": a.reasoning}]})  # fmt: skip
    if a.message.get("content") or not a.message.get("tool_calls"):
        items.append({"type": "message", "id": ids.get(CONTENT) or new_id("msg"),
                      "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": a.message.get("content") or "",
                                   "annotations": [], "logprobs": logprobs}]})  # fmt: skip
    for c in a.message.get("tool_calls", []):
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": c["id"],
                      "name": c["name"], "arguments": json.dumps(c["arguments"]),
                      "status": "completed"})  # fmt: skip
    return items


class ResponseStream:
    """A streamed response: ``response.created``, then the reasoning item and the message
    item opened as their text comes (``response.reasoning_text.delta``,
    ``response.output_text.delta``), each done when the next begins or the turn ends, the
    function calls, then ``response.completed`` (or ``response.incomplete``) with the
    whole response."""

    done = False  # the stream ends with its last event

    def __init__(self, door: ResponsesDoor, model: str, messages: list[dict[str, Any]],
                 request: dict[str, Any], piece: Any):  # fmt: skip
        self.door, self.model, self.messages, self.request = door, model, messages, request
        self.piece = piece
        self.rid = new_id("resp")
        self.sent = 0
        self.items: list[tuple[str, str]] = []  # (kind, id) of the items opened
        self.open: str | None = None  # the kind of the item open now
        self.text = ""  # the open item's text so far

    def _emit(self, kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        self.sent += 1
        return kind, {"type": kind, "sequence_number": self.sent - 1, **data}

    def start(self, prompt_tokens: int) -> list[tuple[str, dict[str, Any]]]:
        started = skeleton(self.rid, self.model, self.request)
        return [self._emit("response.created", response=started),
                self._emit("response.in_progress", response=started)]  # fmt: skip

    def pieces(self, pieces: list[tuple[str, str]]) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for kind, text in pieces:
            if self.open != kind:
                out += self._close()
                out += self._open(kind)
            self.text += text
            where = {"item_id": self.items[-1][1], "output_index": len(self.items) - 1,
                     "content_index": 0}  # fmt: skip
            name = "reasoning_text" if kind == REASONING else "output_text"
            extra = {} if kind == REASONING else {"logprobs": []}
            out.append(self._emit(f"response.{name}.delta", **where, delta=text, **extra))
        return out

    def _open(self, kind: str, rid: str | None = None) -> list[tuple[str, dict[str, Any]]]:
        rid = rid or new_id("rs" if kind == REASONING else "msg")
        self.items.append((kind, rid))
        self.open, self.text = kind, ""
        index = len(self.items) - 1
        if kind == REASONING:
            item = {"type": "reasoning", "id": rid, "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": rid, "status": "in_progress", "role": "assistant",
                    "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._emit("response.output_item.added", output_index=index, item=item),
                self._emit("response.content_part.added", item_id=rid, output_index=index,
                           content_index=0, part=part)]  # fmt: skip

    def _close(self, item: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
        """The open item done: with ``item`` (the response's), as the answer has it."""
        if self.open is None:
            return []
        kind, rid = self.items[-1]
        index = len(self.items) - 1
        where = {"item_id": rid, "output_index": index, "content_index": 0}
        if kind == REASONING:
            part = {"type": "reasoning_text", "text": self.text}
            item = item or {"type": "reasoning", "id": rid, "summary": [], "content": [part]}
            done = [self._emit("response.reasoning_text.done", **where, text=self.text)]
        else:
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            item = item or {"type": "message", "id": rid, "status": "completed",
                            "role": "assistant", "content": [part]}  # fmt: skip
            done = [self._emit("response.output_text.done", **where, text=self.text,
                               logprobs=[])]  # fmt: skip
        self.open = None
        return [
            *done,
            self._emit("response.content_part.done", **where, part=part),
            self._emit("response.output_item.done", output_index=index, item=item),
        ]

    def finish(self, result: Result, rest: list[tuple[str, str]]
               ) -> list[tuple[str, dict[str, Any]]]:  # fmt: skip
        out = self.pieces(rest)
        opened = dict(self.items)
        response = self.door.body(result, self.model, self.messages, self.request, self.piece,
                                  self.rid, opened)  # fmt: skip
        by_id = {item["id"]: item for item in response["output"]}
        if self.open is not None:
            out += self._close(by_id.get(self.items[-1][1]))
        for index, item in enumerate(response["output"]):
            if item["id"] in opened.values():
                continue
            where = {"item_id": item["id"], "output_index": index}
            if item["type"] == "message":  # no text streamed: the message, whole
                out += self._open(CONTENT, item["id"])
                self.text = item["content"][0]["text"]
                out.append(self._emit("response.output_text.delta", **where, content_index=0,
                                      delta=self.text, logprobs=[]))  # fmt: skip
                out += self._close(item)
            elif item["type"] == "function_call":
                out.append(self._emit("response.output_item.added", output_index=index,
                                      item={**item, "status": "in_progress",
                                            "arguments": ""}))  # fmt: skip
                out.append(self._emit("response.function_call_arguments.delta", **where,
                                      delta=item["arguments"]))  # fmt: skip
                out.append(self._emit("response.function_call_arguments.done", **where,
                                      arguments=item["arguments"], name=item["name"]))  # fmt: skip
                out.append(self._emit("response.output_item.done", output_index=index,
                                      item=item))  # fmt: skip
            else:
                out.append(self._emit("response.output_item.added", output_index=index,
                                      item=item))  # fmt: skip
                out.append(self._emit("response.output_item.done", output_index=index,
                                      item=item))  # fmt: skip
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        out.append(self._emit(done, response=response))
        return out

    def error(self, exc: RequestError) -> list[tuple[str, dict[str, Any]]]:
        body = exc.body()["error"]
        return [self._emit("error", code=body["code"] or body["type"], message=body["message"],
                           param=body["param"])]  # fmt: skip


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Responses input as chat messages: the model's earlier ``function_call`` items join
    the assistant message before them (as one turn's calls), their outputs are tool
    messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestError(400, "input must be a string or a list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(400, f"{where}: an item is an object", "input")
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(400, f"{where}: role must be user, assistant, system or "
                                   "developer", "input")  # fmt: skip
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the same turn's
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise RequestError(400, f"{where}: items of type {kind!r} are not served here "
                               "(messages, function_call, function_call_output)", "input")  # fmt: skip
    return out


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in
                    ("input_text", "output_text", "text", "summary_text")):  # fmt: skip
                raise RequestError(400, f"{where}: only text content parts are served",
                                   "input")  # fmt: skip
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestError(400, f"{where}: content must be a string or a list of text parts",
                       "input")  # fmt: skip


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise RequestError(400, "tools must be a list", "tools")
    out = []
    for t in tools:
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(
                t.get("name"), str)):  # fmt: skip
            raise RequestError(400, "tools: only function tools ({type: function, name, "
                               "parameters}) are served here", "tools")  # fmt: skip
        out.append(function_tool(t["name"], t.get("parameters"), t.get("description")))
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice
