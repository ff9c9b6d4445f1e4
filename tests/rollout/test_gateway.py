"""The gateway driven by the real ``openai`` client (sync, async, streaming) over real HTTP
(uvicorn), in front of the real transformers engine and the tiny lookup model's real
tokenizer and chat template. The rollout rank's loop is played by a thread that does what
``Rollouter.step_and_send`` does (``Sessions.advance``, ``engine.step``, ``finish``).

The model is programmed so that its turns are known (``bigram``): after ``=`` it writes
the lookup call, after ``question`` ``question`` again, after a digit EOS. So every call's answer is asserted exactly, and each
session's trained tokens are compared with the chat template's tokens of its final
conversation.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from hpc_asyncppo.config import DataConfig, ModelConfig, RolloutConfig, TinyModelConfig
from hpc_asyncppo.models.tiny import build_tiny_model
from hpc_asyncppo.rollout.gateway.addresses import make_token, read_addresses
from hpc_asyncppo.rollout.gateway.requests import Fields
from hpc_asyncppo.rollout.gateway.server import Gateway, make_app
from hpc_asyncppo.rollout.gateway.sessions import Sessions
from hpc_asyncppo.rollout.hf_engine import HFEngine
from hpc_asyncppo.tasks.tool_lookup import CALL, CHAT_TEMPLATE, ToolLookupTask
from tests.harness import HANG_S
from tests.rollout.gateway_loop import Loop, bigram

WIDTH = 12
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "the answer",
        "parameters": {"type": "object", "properties": {}},
    },
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    task = ToolLookupTask(DataConfig(num_prompts=8))
    model_dir = build_tiny_model(root / "model", task.vocabulary(), TinyModelConfig(), 3,
                                 CHAT_TEMPLATE)  # fmt: skip
    # after "=" the lookup call; "question" forever (a turn that fills the room); else EOS
    bigram(model_dir, {"=": CALL[0], CALL[0]: CALL[1], "question": "question"})
    engine = HFEngine(ModelConfig(path=str(model_dir)), RolloutConfig(response_length=WIDTH),
                      torch.device("cpu"))  # fmt: skip
    engine.version = 3
    sessions = Sessions(engine.tokenizer, engine.eos_id, WIDTH, 16, timeout_s=HANG_S)
    engine.turn_ends = sessions.turn_ends
    token = make_token(root)
    fields = Fields({"temperature": 1.0, "top_p": 1.0}, "refuse")
    app = make_app(sessions, token, "tiny", fields, 4096)
    gateway = Gateway(app, "127.0.0.1", 0)
    gateway.write_address(root, 0)
    loop = Loop(engine, sessions)
    loop.start()
    yield {"root": root, "engine": engine, "sessions": sessions, "loop": loop, "token": token,
           "url": f"http://127.0.0.1:{gateway.port}", "task": task}  # fmt: skip
    loop.halt = True
    loop.join(timeout=HANG_S)
    gateway.close()


def client(served, session: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served['url']}/sessions/{session}/v1",
                         api_key=served["token"], max_retries=0)  # fmt: skip


def render(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's tokens of a conversation (no generation prompt: it ends with
    the model's last turn)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_trained(served, gen, prompt_ids, j: int, conversation: list[dict], sampled: list[int]):
    """Session j's sample: prompt and response are the template's tokens of its final
    conversation; the model's tokens are those sampled, the rest observation holes."""
    length = int(gen.response_lengths[j])
    response = gen.response_ids[j, :length].tolist()
    tokenizer = served["engine"].tokenizer
    assert list(prompt_ids) + response == render(tokenizer, conversation)
    mask = gen.loss_mask[j, :length] if gen.loss_mask is not None else np.ones(length)
    assert [t for t, m in zip(response, mask, strict=True) if m] == sampled
    assert all(v == 3 for v, m in zip(gen.versions[j, :length], mask, strict=True) if m)


