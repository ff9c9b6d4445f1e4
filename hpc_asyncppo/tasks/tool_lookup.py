"""The synthetic multi-turn task: the answer is held by a tool, and the model must call it
and copy the answer from its observation (``data.task=tool_lookup`` with
``rollout.multi_turn.enable=true rollout.multi_turn.tool_config_path=tools/lookup.yaml``).

Prompt: ``question`` and 2-4 random digits and ``=``; none of it says the answer, a digit
drawn apart for each prompt. The ``lookup`` tool (``LookupTool``) knows it: the prompt's
``tools_kwargs`` give it to ``create``. A trajectory that solves it, in the tiny model's
words (its chat template renders the tool's answer, ``CHAT_TEMPLATE``)::

    question 3 9 =  |  <tool_call> {"name":"lookup","arguments":{}}</tool_call>
                       <eos> <tool_response> 7                       (observation: not trained)
                       7 <eos>

(the model's turn stops at the call's end, and the template's EOS after an assistant
message comes with the observation).

The template has no closing mark after the tool's answer: the model answers from the
token it stands on, which a 2-layer model learns in a few dozen steps; with
``T </tool_response>`` between (copying from two tokens back) the same run took 500
steps to start copying (BENCHMARKS.md, "Multi-turn tool task").

Reward: the task's (``reward``) and the tool's (``LookupTool.reward``), added by the
rollout rank. The task gives 0.8 for the right answer right after the tool's answer (the
words ``<tool_response> T T``: the model can write ``<tool_response>`` itself, but it
would have to guess T twice), and 0.1 times the share of the call's two words at the
start of the response, in order; the tool gives 0.1 to a trajectory that called it once. The last
two are shaping for a randomly initialised model, which would otherwise have to find the
two-word call by chance (about 1 in 400 per response) before any reward told it
anything: they lift it from the start, as the next-digit task's per-position credit does.
An untrained model scores about 0.01; one that calls the tool and copies its answer, 1.

The tiny model's vocabulary holds the call's JSON and its end as one word (a turn stops
at any token ending with ``</tool_call>``): a real model writes
``<tool_call>\\n{"name": "lookup", ...}\\n</tool_call>`` in its own tokens, and the same
parser reads both (``tools/hermes.py``). A response that copies the answer needs 2 + 4 +
2 tokens: ``rollout.response_length=10`` leaves room.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_asyncppo.config import ConfigError, DataConfig
from hpc_asyncppo.tasks.base import Prompt
from hpc_asyncppo.tasks.jsonl import read_jsonl_prompts
from hpc_asyncppo.tools.base import Tool, ToolResponse

DIGITS = [str(d) for d in range(10)]
CALL = ["<tool_call>", '{"name":"lookup","arguments":{}}</tool_call>']
# The tiny tokenizer's chat template (words only): what a tool message becomes after the
# model's turn (its EOS, then the answer between <tool_response> marks).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<tool_response> {{ m['content'] }} "
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }} <eos> "
    "{% else %}{{ m['content'] }} {% endif %}"
    "{% endfor %}"
)


def lookup_tool_config(delay_s: str = "0") -> str:
    """The lookup tool's config (verl's tool YAML) with ``delay_s`` (YAML: a number or
    ``[low, high]``): what tests and benchmarks write for a slow tool."""
    return (
        "tools:\n"
        "  - class_name: hpc_asyncppo.tasks.tool_lookup.LookupTool\n"
        f"    config: {{delay_s: {delay_s}}}\n"
        "    tool_schema: {type: function, function: {name: lookup, description: Look up "
        "the answer to the question, parameters: {type: object, properties: {}}}}\n"
    )


def generate_prompts(count: int, seed: int = 4321) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        digits = [rng.choice(DIGITS) for _ in range(rng.randint(2, 4))]
        answer = rng.choice(DIGITS)
        prompts.append(Prompt(index, " ".join(["question", *digits, "="]), answer))
    return prompts


class LookupTool(Tool):
    """Answers every call with its trajectory's secret (``create(answer=...)``). Keeps one
    digit per trajectory; safe to re-run. Config ``delay_s``: seconds each call takes
    before it answers, a number or ``[low, high]`` drawn uniformly per call (a stand-in
    for a slow tool: ``scripts/bench_tools.py``, the tests' calls in flight and hangs)."""

    rerun_safe = True

    def __init__(self, config: dict[str, Any], schema: dict[str, Any]):
        super().__init__(config, schema)
        unknown = sorted(set(config) - {"delay_s"})
        if unknown:
            raise ValueError(f"unknown keys {unknown}; known: ['delay_s']")
        delay = config.get("delay_s", 0.0)
        low, high = (delay, delay) if isinstance(delay, int | float) else tuple(delay)
        if not 0 <= low <= high:
            raise ValueError(f"delay_s={delay!r} must be seconds >= 0 or [low, high]")
        self.delay = (float(low), float(high))
        self.rng = random.Random(0)
        self.answers: dict[str, str] = {}
        self.calls: dict[str, int] = {}

    def create(self, instance_id: str, answer: str = "", **kwargs: Any) -> None:
        self.answers[instance_id] = answer

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        if self.delay[1] > 0:
            time.sleep(self.rng.uniform(*self.delay))
        self.calls[instance_id] = self.calls.get(instance_id, 0) + 1
        return ToolResponse(self.answers[instance_id])

    def reward(self, instance_id: str) -> float:
        """0.1 for a trajectory that called once: asking again is no use (the answer is
        the same), and a policy that keeps calling never answers."""
        return 0.1 if self.calls.get(instance_id) == 1 else 0.0

    def release(self, instance_id: str) -> None:
        self.answers.pop(instance_id, None)
        self.calls.pop(instance_id, None)

    def state(self, instance_id: str) -> dict[str, Any]:
        return {"answer": self.answers[instance_id], "calls": self.calls.get(instance_id, 0)}

    def load_state(self, instance_id: str, state: dict[str, Any]) -> None:
        self.answers[instance_id] = state["answer"]
        self.calls[instance_id] = int(state.get("calls", 0))


class ToolLookupTask:
    chat_template = CHAT_TEMPLATE

    def __init__(self, data: DataConfig, seed: int = 4321):
        if data.train:
            if not Path(data.train).is_file():
                raise ConfigError(f"data.train={data.train!r}: no such file")
            prompts = read_jsonl_prompts(Path(data.train))
        else:
            prompts = generate_prompts(data.num_prompts, seed)
        self._prompts = [
            Prompt(
                p.index,
                p.text,
                p.ground_truth,
                data_source=p.data_source,
                tools_kwargs={"lookup": {"create_kwargs": {"answer": p.ground_truth}}},
            )
            for p in prompts
        ]

    def prompts(self) -> Sequence[Prompt]:
        return self._prompts

    def vocabulary(self) -> list[str]:
        return [*DIGITS, "=", "question", *CALL, "<tool_response>"]

    def reward(self, prompt: Prompt, response_text: str) -> float:
        words = response_text.split()
        prefix = 0
        for word, want in zip(words, CALL, strict=False):
            if word != want:
                break
            prefix += 1
        truth = prompt.ground_truth
        right = False
        if "<tool_response>" in words:
            last = len(words) - 1 - words[::-1].index("<tool_response>")
            right = words[last + 1 : last + 3] == [truth, truth]
        return 0.1 * prefix / len(CALL) + 0.8 * right
