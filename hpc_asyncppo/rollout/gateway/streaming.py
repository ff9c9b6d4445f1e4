"""Answers streamed as the engine makes them (``stream: true`` on every door).

The rank's loop tells a streamed call its turn's new tokens after every engine step that
made some (``Progress``, through ``Sessions.post``'s ``progress``); the door sends what of
the turn's text so far is sure to stay as the answer will have it (``TurnText``): the
reasoning of a ``<think>`` block as it grows, then the content. Held back until it is
sure: the text from where a tool call may begin (``ToolParser.before_call``), an end that
may begin one of the call's stop strings or ``</think>``, whitespace at the end (the answer
strips it), a character whose bytes have not all come. Tool calls are sent whole when the
turn ends; the exact tokens, log-probs and usage come with the last event. The streamed
pieces put together are the answer's text without streaming.

How often pieces come is the engine's step: vLLM's is one token of every request; the hf
engine's is a whole turn by default, ``rollout.hf_step_tokens`` tokens with continuous
batching.

What it keeps per streamed call: the turn's tokens so far and the text sent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hpc_asyncppo.rollout.gateway.chat import Answer, split_reasoning
from hpc_asyncppo.rollout.gateway.requests import Call
from hpc_asyncppo.tools.tool_parsers import PARSERS, ToolParser, held_before

log = logging.getLogger(__name__)

REASONING, CONTENT = "reasoning", "content"


@dataclass
class Progress:
    """A streamed call's turn grew: its new tokens since the last report, the length of
    the context before the turn, and whether the chat template opened a ``<think>`` block
    at its end (``chat.opened_thinking``)."""

    tokens: list[int]
    prompt_tokens: int
    thinking: bool


class TurnText:
    """One streamed call's turn: what of its text may be sent, piece by piece."""

    def __init__(self, tokenizer: Any, call: Call, parser: ToolParser = PARSERS["hermes"]):
        self.tokenizer, self.call, self.parser = tokenizer, call, parser
        self.tokens: list[int] = []
        self.thinking = False
        self.sent = {REASONING: "", CONTENT: ""}
        self.diverged = False

    def feed(self, progress: Progress) -> list[tuple[str, str]]:
        """The pieces the new tokens make sure: ``(REASONING or CONTENT, text)``."""
        self.tokens += progress.tokens
        self.thinking = progress.thinking
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return self._send(*self._sure(text))

    def finish(self, answer: Answer) -> list[tuple[str, str]]:
        """The rest of the answer's reasoning and content, after what was sent."""
        content = answer.text if self.call.kind != "chat" else answer.message.get("content")
        pieces = self._send(answer.reasoning, content or "")
        if self.diverged:
            log.warning("a streamed answer's pieces differ from its text at the end: the "
                        "last piece is the text after what was sent")  # fmt: skip
        return pieces

    def _sure(self, text: str) -> tuple[str, str]:
        """The reasoning and content of ``text`` that more tokens will not change."""
        text = self._before_stop(text).rstrip("\ufffd")
        if self.call.kind != "chat":
            return "", text
        start = text.lstrip()
        if "</think>" in text or self.thinking or start.startswith("<think>"):
            reasoning, said = split_reasoning(text, opened=True)
            if "</think>" not in text:
                return held_before("</think>")(reasoning).strip(), ""
            reasoning = reasoning.strip()
        elif "<think>".startswith(start):  # the turn may open a block: nothing sure yet
            return "", ""
        else:
            reasoning, said = "", text
        if self.call.tools and self.call.tool_choice != "none":
            said = self.parser.before_call(said)
        return reasoning, said.strip()

    def _before_stop(self, text: str) -> str:
        """The text up to the call's first stop string, held back where one may begin."""
        stops = self.call.stop
        if not stops:
            return text
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            at, stop = min(hits)
            return text[: at + (len(stop) if self.call.include_stop else 0)]
        return min((held_before(s)(text) for s in stops), key=len)

    def _send(self, reasoning: str, content: str) -> list[tuple[str, str]]:
        pieces = []
        for kind, text in ((REASONING, reasoning), (CONTENT, content)):
            sent = self.sent[kind]
            if not text.startswith(sent):
                self.diverged = True
                continue
            if len(text) > len(sent):
                pieces.append((kind, text[len(sent) :]))
                self.sent[kind] = text
        return pieces