def test_a_sync_client_calls_the_tool_and_the_trained_tokens_are_the_conversations(served):
    prompt = served["task"].prompts()[0]  # "question ... ="
    key = ("sync", 0)
    ids = served["loop"].open(key, 2, prompt)
    first = served["engine"].tokenizer.decode(
        served["engine"].encode(prompt.text), skip_special_tokens=True)  # fmt: skip
    sampled: dict[int, list[int]] = {}
    conversations = {}
    for j, sid in enumerate(ids):
        c = client(served, sid)
        messages = [{"role": "user", "content": first}]
        answer = c.chat.completions.create(
            model="tiny", messages=messages, tools=[LOOKUP], parallel_tool_calls=False
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name == "lookup" and json.loads(call.function.arguments) == {}
        assert call.id == f"call_{sid}_1_0"
        raw = answer.model_extra
        assert raw["prompt_token_ids"] == served["engine"].encode(first)
        assert choice.model_extra["token_ids"] == served["engine"].encode(" ".join(CALL))
        assert choice.model_extra["token_versions"] == [3, 3]
        sampled[j] = list(choice.model_extra["token_ids"])
        # the agent answers the call, as an OpenAI agent does: the model's message back
        # as it came, then the tool's
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": prompt.ground_truth},
        ]
        answer = c.chat.completions.create(
            model="tiny", messages=messages, tools=[LOOKUP], parallel_tool_calls=False
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        eos = served["engine"].eos_id
        assert choice.model_extra["token_ids"] == [eos]
        # the context the model saw: everything before, observation tokens included
        tail = served["engine"].encode(f"<eos> <tool_response> {prompt.ground_truth}")
        assert answer.model_extra["prompt_token_ids"][-len(tail) :] == tail
        sampled[j] += [eos]
        served["sessions"].end(sid, 1.0 if j == 0 else {"reward": 0.5, "turns": 2}).result(
            timeout=HANG_S)  # fmt: skip
        conversations[j] = [
            {"role": "user", "content": first},
            {"role": "assistant", "content": " ".join(CALL)},
            {"role": "tool", "content": prompt.ground_truth},
            {"role": "assistant", "content": ""},
        ]
    gen, rewards, dropped, prompt_ids, extra = served["loop"].result(key)
    assert rewards == [1.0, 0.5] and dropped == "" and extra == {}  # "turns": not on every one
    for j in range(2):
        check_trained(served, gen, prompt_ids, j, conversations[j], sampled[j])


def test_async_and_streaming_clients_get_the_same_answers(served):
    prompt = served["task"].prompts()[1]
    key = ("async", 1)
    ids = served["loop"].open(key, 2, prompt)

    async def agent(sid: str):
        async with openai.AsyncOpenAI(base_url=f"{served['url']}/sessions/{sid}/v1",
                                      api_key=served["token"], max_retries=0) as c:  # fmt: skip
            messages = [{"role": "user", "content": prompt.text}]
            answer = await c.chat.completions.create(model="tiny", messages=messages,
                                                     tools=[LOOKUP], parallel_tool_calls=False)  # fmt: skip
            return answer.choices[0]

    plain = asyncio.run(agent(ids[0]))
    stream = client(served, ids[1]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt.text}], tools=[LOOKUP], parallel_tool_calls=False,
        stream=True,
    )  # fmt: skip
    chunks = list(stream)
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == [plain.message.tool_calls[0].function.name]
    assert calls[0].id == f"call_{ids[1]}_1_0"
    assert chunks[-1].choices[0].finish_reason == plain.finish_reason == "tool_calls"
    assert chunks[-1].choices[0].model_extra["token_ids"] == plain.model_extra["token_ids"]
    for sid in ids:
        served["sessions"].end(sid, 0.0).result(timeout=HANG_S)
    gen, rewards, dropped, *_ = served["loop"].result(key)
    assert dropped == "" and gen.response_lengths.tolist() == [2, 2]


def post(served, path: str, body, headers=None, token=True) -> httpx.Response:
    h = {"Authorization": f"Bearer {served['token']}"} if token else {}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(served["url"] + path, content=data, headers={**h, **(headers or {})},
                      timeout=HANG_S)  # fmt: skip


