"""The gateway's three front doors as harnesses call them: the request bodies six agent
libraries really sent (``fixtures/harnesses/``, each with the version that sent it), the
Responses and Messages round trips, and each point of the field table (``requests.py``):
retries, a sampling field overridden, ``tool_choice`` required and named, two calls in one
turn, a ``<think>`` turn, stop strings, ``logprobs``, usage in its own streamed chunk; and
streaming on every door as the engine makes the turn (``stepped``: a token a step).

The tiny lookup model is a machine whose turns are known (``bigram``): after ``=`` it
writes the lookup call and then a second call, one word long, then EOS; after ``ponder`` a
``<think>`` block and 7; after ``tell`` ``said Observation: said ...`` without end. Every
answer is checked exactly, and each session's trained tokens against the chat template's
tokens of the conversation it ended with.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from hpc_asyncppo.config import DataConfig, ModelConfig, RolloutConfig, TinyModelConfig
from hpc_asyncppo.models.tiny import build_tiny_model
from hpc_asyncppo.rollout.gateway.addresses import make_token
from hpc_asyncppo.rollout.gateway.requests import Fields
from hpc_asyncppo.rollout.gateway.server import Gateway, make_app
from hpc_asyncppo.rollout.gateway.sessions import Sessions
from hpc_asyncppo.rollout.hf_engine import HFEngine
from hpc_asyncppo.tasks.tool_lookup import CALL, CHAT_TEMPLATE, ToolLookupTask
from tests.harness import HANG_S
from tests.rollout.gateway_loop import Loop, bigram

WIDTH = 12
FIXTURES = Path(__file__).parent / "fixtures" / "harnesses"
SECOND = '<tool_call>{"name":"lookup","arguments":{"k":2}}</tool_call>'  # a whole call
WORDS = [SECOND, "<think>", "hmm", "</think>", "ponder", "tell", "said", "Observation:"]
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "the answer",
                                           "parameters": {"type": "object", "properties": {}}}}  # fmt: skip


def serve(root: Path, **rollout):
    """The tiny lookup machine behind a gateway, its loop running (``rollout``: the
    engine's settings beside the width)."""
    task = ToolLookupTask(DataConfig(num_prompts=8))
    model_dir = build_tiny_model(root / "model", task.vocabulary() + WORDS, TinyModelConfig(),
                                 3, CHAT_TEMPLATE)  # fmt: skip
    bigram(model_dir, {"=": CALL[0], CALL[0]: CALL[1], CALL[1]: SECOND, "ponder": "<think>",
                       "<think>": "hmm", "hmm": "</think>", "</think>": "7", "tell": "said",
                       "said": "Observation:", "Observation:": "said"})  # fmt: skip
    engine = HFEngine(ModelConfig(path=str(model_dir)),
                      RolloutConfig(response_length=WIDTH, **rollout),
                      __import__("torch").device("cpu"))  # fmt: skip
    engine.version = 3
    # long prompts: the harnesses' own system prompts (smolagents': 8.8 KB)
    sessions = Sessions(engine.tokenizer, engine.eos_id, WIDTH, 4096, timeout_s=HANG_S)
    engine.turn_ends = sessions.turn_ends
    token = make_token(root)
    app = make_app(sessions, token, "policy", Fields({"temperature": 1.0, "top_p": 1.0}), 2**22)
    gateway = Gateway(app, "127.0.0.1", 0)
    loop = Loop(engine, sessions)
    loop.start()
    yield {"engine": engine, "sessions": sessions, "loop": loop, "token": token,
           "url": f"http://127.0.0.1:{gateway.port}", "task": task}  # fmt: skip
    loop.halt = True
    loop.join(timeout=HANG_S)
    gateway.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve(tmp_path_factory.mktemp("doors"))


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    """The same, its engine stepping one token at a time (``rollout.hf_step_tokens=1``)."""
    yield from serve(tmp_path_factory.mktemp("stepped"), hf_step_tokens=1)


def post(served, path: str, body, headers=None) -> httpx.Response:
    h = {"Authorization": f"Bearer {served['token']}", **(headers or {})}
    return httpx.post(served["url"] + path, json=body, headers=h, timeout=HANG_S)


def sse(response: httpx.Response) -> list[tuple[str | None, dict]]:
    """A server-sent event stream's (event name, data) pairs, ``[DONE]`` left out."""
    out, name = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: ") and line != "data: [DONE]":
            out.append((name, json.loads(line[len("data: ") :])))
            name = None
    return out


def open_one(served, key, index: int = 0, n: int = 1) -> list[str]:
    return served["loop"].open(key, n, served["task"].prompts()[index])


def finish(served, key, sids, reward=1.0):
    for sid in sids:
        served["sessions"].end(sid, reward).result(timeout=HANG_S)
    return served["loop"].result(key)


def trained(served, gen, prompt_ids, row: int, conversation: list[dict]) -> list[int]:
    """Row ``row``'s tokens are the chat template's of ``conversation`` (its last turn the
    model's); the model's own tokens (loss mask 1), returned."""
    tokenizer = served["engine"].tokenizer
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    length = int(gen.response_lengths[row])
    response = gen.response_ids[row, :length].tolist()
    assert list(prompt_ids) + response == tokenizer(text, add_special_tokens=False)["input_ids"]
    mask = gen.loss_mask[row, :length] if gen.loss_mask is not None else np.ones(length)
    return [t for t, m in zip(response, mask, strict=True) if m]


# --- the recorded requests ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_every_recorded_harness_request_is_answered_in_its_apis_shape(served, name):
    """Each request as its library sent it (headers and body, the key replaced by the run's
    token), one session per recording: every call is answered, none refused. Where the
    recorded conversation does not extend what this model answered (its follow-ups carry
    the recorder's answers), the session goes on in a new sequence."""
    recording = json.loads((FIXTURES / f"{name}.json").read_text())
    key = ("recorded", name)
    [sid] = open_one(served, key)
    for request in recording["requests"]:
        headers = {k: v.replace("KEY", served["token"]) for k, v in request["headers"].items()
                   if k in ("authorization", "x-api-key", "anthropic-version")}  # fmt: skip
        r = post(served, f"/sessions/{sid}{request['path']}", request["body"], headers)
        assert r.status_code == 200, (recording["library"], recording["version"], r.text)
        stream = request["body"].get("stream")
        if request["path"] == "/v1/messages":
            last = sse(r)[-1][1] if stream else r.json()
            assert last["type"] == ("message_stop" if stream else "message")
        elif request["path"] == "/v1/responses":
            last = sse(r)[-1][1]["response"] if stream else r.json()
            assert last["object"] == "response" and last["output"]
        else:
            chunks = [data for _, data in sse(r)] if stream else [r.json()]
            assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    gen, rewards, dropped, *_ = finish(served, key, [sid])
    assert dropped == "" and rewards == [1.0]


# --- the Responses and Messages doors -----------------------------------------------------


def test_a_responses_round_trip_as_the_agents_sdk_sends_it_extends_one_sequence(served):
    """The Agents SDK's default: instructions and input, stateless (the second call sends
    every item again: the model's function_call items as they came, then their output);
    the real ``openai`` client reads both answers."""
    key = ("responses", 1)
    [sid] = open_one(served, key, 1)
    prompt = served["task"].prompts()[1]
    c = openai.OpenAI(base_url=f"{served['url']}/sessions/{sid}/v1", api_key=served["token"],
                      max_retries=0)  # fmt: skip
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object",
            "properties": {}, "additionalProperties": False}, "strict": True}  # fmt: skip
    items: list[dict] = [{"role": "user", "content": prompt.text}]
    first = c.responses.create(model="policy", instructions="question", input=items,
                               tools=[tool])  # fmt: skip
    calls = [i for i in first.output if i.type == "function_call"]
    assert [json.loads(i.arguments) for i in calls] == [{}, {"k": 2}]  # two in one turn
    assert first.status == "completed"
    items += [i.model_dump(exclude_none=True) for i in first.output]
    items += [{"type": "function_call_output", "call_id": i.call_id, "output": "7"}
              for i in calls]  # fmt: skip
    second = c.responses.create(model="policy", instructions="question", input=items,
                                tools=[tool])  # fmt: skip
    assert second.output[-1].type == "message" and second.output_text == ""
    exact = second.model_extra["hpc_asyncppo"]
    assert exact["token_ids"] == [served["engine"].eos_id] and exact["token_versions"] == [3]
    gen, _, dropped, prompt_ids, _ = finish(served, key, [sid])
    assert dropped == "" and gen.response_ids.shape[0] == 1  # one sequence: it extended
    assistant = {"role": "assistant", "content": " ".join([*CALL, SECOND])}
    conversation = [{"role": "system", "content": "question"},
                    {"role": "user", "content": prompt.text}, assistant,
                    {"role": "tool", "content": "7"}, {"role": "tool", "content": "7"},
                    {"role": "assistant", "content": ""}]  # fmt: skip
    sampled = trained(served, gen, prompt_ids, 0, conversation)
    eos = served["engine"].eos_id
    assert sampled == [*served["engine"].encode(" ".join([*CALL, SECOND])), eos, eos]


