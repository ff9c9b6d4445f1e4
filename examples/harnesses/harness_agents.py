"""The lookup task's agent written with each popular harness, as its own documentation
shows it, unmodified: each function runs one session against ``base_url`` (the session's
gateway URL, ``.../sessions/ID/v1``) with the run's ``key`` and returns what the agent
ended with (its final text) and how often it called ``lookup``.

These run in an environment of their own, with the libraries ``constraints/harnesses.txt``
pins (``scripts/install_harnesses.sh`` makes it: ``build/harness-venv``), not the
trainer's: ``run_harnesses.py`` claims the sessions of a ``data.agent=external`` run and
hands each group to one of them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
os.environ.setdefault("MSWEA_CONFIGURED", "true")  # mini-swe-agent: no first-run setup

DESCRIPTION = "Look up the answer to the question"
PARAMETERS = {"type": "object", "properties": {}}
TIMEOUT_S = 120  # each call's, as every client takes one: no wait is unbounded


@dataclass
class Episode:
    """One session's agent: its question, the answer the tool knows, what happened."""

    question: str
    secret: str
    calls: int = 0
    final: str = ""
    errors: list[str] = field(default_factory=list)

    def lookup(self) -> str:
        self.calls += 1
        return self.secret


def openai_agents_responses(base_url: str, key: str, e: Episode) -> None:
    """The OpenAI Agents SDK's default: an ``Agent`` on the Responses API."""
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import AgentsException
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool(name_override="lookup", description_override=DESCRIPTION)
    def lookup() -> str:
        return e.lookup()

    model = OpenAIResponsesModel(
        "policy", AsyncOpenAI(base_url=base_url, api_key=key, timeout=TIMEOUT_S)
    )
    agent = Agent(name="lookup agent", tools=[lookup], model=model)
    try:
        e.final = str(Runner.run_sync(agent, e.question, max_turns=3).final_output)
    except AgentsException as exc:  # the model's turn was not what the SDK needs
        e.errors.append(f"{type(exc).__name__}: {exc}"[:300])


def openai_agents_chat_structured(base_url: str, key: str, e: Episode) -> None:
    """The Agents SDK on chat completions with a structured ``output_type``."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import AgentsException
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    set_tracing_disabled(True)

    class Answer(BaseModel):
        answer: str

    @function_tool(name_override="lookup", description_override=DESCRIPTION)
    def lookup() -> str:
        return e.lookup()

    model = OpenAIChatCompletionsModel(
        "policy", AsyncOpenAI(base_url=base_url, api_key=key, timeout=TIMEOUT_S)
    )
    agent = Agent(name="lookup agent", tools=[lookup], model=model, output_type=Answer)
    try:
        e.final = Runner.run_sync(agent, e.question, max_turns=3).final_output.answer
    except AgentsException as exc:  # e.g. its answer is not the JSON the schema asks for
        e.errors.append(f"{type(exc).__name__}: {exc}"[:300])


def langgraph_react(base_url: str, key: str, e: Episode) -> None:
    """``langchain-openai``'s ChatOpenAI in LangGraph's prebuilt ReAct agent."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    @tool(description=DESCRIPTION)
    def lookup() -> str:
        """Look up the answer to the question."""
        return e.lookup()

    model = ChatOpenAI(model="policy", base_url=base_url, api_key=key, max_retries=0,
                       timeout=TIMEOUT_S)  # fmt: skip
    agent = create_react_agent(model, [lookup])
    try:
        out = agent.invoke({"messages": [("user", e.question)]}, {"recursion_limit": 6})
        e.final = str(out["messages"][-1].content)
    except GraphRecursionError as exc:
        e.errors.append(f"{type(exc).__name__}: {exc}"[:300])


def _smolagents_lookup(e: Episode):
    from smolagents import Tool

    class Lookup(Tool):
        name = "lookup"
        description = DESCRIPTION
        inputs: dict = {}
        output_type = "string"

        def forward(self) -> str:
            return e.lookup()

    return Lookup()


def _smolagents(kind: str, base_url: str, key: str, e: Episode) -> None:
    """smolagents' ``ToolCallingAgent`` or ``CodeAgent`` (its stop sequences end the
    model's turn) on ``OpenAIServerModel``."""
    import smolagents

    model = smolagents.OpenAIServerModel(model_id="policy", api_base=base_url, api_key=key,
                                         client_kwargs={"timeout": TIMEOUT_S})  # fmt: skip
    agent = getattr(smolagents, kind)(tools=[_smolagents_lookup(e)], model=model, max_steps=2,
                                      verbosity_level=0)  # fmt: skip
    e.final = str(agent.run(e.question))