def test_without_the_token_every_request_gets_401_and_nothing_happens(served):
    prompt = served["task"].prompts()[2]
    key = ("auth", 2)
    [sid] = served["loop"].open(key, 1, prompt)
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt.text}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": served["token"]}):
        r = post(served, f"/sessions/{sid}/v1/chat/completions", body, headers, token=False)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(served["url"] + "/v1/models", timeout=HANG_S)
    assert r.status_code == 401
    assert served["sessions"].by_id[sid].calls == 0 and key not in served["engine"].groups
    assert (served["root"] / "gateway" / "token").stat().st_mode & 0o777 == 0o600
    assert read_addresses(served["root"])[0]["port"] == int(served["url"].rsplit(":", 1)[1])
    served["sessions"].end(sid, ValueError("done")).result(timeout=HANG_S)
    assert served["loop"].result(key)[2].startswith("agent failed: session s1-e0-p2-r0")


def test_bad_requests_get_openai_errors_and_change_nothing(served):
    """(The fixture's run refuses sampling fields other than its own:
    gateway.sampling=refuse.)"""
    prompt = served["task"].prompts()[3]
    key = ("bad", 3)
    [sid] = served["loop"].open(key, 1, prompt)
    path = f"/sessions/{sid}/v1/chat/completions"
    user = [{"role": "user", "content": prompt.text}]
    cases = [
        (b"{not json", 400, None),
        ({"model": "tiny", "messages": user, "temperature": "0.7"}, 400, "temperature"),
        ({"model": "tiny", "messages": user, "stop": 3}, 400, "stop"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "tiny", "messages": user, "temperature": 0.3}, 400, "temperature"),
        ({"model": "tiny", "messages": user, "n": 2}, 400, "n"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "= " * 40}]},
            400,
            "messages",
        ),  # past data.max_prompt_length (16)
        ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}, 413, None),
    ]
    for body, status, param in cases:
        r = post(served, path, body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["param"] == param
    r = post(served, "/sessions/nobody/v1/chat/completions", {"model": "tiny", "messages": user})
    assert r.status_code == 404
    assert key not in served["engine"].groups  # no bad call reached the engine
    # a good call, then one that would start a new sequence with a prompt too long:
    # refused, the session goes on in its sequence
    good = post(
        served,
        path,
        {"model": "tiny", "messages": user, "tools": [LOOKUP], "parallel_tool_calls": False},
    )
    assert good.status_code == 200
    message = good.json()["choices"][0]["message"]
    rewritten = [{"role": "user", "content": "= " * 40}, message, {"role": "tool", "content": "1"}]
    r = post(
        served,
        path,
        {"model": "tiny", "messages": rewritten, "tools": [LOOKUP], "parallel_tool_calls": False},
    )
    assert r.status_code == 400 and "data.max_prompt_length" in r.json()["error"]["message"]
    later = [*user, message, {"role": "tool", "content": "1"}]
    r = post(
        served,
        path,
        {"model": "tiny", "messages": later, "tools": [LOOKUP], "parallel_tool_calls": False},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    served["sessions"].end(sid, 1.0).result(timeout=HANG_S)
    gen, rewards, dropped, *_ = served["loop"].result(key)
    length = int(gen.response_lengths[0])  # the call (2 tokens), then EOS: the model's
    assert dropped == "" and gen.loss_mask[0, :length].tolist() == [1, 1, 0, 0, 0, 1]


def test_a_call_that_does_not_extend_goes_on_in_a_new_sequence_trained_with_the_sessions_reward(
    served,
):
    """Session a calls the tool, then rewrites its history (a shorter question): its call
    is a new sequence, its prompt that conversation rendered whole, and the session goes
    on there (the tool's answer, the model's last turn). The group comes back with a row
    per sequence: each is the template's tokens of its own final conversation, with the
    session's reward. Past gateway.max_sequences such a call gets 400 and nothing
    changes. Cut in its second sequence and resumed, a re-run agent gets both sequences'
    turns from the recording (v3 while the engine is at v4)."""
    from hpc_asyncppo.rollout.cut_groups import CutGroups
    from hpc_asyncppo.transport.samples import SampleGroup, decode_group, encode_group

    engine, sessions, loop = served["engine"], served["sessions"], served["loop"]
    prompt = served["task"].prompts()[5]
    first = engine.tokenizer.decode(engine.encode(prompt.text), skip_special_tokens=True)
    short = "question ="

    def run_a(sid: str) -> tuple[list, list, list]:
        """Agent a: the call, then the rewritten history, the tool's answer, the end."""
        c = client(served, sid)
        one = [{"role": "user", "content": first}]
        answer = c.chat.completions.create(
            model="tiny", messages=one, tools=[LOOKUP], parallel_tool_calls=False
        )
        call = answer.choices[0].message.model_dump(exclude_none=True)
        two = [{"role": "user", "content": short}]  # the history summarised
        branched = c.chat.completions.create(
            model="tiny", messages=two, tools=[LOOKUP], parallel_tool_calls=False
        )
        assert branched.choices[0].finish_reason == "tool_calls"
        assert branched.model_extra["prompt_token_ids"] == engine.encode(short)
        message = branched.choices[0].message.model_dump(exclude_none=True)
        two += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                          "content": "1"}]  # fmt: skip
        last = c.chat.completions.create(
            model="tiny", messages=two, tools=[LOOKUP], parallel_tool_calls=False
        )
        assert last.choices[0].finish_reason == "stop"
        return [answer, branched, last], one + [call], two

    key = ("branch", 5)
    a, b = loop.open(key, 2, prompt)
    sessions.max_sequences = 2
    try:
        answers, one, two = run_a(a)
        # a third sequence: no room for it, answered with no turn ("length"); nothing
        # changes, a's second sequence stays as it was
        r = post(served, f"/sessions/{a}/v1/chat/completions",
                 {"model": "tiny", "messages": one, "tools": [LOOKUP],
                  "parallel_tool_calls": False})  # fmt: skip
        assert r.status_code == 200
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["token_ids"] == []
        assert choice["message"]["content"] is None
    finally:
        sessions.max_sequences = 32
    client(served, b).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": first}], tools=[LOOKUP], parallel_tool_calls=False)  # fmt: skip
    sessions.end(a, 1.0).result(timeout=HANG_S)
    sessions.end(b, 0.0).result(timeout=HANG_S)
    gen, rewards, dropped, prompt_ids, _ = loop.result(key)
    assert dropped == "" and rewards == [1.0, 0.0]
    assert gen.row_sessions.tolist() == [0, 1, 0]
    eos, call = engine.eos_id, engine.encode(" ".join(CALL))
    for row in (0, 1):  # the first sequences: the group's prompt, the call
        assert [int(t) for t in gen.row_prompts[row] if t >= 0] == list(prompt_ids)
        assert gen.response_ids[row, : gen.response_lengths[row]].tolist() == call
    # a's second: its own prompt, the call, the tool's answer (a hole), EOS
    second = [two[0], {"role": "assistant", "content": " ".join(CALL)},
              {"role": "tool", "content": "1"}, {"role": "assistant", "content": ""}]  # fmt: skip
    own = [int(t) for t in gen.row_prompts[2] if t >= 0]
    assert own == engine.encode(short) == answers[1].model_extra["prompt_token_ids"]
    check_trained(served, gen, own, 2, second, call + [eos])
    # the trainer's view: one reward per session, a uid per sequence, the same on the wire
    group = decode_group(encode_group(SampleGroup(
        seed=1, epoch=0, prompt_index=prompt.index, rollout_rank=0, param_version_start=3,
        param_version_end=3, prompt_ids=np.asarray(prompt_ids, np.int32),
        response_ids=gen.response_ids, response_lengths=gen.response_lengths,
        rollout_log_probs=gen.log_probs, rewards=np.asarray(rewards, np.float32),
        loss_mask=gen.loss_mask, row_sessions=gen.row_sessions, row_prompts=gen.row_prompts,
    )))  # fmt: skip
    uid = f"s1-e0-p{prompt.index}-r"
    assert [group.uid(r) for r in range(group.rows)] == [f"{uid}0", f"{uid}1", f"{uid}0.s1"]
    assert group.n == 2 and group.last_rows().tolist() == [2, 1]
    assert group.row_prompt(2).tolist() == engine.encode(short)

    # cut in a's second sequence (its tool's answer not yet sent), through a checkpoint's
    # arrays, resumed: a's calls are answered from the recording, both sequences
    key = ("branch-before", 5)
    a, b = loop.open(key, 2, prompt)
    c = client(served, a)
    c.chat.completions.create(
        model="tiny", messages=one[:1], tools=[LOOKUP], parallel_tool_calls=False
    )
    c.chat.completions.create(
        model="tiny", messages=two[:1], tools=[LOOKUP], parallel_tool_calls=False
    )
    cut = CutGroups([(0, 5, 3, loop.cut(key))])
    again = CutGroups()
    again.load_state_dict(cut.state_dict())
    recorded = again.groups[0][3]
    assert recorded.sofar.row_sessions.tolist() == [0, 1, 0]
    replayed, discarded = sessions.replayed_calls, sessions.discarded_tokens
    try:
        engine.version = 4
        loop.open(("branch-resumed", 5), 2, prompt, recorded)
        answers, _, _ = run_a(a)
        versions = [x.choices[0].model_extra["token_versions"] for x in answers]
        assert versions == [[3, 3], [3, 3], [4]]  # two turns replayed, the third generated
        assert sessions.replayed_calls == replayed + 2 and sessions.discarded_tokens == discarded
        sessions.end(a, 1.0).result(timeout=HANG_S)
        sessions.end(b, {"error": "not run"}).result(timeout=HANG_S)
        gen, *_ = loop.result(("branch-resumed", 5))
        assert gen.row_sessions.tolist() == [0, 1, 0]
    finally:
        engine.version = 3


