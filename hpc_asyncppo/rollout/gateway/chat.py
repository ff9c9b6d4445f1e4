"""A session's conversation and its exact tokens.

The gateway owns the chat template. A session's first call is rendered whole (its
messages and ``tools`` through the model's template, with the generation prompt): those
are the sequence's prompt tokens. From then on nothing the model wrote is tokenized
again: the model's turn is kept as the engine sampled it (ids, log-probs, the weights
version of each token), and a later call must *extend* the conversation: its messages
start with every message so far, the model's own answers exactly as the gateway returned
them, and go on with tool or user messages only. Only those appended messages are
tokenized (``rollout/turns.py`` ``messages_after_turn``: what the template writes after
an assistant turn, the messages, the next generation prompt), and they are observation
tokens: context, loss mask 0, never trained, as the project's own tool answers are.

Where the model wrote a tool call (hermes, ``<tool_call>{json}</tool_call>``, which the
model's turn ends at), the answer carries it as OpenAI ``tool_calls`` with ids the
session makes (``call_{session}_{turn}_{k}``): the same in every run of a deterministic
agent. A call that does not extend (history rewritten, summarised, branched, other
tools, an assistant message the model did not write) raises ``NotExtending``: the
session goes on in a new sequence, its conversation rendered whole again
(``sessions.py``; ``README.md``, "Bring your own agent").

Plain completions (``/v1/completions``) follow the same rule on text: a later prompt
must start with the previous prompt and completion; the text after them is the
observation.

What it keeps per session: the messages so far (or the text so far) and the tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hpc_asyncppo.rollout.gateway.requests import Call, RequestError
from hpc_asyncppo.rollout.turns import messages_after_turn
from hpc_asyncppo.tools.tool_parsers import PARSERS, ToolParser

OBSERVED_ROLES = ("user", "tool", "system", "developer")  # what may follow the model's turn


class NotExtending(RequestError):
    """A call whose messages do not extend the session's conversation: a new sequence."""


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized messages as chat templates take them (Qwen2.5's: a tool call's arguments
    a mapping, under ``function``)."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if k != "tool_calls"}
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in m["tool_calls"]
            ]  # fmt: skip
        out.append(msg)
    return out


def openai_message(message: dict[str, Any]) -> dict[str, Any]:
    """A normalized assistant message as OpenAI's answer carries it."""
    out: dict[str, Any] = {"role": "assistant", "content": message["content"] or None}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for c in message["tool_calls"]
        ]  # fmt: skip
    return out


@dataclass
class Answer:
    """The model's turn, as the gateway answers a call with it."""

    message: dict[str, Any]  # normalized (what the next call must repeat)
    text: str  # the turn's text (completions: the completion)
    finish_reason: str  # stop | length | tool_calls
    reasoning: str = ""  # the turn's <think> text (returned as reasoning_content)
    stop_sequence: str | None = None  # the call's stop string the turn ended at


