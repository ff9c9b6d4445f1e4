"""The gateway's tool parsers (``gateway.tool_parser``) on turns written as the models of
each format write them (the formats of vLLM's parsers of the same names): the calls read
in order, the content around them, a block that cannot be read left to the agent as text;
a required call's opening, named or not, as the start of a turn each parser reads back;
``auto`` from the chat template's markers."""

from __future__ import annotations

import pytest

from hpc_asyncppo.tools.hermes import ToolCall
from hpc_asyncppo.tools.tool_parsers import PARSERS, tool_parser

LOOKUP = ToolCall("lookup", {})
SEARCH = ToolCall("search", {"q": "x"})

# fmt: off
TURNS = {
    "hermes": [
        ('Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>\n'
         '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>',
         "Let me look.", [LOOKUP, SEARCH]),
        ("The answer is 7.", "The answer is 7.", []),
        ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ],
    "llama3_json": [
        ('{"name": "lookup", "parameters": {}}; {"name": "search", "parameters": {"q": "x"}}',
         "", [LOOKUP, SEARCH]),
        ('<|python_tag|>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}', "", [SEARCH]),
        ("The answer is 7.", "The answer is 7.", []),
        ('{"answer": 7}', '{"answer": 7}', []),  # JSON, but not a call: content
    ],
    "mistral": [
        ('Sure.[TOOL_CALLS][{"name": "lookup", "arguments": {}}, '
         '{"name": "search", "arguments": {"q": "x"}}]', "Sure.", [LOOKUP, SEARCH]),
        ('[TOOL_CALLS]lookup[ARGS]{}[TOOL_CALLS]search[ARGS]{"q": "x"}', "", [LOOKUP, SEARCH]),
        ("The answer is 7.", "The answer is 7.", []),
        ("[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ],
}
# the rest of a call after each parser's opening, named (the arguments on) or not
RESTS = {
    "hermes": ('\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>', '{"q": "x"}}\n</tool_call>'),
    "llama3_json": ('search", "parameters": {"q": "x"}}', '{"q": "x"}}'),
    "mistral": ('[{"name": "search", "arguments": {"q": "x"}}]', '{"q": "x"}}]'),
}
# fmt: on


@pytest.mark.parametrize("name", sorted(TURNS))
def test_each_parser_reads_the_calls_and_leaves_the_content(name):
    for text, content, calls in TURNS[name]:
        assert PARSERS[name].parse(text) == (content, calls), text


@pytest.mark.parametrize("name", sorted(TURNS))
def test_a_required_calls_opening_starts_a_turn_its_parser_reads(name):
    """``tool_choice`` required: the opening then what the model writes is that call;
    named: the opening carries the name, and the model writes the arguments on."""
    parser = PARSERS[name]
    rest, named_rest = RESTS[name]
    assert parser.parse(parser.opening + rest)[1] == [SEARCH]
    assert parser.parse(parser.named("search") + named_rest)[1] == [SEARCH]
    assert parser.before_call(parser.opening + rest) == ""  # nothing of it streamed


def test_auto_picks_the_parser_from_the_chat_templates_markers():
    assert tool_parser("auto", "{{ '[TOOL_CALLS]' + tool_calls | tojson }}").name == "mistral"
    assert tool_parser("auto", "{{ '<|python_tag|>' }}{{ message.content }}").name == "llama3_json"
    assert tool_parser("auto", "<tool_call>\n{{ tool_call | tojson }}").name == "hermes"
    assert tool_parser("auto", None).name == "hermes"
    assert tool_parser("mistral", "<tool_call>").name == "mistral"  # a name is taken as given