def test_a_session_whose_first_prompt_differs_from_its_groups_fails_and_drops_the_group(served):
    prompt = served["task"].prompts()[4]
    key = ("differ", 4)
    a, b = served["loop"].open(key, 2, prompt)
    ok = client(served, a).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt.text}])  # fmt: skip
    assert ok.choices[0].finish_reason == "stop"  # without tools, the call is plain text
    with pytest.raises(openai.BadRequestError, match="same prompt"):
        client(served, b).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "question 1 ="}])  # fmt: skip
    served["sessions"].end(a, 1.0).result(timeout=HANG_S)
    gen, rewards, dropped, *_ = served["loop"].result(key)
    assert dropped.startswith(f"agent failed: session {b}") and rewards == [1.0, 0.0]


def test_a_stop_fails_the_calls_in_flight_with_503(served):
    sessions = served["sessions"]
    prompt = served["task"].prompts()[5]
    [sid] = served["loop"].open(("stop", 5), 1, prompt)
    sessions.stop("the run is stopping (SIGUSR2)")
    try:
        with pytest.raises(openai.APIStatusError) as info:
            client(served, sid).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt.text}])  # fmt: skip
        assert info.value.status_code == 503 and "stopping" in str(info.value)
    finally:
        sessions.carry_on()
    sessions.end(sid, 1.0).result(timeout=HANG_S)
    assert served["loop"].result(("stop", 5))[2].endswith("ended it without a call")


