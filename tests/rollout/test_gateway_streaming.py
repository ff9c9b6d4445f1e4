"""What a streamed answer sends as the turn grows (``streaming.TurnText``): fed the turn's
tokens one engine step at a time, its pieces put together are the answer's reasoning and
content without streaming, nothing that may still turn out a tool call, a stop string or
a ``</think>`` is ever sent, and what is sure is sent before the turn ends. A word-level
tokenizer (``models/tiny.py``) makes each word a token, so every case is a sequence of
steps; the HTTP side (each door's events, a piece out while the engine is held) is in
``test_gateway_doors.py``."""

from __future__ import annotations

import pytest

from hpc_asyncppo.models.tiny import build_tokenizer
from hpc_asyncppo.rollout.gateway.chat import Conversation
from hpc_asyncppo.rollout.gateway.requests import Fields
from hpc_asyncppo.rollout.gateway.streaming import CONTENT, REASONING, Progress, TurnText
from hpc_asyncppo.tools.tool_parsers import PARSERS

CALL = '{"name":"lookup","arguments":{}}'
WORDS = ["Let", "me", "look", "<tool_call>", CALL, "</tool_call>", "<think>", "hmm", "more",
         "</think>", "7", "said", "Observation:", "[TOOL_CALLS]", f"[{CALL}]", '{"name":',
         '"lookup",', '"parameters":', "{}}", "The", "answer", "<|python_tag|>"]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
MESSAGES = [{"role": "user", "content": "question"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(WORDS)


# name: (parser, the turn's words, the call's fields, template opened <think>,
#        (reasoning, content) the answer has, the words after which content was sent)
# fmt: off
CASES = {
    "content then a hermes call": ("hermes", ["Let", "me", "look", "<tool_call>", CALL,
                                              "</tool_call>"], {"tools": TOOLS}, False,
                                   ("", "Let me look"), 1),
    "a llama3_json call": ("llama3_json", ['{"name":', '"lookup",', '"parameters":', "{}}"],
                           {"tools": TOOLS}, False, ("", ""), None),
    "llama3_json content": ("llama3_json", ["The", "answer", "7"], {"tools": TOOLS}, False,
                            ("", "The answer 7"), 1),
    "content then a mistral call": ("mistral", ["Let", "me", "[TOOL_CALLS]", f"[{CALL}]"],
                                    {"tools": TOOLS}, False, ("", "Let me"), 1),
    "a think block": ("hermes", ["<think>", "hmm", "more", "</think>", "7"], {}, False,
                      ("hmm more", "7"), 5),
    "a block the template opened": ("hermes", ["hmm", "</think>", "The", "answer"], {}, True,
                                    ("hmm", "The answer"), 3),
    "a block cut before its end": ("hermes", ["<think>", "hmm", "more"], {}, False,
                                   ("hmm more", ""), None),
    "a stop string of two words": ("hermes", ["said", "Observation:", "said", "7"],
                                   {"stop": ["Observation: said"]}, False, ("", "said"), 1),
    "tool_choice none": ("hermes", ["Let", "<tool_call>", CALL, "</tool_call>"],
                         {"tools": TOOLS, "tool_choice": "none"}, False,
                         ("", f"Let <tool_call> {CALL} </tool_call>"), 1),
}
# fmt: on


@pytest.mark.parametrize("name", CASES)
def test_the_pieces_streamed_are_the_answer_and_come_before_its_end(tokenizer, name):
    parser_name, words, fields, thinking, (reasoning, content), sure_after = CASES[name]
    call = Fields({"temperature": 1.0}).chat({"messages": MESSAGES, **fields})
    parser = PARSERS[parser_name]
    text = TurnText(tokenizer, call, parser)
    sent = {REASONING: "", CONTENT: ""}
    content_at = None
    for k, word in enumerate(words, start=1):
        for kind, piece in text.feed(Progress(tokenizer.convert_tokens_to_ids([word]), 5,
                                              thinking)):  # fmt: skip
            sent[kind] += piece
            if kind == CONTENT and content_at is None:
                content_at = k
        assert not any(m in sent[CONTENT] for m in ("<tool_call>", "[TOOL_CALLS]", '{"name"',
                                                     "Observation:", "</think>", "<think>")) \
            or call.tool_choice == "none", sent  # fmt: skip
        assert "</think>" not in sent[REASONING], sent
    ids = tokenizer.convert_tokens_to_ids(words)
    conversation = Conversation(tokenizer, "s", parser, tools=call.tools)
    answer = conversation.answer(ids, cut=False, room_left=True, call=call, thinking=thinking)
    for kind, piece in text.finish(answer):
        sent[kind] += piece
    assert (answer.reasoning, answer.message["content"]) == (reasoning, content)
    assert (sent[REASONING], sent[CONTENT]) == (reasoning, content)
    assert not text.diverged
    assert content_at == sure_after  # the first content went out as soon as it was sure


def test_a_completion_streams_its_text_up_to_a_stop_string(tokenizer):
    call = Fields({"temperature": 1.0}).completion({"prompt": "question", "stop": ["7"]})
    text = TurnText(tokenizer, call)
    sent = [p for w in ["said", "Observation:", "7", "said"]
            for _, p in text.feed(Progress(tokenizer.convert_tokens_to_ids([w]), 1, False))]  # fmt: skip
    assert sent == ["said", " Observation:", " "]
