"""The synthetic lookup task (``data.task=tool_lookup``) as your own agent: plain OpenAI
tool calling through the rollout rank's gateway, the tool run by the agent itself.

    python -m hpc_asyncppo.submit data.task=tool_lookup rollout.response_length=10 \
        data.agent=examples.lookup_agent:run

The model sees the question, may call ``lookup`` (which knows the prompt's answer: the
row's ``tools_kwargs``), and should then write the answer. The reward is the in-process
task's (``tasks/tool_lookup.py``), computed from what an agent sees: 0.8 for the right
answer right after the tool's, 0.1 for calling the tool once, 0.1 times the share of the
call's two words the first turn starts with (shaping for a random model).
"""

from __future__ import annotations

import json

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up the answer to the question",
        "parameters": {"type": "object", "properties": {}},
    },
}
CALL_WORDS = ["<tool_call>", '{"name":"lookup","arguments":{}}</tool_call>']


def run(client, row) -> dict:
    """One session: at most four turns of the model. Returns the reward and counts."""
    secret = row.tools_kwargs["lookup"]["create_kwargs"]["answer"]
    messages = list(row.messages)
    calls, first, answered = 0, None, None
    for _ in range(4):
        out = client.chat.completions.create(
            model="policy", messages=messages, tools=[LOOKUP], parallel_tool_calls=False
        )
        choice = out.choices[0]
        message = choice.message.model_dump(exclude_none=True)
        messages.append(message)
        if first is None:
            first = choice.message
        if not choice.message.tool_calls:
            if calls:
                answered = choice.message.content or ""
            break
        for call in choice.message.tool_calls:
            calls += 1
            known = call.function.name == "lookup" and json.loads(call.function.arguments) == {}
            result = secret if known else f"error: no tool {call.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if choice.finish_reason == "length":
            break
    if first.tool_calls:
        prefix = len(CALL_WORDS)
    else:  # how much of the call the first turn began with
        words, prefix = (first.content or "").split(), 0
        for word, want in zip(words, CALL_WORDS, strict=False):
            if word != want:
                break
            prefix += 1
    right = answered is not None and answered.split()[:1] == [secret]
    reward = 0.1 * prefix / len(CALL_WORDS) + 0.1 * (calls == 1) + 0.8 * right
    return {"reward": reward, "tool_calls": calls}