def test_an_external_agent_claims_a_session_calls_and_ends_it_with_its_reward(served):
    prompt = served["task"].prompts()[6]
    key = ("external", 6)
    [sid] = served["loop"].open(key, 1, prompt)
    r = post(served, "/v1/sessions", {})
    assert r.status_code == 200, r.text
    claimed = r.json()
    assert claimed["session_id"] == sid and claimed["base_url"].endswith(f"/sessions/{sid}/v1")
    assert claimed["row"]["index"] == prompt.index
    assert claimed["row"]["messages"] == [{"role": "user", "content": prompt.text}]
    c = openai.OpenAI(base_url=claimed["base_url"], api_key=served["token"], max_retries=0)
    answer = c.chat.completions.create(model="tiny", messages=claimed["row"]["messages"])
    assert answer.choices[0].finish_reason == "stop"
    for body, status in (({"reward": "x"}, 200), ({"reward": 1.0}, 404), ({}, 400)):
        r = post(served, f"/v1/sessions/{sid}/reward", body)
        assert r.status_code == status, (body, r.text)
    gen, rewards, dropped, *_ = served["loop"].result(key)
    assert "not a finite reward" in dropped  # {"reward": "x"} ended it, as failed


def test_an_external_agent_process_trains_the_tokens_it_was_answered_with(served, tmp_path):
    """The example external agent (``examples/external_agent.py``, its own process) claims
    both sessions of a group and runs the lookup agent on them: each trained sample is the
    template's tokens of the session's final conversation, its model tokens and log-probs
    bit-equal to what the agent's calls were answered with, its tool answers masked out."""
    import shutil
    import subprocess
    import sys

    run_dir = tmp_path / "run"  # its own: the agent reads the gateway and the run's end here
    shutil.copytree(served["root"] / "gateway", run_dir / "gateway")
    prompt = served["task"].prompts()[4]
    key = ("external-process", 4)
    ids = served["loop"].open(key, 2, prompt)
    transcripts = tmp_path / "transcripts.jsonl"
    agent = subprocess.Popen(
        [sys.executable, "examples/external_agent.py", str(run_dir), "--local", "--sessions",
         "2", "--transcripts", str(transcripts)],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        gen, rewards, dropped, prompt_ids, _ = served["loop"].result(key)
        (run_dir / "ranks").mkdir()
        (run_dir / "ranks" / "rank0.json").write_text('{"state": "done"}')  # the run ended
        out, _ = agent.communicate(timeout=HANG_S)
    finally:
        agent.kill()
    assert agent.returncode == 0 and out.strip() == "external agent: 2 sessions ended", out
    assert dropped == "" and len(rewards) == 2
    tokenizer = served["engine"].tokenizer
    by_session = {row["session_id"]: row for row in map(json.loads, transcripts.open())}
    for j, sid in enumerate(ids):
        calls, messages = by_session[sid]["calls"], by_session[sid]["messages"]
        sampled = [t for c in calls for t in c["token_ids"]]
        # what the model wrote, as its tokens say; what the agent sent, as it sent it
        said = [tokenizer.decode(c["token_ids"], skip_special_tokens=True) for c in calls]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        conversation = [{"role": "user", "content": messages[0]["content"]},
                        {"role": "assistant", "content": said[0]},
                        {"role": "tool", "content": messages[2]["content"]},
                        {"role": "assistant", "content": said[1]}]  # fmt: skip
        check_trained(served, gen, prompt_ids, j, conversation, sampled)
        # the last call's context and answer are the trained row, log-probs included
        length = int(gen.response_lengths[j])
        last = calls[-1]
        row = list(prompt_ids) + gen.response_ids[j, :length].tolist()
        assert last["prompt_token_ids"] + last["token_ids"] == row
        mask = gen.loss_mask[j, :length].astype(bool)
        logged = np.asarray([lp for c in calls for lp in c["token_logprobs"]], np.float32)
        assert np.array_equal(gen.log_probs[j, :length][mask], logged)


def test_an_external_agent_that_cannot_finish_fails_its_session_and_the_group_is_dropped(served):
    """``{"error": ...}`` ends a claimed session as failed: its group is dropped with the
    agent's words once its other sessions end, not after gateway.agent_timeout_s."""
    prompt = served["task"].prompts()[2]
    key = ("external-error", 2)
    a, b = served["loop"].open(key, 2, prompt)
    claimed = [post(served, "/v1/sessions", {}).json()["session_id"] for _ in range(2)]
    assert sorted(claimed) == sorted([a, b])
    c = client(served, a)
    answer = c.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": prompt.text}])  # fmt: skip
    assert answer.choices[0].finish_reason == "stop"
    r = post(served, f"/v1/sessions/{b}/reward", {"error": "ConnectError: its tool is down"})
    assert r.status_code == 200, r.text
    assert post(served, f"/v1/sessions/{b}/reward", {"reward": 1.0}).status_code == 404
    assert post(served, f"/v1/sessions/{a}/reward", {"reward": 1.0}).status_code == 200
    gen, rewards, dropped, *_ = served["loop"].result(key)
    assert dropped == f"agent failed: session {b}: its agent failed: ConnectError: its tool is down"


def test_a_resumed_session_is_answered_from_its_recording_until_its_calls_go_past_it(served):
    """After a resume, a cut session's agent that calls as it did before the stop is
    answered from the checkpoint's recording: the same tokens, log-probs and versions (v3,
    while the engine is at v4: nothing generated again); its next call, past the
    recording, and its group's other session (which had not called) are generated. A
    group whose first call renders another prompt than the recording's generates anew,
    and the recording's tokens are counted as thrown away."""
    engine, sessions, loop = served["engine"], served["sessions"], served["loop"]
    prompt = served["task"].prompts()[3]
    first = engine.tokenizer.decode(engine.encode(prompt.text), skip_special_tokens=True)
    messages = [{"role": "user", "content": first}]
    sid, other = loop.open(("before", 3), 2, prompt)
    c = client(served, sid)
    before = c.chat.completions.create(
        model="tiny", messages=messages, tools=[LOOKUP], parallel_tool_calls=False
    )
    recorded = loop.cut(("before", 3))  # the stop: sid waits for its agent's next call
    assert recorded.sofar.response_lengths.tolist() == [2, 0]
    replayed, discarded = sessions.replayed_calls, sessions.discarded_tokens
    try:
        engine.version = 4
        assert loop.open(("resumed", 3), 2, prompt, recorded) == [sid, other]  # same ids
        again = c.chat.completions.create(
            model="tiny", messages=messages, tools=[LOOKUP], parallel_tool_calls=False
        )
        assert again.choices[0].model_extra == before.choices[0].model_extra  # ids, log-probs
        assert again.choices[0].model_extra["token_versions"] == [3, 3]  # and v3: replayed
        assert again.choices[0].message == before.choices[0].message
        assert sessions.replayed_calls == replayed + 1
        call = again.choices[0].message
        messages += [call.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "1"}]  # fmt: skip
        past = c.chat.completions.create(
            model="tiny", messages=messages, tools=[LOOKUP], parallel_tool_calls=False
        )
        assert past.choices[0].model_extra["token_versions"] == [4]  # generated: EOS
        fresh = client(served, other).chat.completions.create(
            model="tiny", messages=messages[:1], tools=[LOOKUP], parallel_tool_calls=False)  # fmt: skip
        assert fresh.choices[0].model_extra["token_versions"] == [4, 4]
        for s in (sid, other):
            sessions.end(s, 1.0).result(timeout=HANG_S)
        gen, rewards, dropped, *_ = loop.result(("resumed", 3))
        assert dropped == "" and gen.versions[0, : gen.response_lengths[0]].tolist()[:2] == [3, 3]
        # the same recording, and a first call that renders another prompt
        [sid, other] = loop.open(("differs", 3), 2, prompt, recorded)
        answer = client(served, sid).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "question ="}], tools=[LOOKUP], parallel_tool_calls=False)  # fmt: skip
        assert answer.choices[0].model_extra["token_versions"] == [4, 4]
        assert sessions.replayed_calls == replayed + 1
        assert sessions.discarded_tokens == discarded + 2
        sessions.end(sid, 1.0).result(timeout=HANG_S)
        sessions.end(other, {"error": "not run"}).result(timeout=HANG_S)
        loop.result(("differs", 3))
    finally:
        engine.version = 3