@dataclass
class Conversation:
    """One session's sequence: the messages so far (the model's answers as returned), or
    for completions the text so far. ``tokenizer``: the model's (its chat template);
    ``parser``: how the model writes tool calls (``gateway.tool_parser``)."""

    tokenizer: Any
    session: str
    parser: ToolParser = PARSERS["hermes"]
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    text: str | None = None  # completions: the prompt and completions so far
    turns: int = 0

    # --- a call in --------------------------------------------------------------------------
    def first(self, messages: list[dict[str, Any]], tools: list[dict] | None,
              template_kwargs: dict[str, Any] | None = None) -> list[int]:  # fmt: skip
        """The first call: its prompt tokens (messages and tools through the template)."""
        self.messages, self.tools = list(messages), tools
        self.template_kwargs = dict(template_kwargs or {})
        extra = {"tools": tools} if tools else {}
        try:
            ids = self.tokenizer.apply_chat_template(
                for_template(messages), add_generation_prompt=True, tokenize=True, **extra,
                **self.template_kwargs,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the template's own complaint, as a 400
            raise RequestError(400, f"the model's chat template cannot render these messages: "
                               f"{exc}", "messages") from None  # fmt: skip
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def extend(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, after_eos: bool,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:  # fmt: skip
        """A later call: the observation tokens of the messages it appends. RequestError
        (400) when it does not extend the conversation."""
        known = len(self.messages)
        if self.text is not None:
            raise RequestError(400, f"session {self.session} is a completions session")
        if (tools or None) != (self.tools or None):
            raise NotExtending(400, self._not_extending("its tools differ from the first call's"))
        if dict(template_kwargs or {}) != self.template_kwargs:
            raise NotExtending(400, self._not_extending("its chat_template_kwargs differ"))
        if messages[:known] != self.messages:
            pairs = zip(messages, self.messages, strict=False)
            at = next((i for i, (a, b) in enumerate(pairs) if a != b), len(messages))
            why = f"message {at} differs from the one the session holds"
            raise NotExtending(400, self._not_extending(why))
        appended = messages[known:]
        if not appended:
            raise NotExtending(400, self._not_extending("no new message after the model's turn"))
        if any(m["role"] not in OBSERVED_ROLES for m in appended):
            raise NotExtending(400, self._not_extending("an assistant message the model did "
                                                        "not write"))  # fmt: skip
        self.messages = list(messages)
        return messages_after_turn(self.tokenizer, for_template(appended), after_eos,
                                   self.template_kwargs)  # fmt: skip

    def first_text(self, prompt: str) -> list[int]:
        self.text = prompt
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def extend_text(self, prompt: str) -> list[int]:
        if self.text is None:
            raise RequestError(400, f"session {self.session} is a chat session")
        if not prompt.startswith(self.text):
            raise NotExtending(
                400,
                self._not_extending(
                    "the prompt does not start with the previous prompt and completion"
                ),
            )
        appended, self.text = prompt[len(self.text) :], prompt
        return list(self.tokenizer(appended, add_special_tokens=False)["input_ids"])

    def _not_extending(self, why: str) -> str:
        return f"this call does not extend session {self.session}'s conversation ({why})"

    # --- the model's turn out -----------------------------------------------------------------
    def answer(self, tokens: list[int], cut: bool, room_left: bool,
               call: Call | None = None, thinking: bool = False) -> Answer:  # fmt: skip
        """The model's turn (its ``tokens``: sampled, after any opening the gateway put at
        its start) as an answer; the conversation takes it. ``cut``: the turn stopped at
        the room's end or the call's ``max_tokens``; ``room_left``: more tokens fit after
        it. The call's stop strings cut the text at the first (the engine ended the turn
        at the token that completed it); ``<think>`` text is the answer's reasoning; tool
        calls are read in the parser's format unless ``tool_choice`` is none. A tool call
        with no room left for its answer (cut, or ending exactly at the room's end) is
        shown, with "length". ``thinking``: the chat template opened a ``<think>`` block
        before the turn (``opened_thinking``)."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        stop_sequence = None
        if call is not None and call.stop:
            hits = [(text.find(s), s) for s in call.stop if s in text]
            if hits:
                at, stop_sequence = min(hits)
                text = text[: at + (len(stop_sequence) if call.include_stop else 0)]
                cut = False
        self.turns += 1
        finish = "length" if cut else "stop"
        if self.text is not None:
            self.text += text
            return Answer({"role": "assistant", "content": text}, text, finish,
                          stop_sequence=stop_sequence)  # fmt: skip
        reasoning, said = split_reasoning(text, thinking)
        content, calls = said.strip(), []
        if self.tools and (call is None or call.tool_choice != "none"):
            content, calls = self.parser.parse(said)
            if call is not None and not call.parallel_tool_calls:
                calls = calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{self.session}_{self.turns}_{k}", "name": c.name,
                 "arguments": c.arguments}
                for k, c in enumerate(calls)
            ]  # fmt: skip
            finish = "tool_calls" if room_left and not cut else "length"
        self.messages.append(message)
        return Answer(message, text, finish, reasoning.strip(), stop_sequence)


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """A turn's reasoning (``<think>...</think>``, or up to ``</think>`` where the chat
    template opened the block itself: ``opened``) and the rest. A block never closed (the
    turn cut while thinking) is all reasoning."""
    if "</think>" not in text:
        if opened or text.lstrip().startswith("<think>"):
            return text.replace("<think>", "", 1), ""
        return "", text
    thought, _, rest = text.partition("</think>")
    return thought.replace("<think>", "", 1), rest


def opened_thinking(tokenizer: Any, context: list[int]) -> bool:
    """The chat template opened a ``<think>`` block at the end of ``context`` (the model's
    turn starts inside it: Qwen3's thinking models, DeepSeek-R1)."""
    tail = tokenizer.decode(context[-8:], skip_special_tokens=False)
    return tail.rstrip().endswith("<think>")