def test_a_streamed_responses_call_ends_with_the_completed_response(served):
    key = ("responses-stream", 2)
    [sid] = open_one(served, key, 2)
    body = {"model": "policy", "input": served["task"].prompts()[2].text, "stream": True,
            "tools": [{"type": "function", "name": "lookup", "parameters": {}}]}  # fmt: skip
    events = sse(post(served, f"/sessions/{sid}/v1/responses", body))
    kinds = [name for name, _ in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    done = [d["item"] for name, d in events if name == "response.output_item.done"]
    assert done == events[-1][1]["response"]["output"]
    assert [i["name"] for i in done if i["type"] == "function_call"] == ["lookup", "lookup"]
    finish(served, key, [sid])


def test_a_messages_tool_use_round_trip_as_the_anthropic_sdk_sends_it(served):
    """``anthropic``'s body: system, max_tokens, tools with input_schema; the tool_use
    blocks back as they came, then a user turn of tool_result blocks: one sequence, whose
    trained tokens are the conversation's. ``x-api-key`` is taken as the token too."""
    key = ("messages", 3)
    [sid] = open_one(served, key, 3)
    prompt = served["task"].prompts()[3]
    tools = [{"name": "lookup", "description": "the answer",
              "input_schema": {"type": "object", "properties": {}}}]  # fmt: skip
    messages = [{"role": "user", "content": prompt.text}]
    body = {"model": "policy", "max_tokens": 64, "system": "question", "messages": messages,
            "tools": tools, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}  # fmt: skip
    headers = {"Authorization": "", "x-api-key": served["token"],
               "anthropic-version": "2023-06-01"}  # fmt: skip
    first = httpx.post(f"{served['url']}/sessions/{sid}/v1/messages", json=body,
                       headers=headers, timeout=HANG_S).json()  # fmt: skip
    assert first["type"] == "message" and first["stop_reason"] == "tool_use"
    [use] = first["content"]  # one call: parallel use disabled, the turn ends at its end
    assert use["type"] == "tool_use" and use["name"] == "lookup" and use["input"] == {}
    messages += [{"role": "assistant", "content": first["content"]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                               "content": "7"}]}]  # fmt: skip
    second = post(served, f"/sessions/{sid}/v1/messages", {**body, "messages": messages}).json()
    assert second["stop_reason"] == "end_turn" and second["content"] == []
    gen, _, dropped, prompt_ids, _ = finish(served, key, [sid])
    assert dropped == "" and gen.response_ids.shape[0] == 1
    conversation = [{"role": "system", "content": "question"},
                    {"role": "user", "content": prompt.text},
                    {"role": "assistant", "content": " ".join(CALL)},
                    {"role": "tool", "content": "7"}, {"role": "assistant", "content": ""}]  # fmt: skip
    sampled = trained(served, gen, prompt_ids, 0, conversation)
    assert sampled == [*served["engine"].encode(" ".join(CALL)), served["engine"].eos_id]
    counted = post(served, "/v1/messages/count_tokens", {"model": "policy", "system": "question",
                   "messages": messages[:1], "tools": tools}).json()  # fmt: skip
    assert counted == {"input_tokens": len(prompt_ids)}


