"""Tool calls in a model's text, in the formats vLLM's parsers of the same names read
(``gateway.tool_parser``): each parser takes the text of a model's turn and gives back its
content (the text around the calls) and the calls, in order.

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks (``hermes.py``, which the project's own multi-turn reads too);
- ``llama3_json`` (Llama 3.1-3.3): the turn is one or more JSON objects ``{"name": ...,
  "parameters": {...}}`` (or ``"arguments"``), separated by ``;``, optionally after
  ``<|python_tag|>``; a turn that does not start with one is content;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (the content
  is the text before it), or the newer ``[TOOL_CALLS]name[ARGS]{...}`` form.

``opening`` is the text a turn starts with when a call is required (``tool_choice``
required), ``named(name)`` when that function's call is (a named ``tool_choice``): the
gateway puts it at the turn's start, as context, and the model writes the rest. ``before_call`` is what of a turn's text so far is surely content, the
text before where a call could begin (what a streamed answer may send before the turn
ends). ``auto`` picks the parser from the markers the model's chat template
writes. A block that cannot be read stays in the content: the agent sees what the model
wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from hpc_asyncppo.tools.hermes import BLOCK, ToolCall, parse_tool_calls


@dataclass(frozen=True)
class ToolParser:
    name: str
    parse: Callable[[str], tuple[str, list[ToolCall]]]
    opening: str  # what a required call's turn starts with
    before_call: Callable[[str], str]  # a turn's text so far: what is surely content
    named: Callable[[str], str]  # what a turn required to call this function starts with


def held_before(marker: str) -> Callable[[str], str]:
    """The text before ``marker``, or, with none yet, all but an end that may begin it."""

    def before(text: str) -> str:
        at = text.find(marker)
        if at >= 0:
            return text[:at]
        return text[: len(text) - _partial(text, marker)]

    return before


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                 if marker.startswith(text[-k:])), 0)  # fmt: skip


def _hermes(text: str) -> tuple[str, list[ToolCall]]:
    calls = parse_tool_calls(text).calls
    if not calls:
        return text.strip(), []
    return BLOCK.sub("", text).strip(), calls


def _call_of(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], arguments) if isinstance(arguments, dict) else None


def _llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].lstrip()
    if not body.startswith("{"):
        return text.strip(), []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text.strip(), []
        call = _call_of(obj)
        if call is None:
            return text.strip(), []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return "", calls


def _llama3_before_call(text: str) -> str:
    """A turn is calls or content, from its start: content once it starts otherwise."""
    body = text.lstrip()
    tag = "<|python_tag|>"
    if not body or body.startswith(("{", tag)) or tag.startswith(body):
        return ""
    return text


_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_\-.]+)\[ARGS\]")


def _mistral(text: str) -> tuple[str, list[ToolCall]]:
    if "[TOOL_CALLS]" not in text:
        return text.strip(), []
    content, _, rest = text.partition("[TOOL_CALLS]")
    rest = rest.strip()
    calls: list[ToolCall] = []
    if rest.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
        try:
            objs, _ = json.JSONDecoder().raw_decode(rest)
        except json.JSONDecodeError:
            return text.strip(), []
        calls = [c for c in map(_call_of, objs if isinstance(objs, list) else []) if c]
    else:  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        for part in rest.split("[TOOL_CALLS]"):
            m = _MISTRAL_NAMED.match(part.strip())
            if m is None:
                continue
            try:
                arguments, _ = json.JSONDecoder().raw_decode(part.strip()[m.end() :])
            except json.JSONDecodeError:
                continue
            if isinstance(arguments, dict):
                calls.append(ToolCall(m.group(1), arguments))
    if not calls:
        return text.strip(), []
    return content.strip(), calls


PARSERS = {
    "hermes": ToolParser(
        "hermes",
        _hermes,
        "<tool_call>",
        held_before("<tool_call>"),
        lambda name: f'<tool_call>\n{{"name": "{name}", "arguments": ',
    ),
    "llama3_json": ToolParser(
        "llama3_json",
        _llama3_json,
        '{"name": "',
        _llama3_before_call,
        lambda name: f'{{"name": "{name}", "parameters": ',
    ),
    "mistral": ToolParser(
        "mistral",
        _mistral,
        "[TOOL_CALLS]",
        held_before("[TOOL_CALLS]"),
        lambda name: f'[TOOL_CALLS][{{"name": "{name}", "arguments": ',
    ),
}


def tool_parser(name: str, chat_template: str | None) -> ToolParser:
    """``gateway.tool_parser``: a parser by name, or ``auto``: the one whose markers the
    chat template writes (hermes when it writes none)."""
    if name != "auto":
        return PARSERS[name]
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return PARSERS["mistral"]
    if "<|python_tag|>" in template or ("<|eom_id|>" in template and "parameters" in template):
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]