def smolagents_tool_calling(base_url: str, key: str, e: Episode) -> None:
    _smolagents("ToolCallingAgent", base_url, key, e)


def smolagents_code(base_url: str, key: str, e: Episode) -> None:
    _smolagents("CodeAgent", base_url, key, e)


def _tool_loop(create: Callable[[list[dict]], dict], e: Episode) -> None:
    """An OpenAI-style tool loop over ``create`` (messages -> the model's message)."""
    messages: list[dict] = [{"role": "user", "content": e.question}]
    for _ in range(3):
        message = create(messages)
        messages.append(message)
        if not message.get("tool_calls"):
            e.final = message.get("content") or ""
            return
        for call in message["tool_calls"]:
            result = e.lookup() if call["function"]["name"] == "lookup" else "no such tool"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


def litellm_tools(base_url: str, key: str, e: Episode) -> None:
    """LiteLLM's ``completion`` with tools, OpenAI-compatible provider."""
    import litellm

    litellm.suppress_debug_info = True
    tools = [{"type": "function", "function": {"name": "lookup", "description": DESCRIPTION,
                                               "parameters": PARAMETERS}}]  # fmt: skip

    def create(messages: list[dict]) -> dict:
        out = litellm.completion(model="openai/policy", api_base=base_url, api_key=key,
                                 messages=messages, tools=tools, timeout=TIMEOUT_S)  # fmt: skip
        return out.choices[0].message.model_dump(exclude_none=True)

    _tool_loop(create, e)


def anthropic_tools(base_url: str, key: str, e: Episode, stream: bool = False) -> None:
    """The ``anthropic`` SDK's Messages with tool use (``stream``: its streaming helper)."""
    import anthropic

    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=key,
                                 max_retries=0, timeout=TIMEOUT_S)  # fmt: skip
    tools = [{"name": "lookup", "description": DESCRIPTION, "input_schema": PARAMETERS}]
    messages: list[dict] = [{"role": "user", "content": e.question}]
    for _ in range(3):
        kwargs = {"model": "policy", "max_tokens": 64, "messages": messages, "tools": tools}
        if stream:
            with client.messages.stream(**kwargs) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        blocks = [b.model_dump(exclude_none=True) for b in message.content]
        messages.append({"role": "assistant", "content": blocks})
        uses = [b for b in message.content if b.type == "tool_use"]
        if not uses:
            e.final = "".join(b.text for b in message.content if b.type == "text")
            return
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": e.lookup()} for b in uses]})  # fmt: skip


def anthropic_stream(base_url: str, key: str, e: Episode) -> None:
    anthropic_tools(base_url, key, e, stream=True)


def miniswe(base_url: str, key: str, e: Episode) -> None:
    """mini-swe-agent's ``LitellmModel`` (its bash tool; a reply without a valid call
    becomes a format-error message, as its ``DefaultAgent`` handles it)."""
    import litellm
    from minisweagent.exceptions import FormatError
    from minisweagent.models.litellm_model import LitellmModel

    litellm.suppress_debug_info = True
    model = LitellmModel(model_name="openai/policy", cost_tracking="ignore_errors",
                         model_kwargs={"api_base": base_url, "api_key": key,
                                       "timeout": TIMEOUT_S})  # fmt: skip
    messages: list[dict] = [{"role": "user", "content": e.question}]
    for _ in range(2):
        try:
            message = model.query(messages)
        except FormatError as exc:  # no bash call: the agent is told, and goes on
            e.calls += bool(json.dumps(exc.messages).count("lookup"))
            messages.extend(exc.messages)
            continue
        messages.append(message)
        e.final = message.get("content") or ""
        if not message.get("tool_calls"):
            return


HARNESSES: dict[str, Callable[[str, str, Episode], None]] = {
    "openai-agents": openai_agents_responses,
    "openai-agents-chat-structured": openai_agents_chat_structured,
    "langgraph": langgraph_react,
    "smolagents-tool-calling": smolagents_tool_calling,
    "smolagents-code": smolagents_code,
    "litellm": litellm_tools,
    "anthropic": anthropic_tools,
    "anthropic-stream": anthropic_stream,
    "mini-swe-agent": miniswe,
}