def test_a_streamed_messages_call_gives_anthropics_events(served):
    key = ("messages-stream", 4)
    [sid] = open_one(served, key, 4)
    body = {"model": "policy", "max_tokens": 64, "stream": True, "stop_sequences": [],
            "messages": [{"role": "user", "content": served["task"].prompts()[4].text}],
            "tools": [{"name": "lookup", "input_schema": {"type": "object"}}]}  # fmt: skip
    events = sse(post(served, f"/sessions/{sid}/v1/messages", body))
    kinds = [name for name, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    deltas = [d["delta"] for name, d in events if name == "content_block_delta"]
    assert [json.loads(d["partial_json"]) for d in deltas] == [{}, {"k": 2}]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    finish(served, key, [sid])


def test_errors_come_in_each_apis_shape(served):
    r = post(served, "/v1/messages", {"model": "policy", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(served["url"] + "/v1/nothing", headers={"x-api-key": served["token"]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(served["url"] + "/v1/chat/completions",
                  headers={"Authorization": f"Bearer {served['token']}"})  # fmt: skip
    assert r.status_code == 405 and "message" in r.json()["error"]
    r = httpx.post(served["url"] + "/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(served["url"] + "/health").status_code == 200  # no token needed
    auth = {"Authorization": f"Bearer {served['token']}"}
    assert httpx.get(served["url"] + "/v1/models/policy", headers=auth).json()["id"] == "policy"
    r = httpx.get(served["url"] + "/v1/models/other", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    [sid] = open_one(served, ("long", 5), 5)
    r = post(served, f"/sessions/{sid}/v1/chat/completions",
             {"model": "policy", "messages": [{"role": "user", "content": "= " * 5000}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finish(served, ("long", 5), [sid], {"error": "done"})


# --- the field table, call by call ----------------------------------------------------------


def chat(served, sid: str, **body) -> dict:
    r = post(served, f"/sessions/{sid}/v1/chat/completions", {"model": "policy", **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_retry_gets_the_same_turn_and_a_sampling_field_the_runs_sampling(served):
    """The same body again (a client's retry after a timeout) is answered with the same
    turn, not a new sequence; ``temperature: 0`` is answered at the run's temperature,
    said in the answer and counted for the step's metrics."""
    key = ("retry", 6)
    [sid] = open_one(served, key, 6)
    messages = [{"role": "user", "content": served["task"].prompts()[6].text}]
    body = {"messages": messages, "tools": [LOOKUP], "temperature": 0, "frobnicate": 1}
    first = chat(served, sid, **body)
    assert first["hpc_asyncppo"] == {"overridden": {"temperature": 0}, "ignored": ["frobnicate"]}
    retried = served["sessions"].retried_calls
    again = chat(served, sid, **body)
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert again["hpc_asyncppo"]["retried"] is True and "retried" not in first["hpc_asyncppo"]
    assert served["sessions"].retried_calls == retried + 1
    gen, _, dropped, _, extra = finish(served, key, [sid])
    assert gen.response_ids.shape[0] == 1 and extra == {"gateway/overridden/temperature": 1.0}


def test_tool_choice_required_and_named_start_the_turn_with_the_call(served):
    """After ``tell`` the model writes no call; ``required`` (smolagents, LangChain's
    ``any``) and a named function start its turn with ``<tool_call>``: context the
    gateway wrote (log-prob 0, version -1, loss mask 0), and the model writes the rest."""
    key = ("required", 7)
    sids = open_one(served, key, 7, n=2)
    opening = served["engine"].encode(CALL[0])
    messages = [{"role": "user", "content": "question tell"}]
    choices = [{"tool_choice": "required"},
               {"tool_choice": {"type": "function", "function": {"name": "lookup"}},
                "parallel_tool_calls": False}]  # fmt: skip
    for sid, choice in zip(sids, choices, strict=True):
        answer = chat(served, sid, messages=messages, tools=[LOOKUP], **choice)["choices"][0]
        assert answer["message"]["tool_calls"][0]["function"]["name"] == "lookup"
        assert answer["token_ids"][:1] == opening and answer["token_versions"][0] == -1
        assert answer["token_logprobs"][0] == 0.0
    gen, _, dropped, _, _ = finish(served, key, sids)
    assert dropped == "" and gen.loss_mask[:, 0].tolist() == [0, 0]
    assert gen.loss_mask[:, 1].tolist() == [1, 1]
    assert gen.response_lengths.tolist() == [4, 2]  # opening, call, second call, EOS; opening, call


def test_a_think_turn_comes_back_as_reasoning_content(served):
    key = ("think", 0)
    [sid] = open_one(served, key, 0)
    answer = chat(served, sid, messages=[{"role": "user", "content": "question ponder"}])
    message = answer["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "7", "reasoning_content": "hmm"}
    tokens = served["engine"].encode("<think> hmm </think> 7")
    assert answer["choices"][0]["token_ids"] == [*tokens, served["engine"].eos_id]
    finish(served, key, [sid])


def test_stop_strings_end_the_turn_and_the_tokens_after_them_are_never_kept(served):
    """smolagents' stop sequences: the turn ends at the token that completes the first;
    the text leaves it out, the tokens keep it (the model sampled it) and nothing after."""
    key = ("stop", 1)
    [sid] = open_one(served, key, 1)
    answer = chat(served, sid, messages=[{"role": "user", "content": "question tell"}],
                  stop=["Observation:", "Calling tools:"], logprobs=True)  # fmt: skip
    choice = answer["choices"][0]
    assert choice["message"]["content"] == "said" and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "Observation:"
    assert choice["token_ids"] == served["engine"].encode("said Observation:")
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["said", "Observation:"]
    assert [c["logprob"] for c in content] == choice["token_logprobs"]
    gen, *_ = finish(served, key, [sid])
    assert gen.response_lengths.tolist() == [2]


def test_a_stream_with_include_usage_ends_with_a_usage_chunk(served):
    key = ("usage", 2)
    [sid] = open_one(served, key, 2)
    body = {"model": "policy", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": served["task"].prompts()[2].text}],
            "tools": [LOOKUP]}  # fmt: skip
    chunks = [d for _, d in sse(post(served, f"/sessions/{sid}/v1/chat/completions", body))]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])
    calls = [tc for c in chunks[:-1] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len(calls) == 2
    finish(served, key, [sid])


@pytest.mark.parametrize("on_failure", ["drop", "score"])
def test_a_failed_session_lets_its_siblings_finish(served, on_failure):
    """A session whose agent raised before its first call: its siblings' calls are still
    answered (not 404), and the group is dropped with the reason, or trained with the
    failed session scored at gateway.failure_reward (gateway.on_session_failure)."""
    sessions = served["sessions"]
    key = ("failed", on_failure)
    a, b = open_one(served, key, 5, n=2)
    sessions.on_failure, sessions.failure_reward = on_failure, -1.0
    try:
        sessions.end(a, KeyError("missing")).result(timeout=HANG_S)
        answer = chat(served, b, messages=[{"role": "user", "content": "question tell"}])
        assert answer["choices"][0]["finish_reason"] == "length"  # the room filled
        sessions.end(b, 1.0).result(timeout=HANG_S)
        gen, rewards, dropped, _, extra = served["loop"].result(key)
    finally:
        sessions.on_failure, sessions.failure_reward = "drop", 0.0
    assert extra["gateway/failed_sessions"] == 1.0
    if on_failure == "drop":
        assert dropped.startswith(f"agent failed: session {a}: its agent raised KeyError")
    else:
        assert dropped == "" and rewards == [-1.0, 1.0]
        assert gen.response_lengths.tolist() == [0, WIDTH]


def test_two_calls_at_once_in_one_session_each_go_on_in_their_own_sequence(served):
    """Sub-agents on one base URL: a call made while the session's own has its turn running
    starts a line beside it (a new sequence of the session); later calls go on whichever
    line they extend, and both are trained with the session's reward."""
    sessions, loop = served["sessions"], served["loop"]
    fields = Fields({"temperature": 1.0, "top_p": 1.0})
    key = ("concurrent", 6)
    [sid] = open_one(served, key, 6)
    prompt = served["task"].prompts()[6]
    main = [{"role": "user", "content": prompt.text}]
    side = [{"role": "user", "content": "question ponder"}]
    futures = []

    def both(_):  # between two engine steps: both calls reach the rank at once
        futures.append(sessions.post(sid, fields.chat({"messages": main, "tools": [LOOKUP],
                                                       "parallel_tool_calls": False})))  # fmt: skip
        futures.append(sessions.post(sid, fields.chat({"messages": side})))

    loop.opening.put((both, None, None, None))
    deadline = time.monotonic() + HANG_S
    while len(futures) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    one, two = (f.result(timeout=HANG_S) for f in futures)
    assert one.answer.finish_reason == "tool_calls" and two.answer.message["content"] == "7"
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": one.answer.message["tool_calls"][0]["id"], "type": "function",
         "function": {"name": "lookup", "arguments": "{}"}}]}  # fmt: skip
    # each line goes on: the side's conversation first, then the session's own
    side += [{"role": "assistant", "content": "7"}, {"role": "user", "content": "question"}]
    got = chat(served, sid, messages=side)["choices"][0]
    assert got["token_ids"] == [served["engine"].eos_id]  # after "question": EOS
    main += [call, {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "7"}]
    last = chat(served, sid, messages=main, tools=[LOOKUP], parallel_tool_calls=False)
    assert last["choices"][0]["token_ids"] == [served["engine"].eos_id]
    gen, rewards, dropped, prompt_ids, _ = finish(served, key, [sid], 0.5)
    assert dropped == "" and rewards == [0.5] and gen.row_sessions.tolist() == [0, 0]
    # the side line: <think> hmm </think> 7 EOS, the user's "question", EOS
    assert gen.response_lengths.tolist() == [6, 7]
    own = [main[0], {"role": "assistant", "content": " ".join(CALL)},
           {"role": "tool", "content": "7"}, {"role": "assistant", "content": ""}]  # fmt: skip
    assert trained(served, gen, prompt_ids, 0, own)[-1] == served["engine"].eos_id


# --- streaming: pieces as the engine makes them -------------------------------------------


def test_a_streamed_answer_is_sent_while_the_engine_makes_the_turn(stepped):
    """The engine held before its second step of the turn: the first piece is already
    out. Let go, the rest follows a piece a step, and the pieces are the answer's text."""
    engine = stepped["engine"]
    key = ("held", 0)
    [sid] = open_one(stepped, key, 0)
    step, held, release, steps = engine.step, threading.Event(), threading.Event(), []

    def held_at_second():
        if len(steps) == 1:
            held.set()
            release.wait(HANG_S)
        steps.append(1)
        return step()

    engine.step = held_at_second  # the loop looks it up each pass
    body = {"model": "policy", "stream": True,
            "messages": [{"role": "user", "content": "question tell"}]}  # fmt: skip
    headers = {"Authorization": f"Bearer {stepped['token']}"}
    chunks = []
    try:
        with httpx.stream("POST", f"{stepped['url']}/sessions/{sid}/v1/chat/completions",
                          json=body, headers=headers, timeout=HANG_S) as r:  # fmt: skip
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: ") :]))
                    if chunks[-1]["choices"][0]["delta"].get("content"):
                        break
            assert held.is_set() and len(engine.groups[key].responses[0].tokens) == 1
            assert chunks[-1]["choices"][0]["delta"]["content"] == "said"
            release.set()
            chunks += [json.loads(x[len("data: ") :]) for x in lines if x.startswith("data: {")]
    finally:
        release.set()
        del engine.step
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length" and len(pieces) == len(last["token_ids"]) == WIDTH
    assert "".join(pieces) == engine.tokenizer.decode(last["token_ids"]).strip()
    finish(stepped, key, [sid])


def streamed(served, sid: str, door: str, user: str, **extra) -> list[tuple[str | None, dict]]:
    bodies = {
        "chat/completions": {"messages": [{"role": "user", "content": user}]},
        "completions": {"prompt": user},
        "responses": {"input": user},
        "messages": {"max_tokens": 64, "messages": [{"role": "user", "content": user}]},
    }  # fmt: skip
    r = post(served, f"/sessions/{sid}/v1/{door}",
             {"model": "policy", "stream": True, **bodies[door], **extra})  # fmt: skip
    assert r.status_code == 200, r.text
    return sse(r)


@pytest.mark.parametrize("door", ["chat/completions", "completions", "responses", "messages"])
def test_a_streamed_think_turn_sends_its_reasoning_then_its_content(stepped, door):
    """``<think> hmm </think> 7``, a token a step: each door sends the reasoning as it
    comes, then the content, in its own events; the pieces are the answer's."""
    key = ("stream-think", door)
    [sid] = open_one(stepped, key, 5)
    events = streamed(stepped, sid, door, "question ponder")
    if door == "chat/completions":
        deltas = [d["choices"][0]["delta"] for _, d in events[1:-1]]
        assert deltas == [{"reasoning_content": "hmm"}, {"content": "7"}]
        assert events[-1][1]["choices"][0]["finish_reason"] == "stop"
    elif door == "completions":
        pieces = [d["choices"][0]["text"] for _, d in events]
        assert pieces == ["<think>", " hmm", " </think>", " 7", ""]
    elif door == "responses":
        deltas = [(name, d["delta"], d["output_index"]) for name, d in events
                  if name.endswith(".delta")]  # fmt: skip
        assert deltas == [("response.reasoning_text.delta", "hmm", 0),
                          ("response.output_text.delta", "7", 1)]  # fmt: skip
        done = [d["item"] for name, d in events if name == "response.output_item.done"]
        response = events[-1][1]["response"]
        assert events[-1][0] == "response.completed" and done == response["output"]
        assert [i["type"] for i in done] == ["reasoning", "message"]
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    else:
        blocks = [(d["index"], d["delta"]) for name, d in events if name == "content_block_delta"]
        assert blocks == [(0, {"type": "thinking_delta", "thinking": "hmm"}),
                          (1, {"type": "text_delta", "text": "7"})]  # fmt: skip
        assert [n for n, _ in events].count("content_block_stop") == 2
        assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
    finish(stepped, key, [sid])


def test_a_streamed_tool_call_turn_sends_no_call_text_as_content(stepped):
    """The lookup call and a second one, a token a step: none of their text goes out as
    content; the calls come whole when the turn ends."""
    key = ("stream-calls", 6)
    [sid] = open_one(stepped, key, 6)
    events = streamed(stepped, sid, "chat/completions", stepped["task"].prompts()[6].text,
                      tools=[LOOKUP])  # fmt: skip
    deltas = [d["choices"][0]["delta"] for _, d in events]
    assert not any(d.get("content") for d in deltas)
    calls = [c["function"] for d in deltas for c in d.get("tool_calls", [])]
    assert [json.loads(c["arguments"]) for c in calls] == [{}, {"k": 2}]
    finish(stepped, key, [sid])


@pytest.mark.parametrize("door", ["chat/completions", "completions", "responses", "messages"])
def test_a_streamed_empty_turn_starts_and_ends_as_each_api_does(served, door):
    """A turn that is only EOS (nothing to stream before its end): the whole stream,
    from its first event to its last, at once."""
    key = ("stream-empty", door)
    [sid] = open_one(served, key, 7)
    events = streamed(served, sid, door, "question")
    if door == "chat/completions":
        assert events[0][1]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-1][1]["choices"][0]["finish_reason"] == "stop"
    elif door == "completions":
        assert [d["choices"][0]["finish_reason"] for _, d in events] == ["stop"]
    else:
        first_last = {"responses": ("response.created", "response.completed"),
                      "messages": ("message_start", "message_stop")}  # fmt: skip
        assert (events[0][0], events[-1][0]) == first_last[door]
    finish(served, key, [sid])


@pytest.mark.parametrize("default", [True, False])
def test_a_call_that_does_not_send_parallel_tool_calls_gets_the_runs_default(served, default):
    """``gateway.parallel_tool_calls``, for the harnesses that never send the field: true
    reads both calls of the turn, which runs on to EOS; false ends it at the first call's
    end, as a call with ``parallel_tool_calls: false`` does."""
    fields = Fields({"temperature": 1.0, "top_p": 1.0}, parallel_tool_calls=default)
    key = ("parallel-default", default)
    [sid] = open_one(served, key, 5)
    messages = [{"role": "user", "content": served["task"].prompts()[5].text}]
    call = fields.chat({"messages": messages, "tools": [LOOKUP]})
    result = served["sessions"].post(sid, call).result(timeout=HANG_S)
    engine = served["engine"]
    words = [*CALL, SECOND] if default else CALL
    assert result.token_ids == engine.encode(" ".join(words)) + [engine.eos_id] * default
    assert len(result.answer.message["tool_calls"]) == (2 if default else 1)
    finish(served, key, [sid])


@pytest.mark.parametrize("fixture", ["served", "stepped"])
def test_top_logprobs_give_each_tokens_most_likely_rivals(request, fixture):
    """``top_logprobs: 2`` (a whole turn a step, and a token a step): each token's first
    rival is itself, with its own log-prob; the second, the machine never picks (40 below
    in logits); the completions shape too."""
    served = request.getfixturevalue(fixture)
    key = ("top", fixture)
    sid, other = open_one(served, key, 4, n=2)
    user = [{"role": "user", "content": "question tell"}]
    answer = chat(served, sid, messages=user, logprobs=True, top_logprobs=2, max_tokens=3)
    choice = answer["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["said", "Observation:", "said"]
    for c in content:
        first, second = c["top_logprobs"]
        assert (first["token"], first["logprob"]) == (c["token"], c["logprob"])
        assert second["logprob"] < -30 and second["token"] != c["token"]
    prompt = served["sessions"].tokenizer.decode(answer["prompt_token_ids"])
    r = post(served, f"/sessions/{other}/v1/completions",
             {"model": "policy", "prompt": prompt, "logprobs": 1, "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert [list(t) for t in tops] == [["said"], ["Observation:"]]
    finish(served, key, [sid, other])


def test_a_responses_call_may_include_its_texts_logprobs(served):
    """``include: ["message.output_text.logprobs"]`` and ``top_logprobs``: the turn's
    tokens' log-probs on the message's text, each with its most likely rivals."""
    key = ("responses-logprobs", 3)
    [sid] = open_one(served, key, 3)
    body = {"model": "policy", "input": "question tell", "max_output_tokens": 2,
            "include": ["message.output_text.logprobs"], "top_logprobs": 1}  # fmt: skip
    response = post(served, f"/sessions/{sid}/v1/responses", body).json()
    [text] = response["output"][0]["content"]
    assert text["text"] == "said Observation:"
    assert [(x["token"], [t["token"] for t in x["top_logprobs"]]) for x in text["logprobs"]] == [
        ("said", ["said"]), ("Observation:", ["Observation:"])]  # fmt: skip
    assert [x["logprob"] for x in text["logprobs"]] == response["hpc_asyncppo"]["token_logprobs"]
    finish(served, key, [sid])
