"""Tool calls in the hermes format (Qwen2.5's): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks in the model's text. What cannot be read becomes an error
message for the model (its observation), never an exception."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class Parsed:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per block that could not be read


def parse_tool_calls(text: str) -> Parsed:
    """Every ``<tool_call>`` block of ``text``, in order."""
    parsed = Parsed()
    for block in BLOCK.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError as exc:
            parsed.errors.append(f"error: the tool call is not valid JSON ({exc.msg})")
            continue
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str):
            parsed.errors.append('error: a tool call needs {"name": ..., "arguments": {...}}')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            parsed.errors.append(f"error: the arguments of {name!r} must be a JSON object")
            continue
        parsed.calls.append(ToolCall(name, arguments))
    return parsed