def test_a_claim_with_every_session_taken_gets_429_with_the_count(served):
    from fastapi.testclient import TestClient

    engine = served["engine"]
    sessions = Sessions(engine.tokenizer, engine.eos_id, WIDTH, 16, timeout_s=HANG_S)
    app = make_app(sessions, "t", "tiny", Fields({}), 4096, claim_wait_s=30.0)
    auth = {"Authorization": "Bearer t"}
    r = TestClient(app).post("/v1/sessions", json={"wait_s": 0}, headers=auth)
    assert r.status_code == 429 and "0 sessions in flight" in r.json()["error"]["message"]
    for bad in ({"wait_s": "soon"}, {"wait_s": -1}, [], {"wait_s": float("nan")}):
        r = TestClient(app).post("/v1/sessions", content=json.dumps(bad), headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "wait_s", (bad, r.text)


def test_a_turn_that_fills_the_room_is_answered_and_the_group_waits_for_the_reward(served):
    """The engine finishes the group in the step that fills the room: the call still gets
    its answer ("length"), and the group is sent only once the agent gave its reward."""
    prompt = served["task"].prompts()[7]
    key = ("room", 7)
    [sid] = served["loop"].open(key, 1, prompt)
    c = client(served, sid)
    answer = c.completions.create(model="tiny", prompt="question")
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.text.split() == ["question"] * WIDTH
    assert key not in served["loop"].done  # held: the agent has not ended its session
    # a call after it: the session's room is used up, so its turn ends before it starts
    full = c.completions.create(model="tiny", prompt="question" + choice.text + " 1")
    assert full.choices[0].finish_reason == "length" and full.choices[0].text == ""
    assert full.choices[0].model_extra["token_ids"] == []
    served["sessions"].end(sid, 0.25).result(timeout=HANG_S)
    gen, rewards, dropped, *_ = served["loop"].result(key)
    assert rewards == [0.25] and dropped == "" and gen.response_lengths.tolist() == [WIDTH]


def test_a_group_the_engine_finished_is_cut_with_its_tokens_and_replayed_after_a_resume(
    served,
):
    """A stop that finds a group whose turns filled the room, its reward not yet given: the
    checkpoint keeps its tokens, and after the resume the same call is answered from them
    (v3 while the engine is at v4), not generated again."""
    engine, sessions, loop = served["engine"], served["sessions"], served["loop"]
    prompt = served["task"].prompts()[6]
    [sid] = loop.open(("held", 6), 1, prompt)
    c = client(served, sid)
    before = c.completions.create(model="tiny", prompt="question")
    assert before.choices[0].finish_reason == "length"
    recorded = loop.cut(("held", 6))
    assert recorded.sofar.response_lengths.tolist() == [WIDTH] and recorded.finished.all()
    replayed = sessions.replayed_calls
    try:
        engine.version = 4
        assert loop.open(("held-resumed", 6), 1, prompt, recorded) == [sid]
        again = c.completions.create(model="tiny", prompt="question")
        assert again.choices[0].model_extra == before.choices[0].model_extra
        assert again.choices[0].model_extra["token_versions"] == [3] * WIDTH
        assert again.choices[0].finish_reason == "length"
        assert sessions.replayed_calls == replayed + 1
        sessions.end(sid, 0.5).result(timeout=HANG_S)
        gen, rewards, dropped, *_ = loop.result(("held-resumed", 6))
        assert rewards == [0.5] and dropped == "" and gen.versions.tolist() == [[3] * WIDTH]
    finally:
        engine.version = 3


def test_max_tokens_stops_the_calls_turn_and_the_session_goes_on(served):
    """A call's ``max_tokens`` ends its turn there ("length", the response waits for the
    next call, which continues the sequence); a bad one is refused and changes nothing."""
    prompt = served["task"].prompts()[7]
    key = ("limit", 7)
    [sid] = served["loop"].open(key, 1, prompt)
    c = client(served, sid)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be a positive integer"):
        c.completions.create(model="tiny", prompt="question", max_tokens=0)
    first = c.completions.create(model="tiny", prompt="question", max_tokens=3)
    choice = first.choices[0]
    assert choice.finish_reason == "length" and choice.text.split() == ["question"] * 3
    more = c.completions.create(model="tiny", prompt="question" + choice.text + " 1",
                                max_tokens=WIDTH)  # fmt: skip
    eos = served["engine"].eos_id
    assert more.choices[0].finish_reason == "stop"
    assert more.choices[0].model_extra["token_ids"] == [eos]
    served["sessions"].end(sid, 0.5).result(timeout=HANG_S)
    gen, rewards, dropped, *_ = served["loop"].result(key)
    length = int(gen.response_lengths[0])
    assert dropped == "" and gen.loss_mask[0, :length].tolist() == [1, 1, 1, 0, 1]


def test_a_tool_call_that_leaves_no_room_for_its_answer_ends_with_length(served):
    """The agent must not answer a call it has no room for: the finish reason says
    "length" (the call is still shown), whether the room ended inside the call or right
    after its end of turn."""
    from hpc_asyncppo.rollout.gateway.chat import Conversation

    engine = served["engine"]
    conversation = Conversation(engine.tokenizer, "s1-e0-p0-r0")
    conversation.first([{"role": "user", "content": "question 1 ="}], [LOOKUP])
    call = engine.encode(" ".join(CALL))
    assert conversation.answer(call, cut=False, room_left=True).finish_reason == "tool_calls"
    for cut in (True, False):
        full = conversation.answer(call + [engine.eos_id] * (not cut), cut,
                                   room_left=False)  # fmt: skip
        assert full.finish_reason == "length" and full.message["tool_calls"][0]["name"] == "lookup"
