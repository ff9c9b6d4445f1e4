"""Multi-turn trajectories (``rollout/turns.py``) on the tiny lookup model's real tokenizer
and chat template, the real lookup tool and tool runner, and the real transformers engine:
a call comes back as an observation rendered by the chat template (holes in the loss
mask), turns and room end trajectories, a hanging tool costs its timeout while the engine
generates the other groups, and a checkpoint's state brings a trajectory back with its
calls run again. vLLM continuing from observations: tests/rollout/test_vllm_engine.py."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_asyncppo.config import (
    DataConfig,
    ModelConfig,
    MultiTurnConfig,
    RolloutConfig,
    TinyModelConfig,
)
from hpc_asyncppo.models.tiny import build_tiny_model
from hpc_asyncppo.rollout.generation import Response, ResponseGroup
from hpc_asyncppo.rollout.hf_engine import HFEngine
from hpc_asyncppo.rollout.turns import Turns, decode_state, encode_state, truncate
from hpc_asyncppo.tasks.tool_lookup import (
    CALL,
    CHAT_TEMPLATE,
    LookupTool,
    ToolLookupTask,
    lookup_tool_config,
)
from hpc_asyncppo.tools.base import load_tools

WIDTH = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    task = ToolLookupTask(DataConfig(num_prompts=8))
    out = tmp_path_factory.mktemp("lookup_model")
    return build_tiny_model(out, task.vocabulary(), TinyModelConfig(), 3, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def engine(model_dir) -> HFEngine:
    return HFEngine(
        ModelConfig(path=str(model_dir)), RolloutConfig(response_length=WIDTH), torch.device("cpu")
    )


def make_turns(engine, tmp_path, delay="0.0", **cfg) -> tuple[Turns, dict]:
    path = tmp_path / "tools.yaml"
    path.write_text(lookup_tool_config(delay))
    tools = load_tools(path)
    config = MultiTurnConfig(enable=True, tool_config_path=str(path), **cfg)
    return Turns(config, engine.tokenizer, tools, engine.eos_id, WIDTH), tools


def ids(engine, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def model_turn(r: Response, tokens: list[int], width: int = WIDTH) -> None:
    """The model's turn as an engine writes it, ended at its last token."""
    r.tokens += tokens
    r.log_probs += [-1.0] * len(tokens)
    r.versions += [0] * len(tokens)
    r.end_turn(width, multi_turn=True)


def settle(turns: Turns, groups: dict, prompts, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while any(r.waiting for g in groups.values() for r in g.responses):
        turns.advance(groups, lambda key: prompts[key[1]])
        assert time.monotonic() < deadline, "no observation came"
        time.sleep(0.01)


def test_a_call_comes_back_through_the_chat_template_and_trains_as_a_hole(engine, tmp_path):
    turns, tools = make_turns(engine, tmp_path)
    task = ToolLookupTask(DataConfig(num_prompts=8))
    prompts = task.prompts()
    assert engine.turn_ends == frozenset()  # the rank sets them: here, by hand
    assert turns.turn_ends == {engine.eos_id, *ids(engine, CALL[1])}
    truth = prompts[3].ground_truth
    r = Response()
    groups = {(0, 3): ResponseGroup([1], [r])}
    model_turn(r, ids(engine, " ".join(CALL)))
    assert r.waiting and not r.finished
    settle(turns, groups, prompts)
    # the template's EOS after an assistant message (the turn stopped at the call), then
    # the tool message: what the model reads before it answers
    words = engine.tokenizer.convert_ids_to_tokens(r.tokens)
    assert words == [*CALL, "<eos>", "<tool_response>", truth]
    assert r.observations == [(2, 5)] and r.runnable
    model_turn(r, ids(engine, f"{truth} <eos>"))
    turns.advance(groups, lambda key: prompts[key[1]])  # no call in that turn: the end
    assert r.finished and not r.waiting
    gen = groups[(0, 3)].generation(WIDTH, engine.pad_id)
    assert gen.loss_mask[0, :7].tolist() == [1, 1, 0, 0, 0, 1, 1]
    assert gen.log_probs[0, 2:5].tolist() == [0.0] * 3 and gen.versions[0, 2:5].tolist() == [-1] * 3
    text = engine.decode(gen.response_ids[0, : gen.response_lengths[0]])
    # the task's 0.9 (the call's two words, the copied answer) and the tool's 0.1
    assert task.reward(prompts[3], text) == pytest.approx(0.9)
    assert turns.finish((0, 3), 1) == [pytest.approx(0.1)]
    assert tools["lookup"].answers == {}  # released
    assert turns.counts["tool_calls"] == 1 and turns.counts["tool_errors"] == 0


def test_turn_limits_and_room_end_trajectories(engine, tmp_path):
    prompts = ToolLookupTask(DataConfig(num_prompts=8)).prompts()
    call = ids(engine, " ".join(CALL))

    turns, _ = make_turns(engine, tmp_path, max_assistant_turns=1)
    r = Response()
    model_turn(r, call)
    turns.advance({(0, 0): ResponseGroup([1], [r])}, lambda key: prompts[0])
    assert r.finished and not r.observations  # its one turn is over: no call made
    assert turns.counts["tool_calls"] == 0

    turns, _ = make_turns(engine, tmp_path, max_user_turns=1)
    r = Response()
    groups = {(0, 0): ResponseGroup([1], [r])}
    model_turn(r, call)
    settle(turns, groups, prompts)
    model_turn(r, call)  # a second call: past max_user_turns
    turns.advance(groups, lambda key: prompts[0])
    assert r.finished and len(r.observations) == 1

    turns, _ = make_turns(engine, tmp_path)
    r = Response()
    groups = {(0, 0): ResponseGroup([1], [r])}
    model_turn(r, ids(engine, "1 2 3 4 5 6") + call)  # 8 tokens: room for 2 of the 3
    settle(turns, groups, prompts)
    assert r.finished and r.observations == [(8, 10)] and len(r.tokens) == WIDTH


def test_tool_answers_are_cut_as_verl_cuts_them():
    text = "abcdefghij"
    assert truncate(text, 20, "middle") == text
    assert truncate(text, 4, "left") == "abcd...(truncated)"
    assert truncate(text, 4, "right") == "(truncated)...ghij"
    assert truncate(text, 4, "middle") == "ab...(truncated)...ij"


def test_a_hanging_tool_costs_its_timeout_while_the_engine_generates_the_others(engine, tmp_path):
    """One response calls a tool that never answers (an hour's delay); while it waits the
    engine goes on generating another group's responses (tokens generated during the wait;
    no speed is assumed: the untrained model may call the tool in that group too); after
    tool_timeout_s the call answers with an error message as its observation, counted as
    a timeout, and the trajectory goes on to its end."""
    turns, _ = make_turns(engine, tmp_path, delay="3600", tool_timeout_s=1.0)
    prompts = ToolLookupTask(DataConfig(num_prompts=8)).prompts()
    engine.turn_ends = turns.turn_ends
    try:
        hung = Response()
        model_turn(hung, ids(engine, " ".join(CALL)))
        engine.groups[(0, 1)] = ResponseGroup([1], [hung])
        engine.submit((0, 2), ids(engine, prompts[2].text), 4)
        others = engine.groups[(0, 2)].responses
        start, finished, beside = time.monotonic(), {}, 0
        while (0, 1) not in finished:
            turns.advance(engine.groups, lambda key: prompts[key[1]])
            before = sum(len(r.tokens) for r in others)
            was_waiting = hung.waiting
            finished.update(engine.step())
            if was_waiting:  # the other group's tokens generated while the call hung
                beside += sum(len(r.tokens) for r in others) - before
            assert time.monotonic() - start < 60, "the hung call never timed out"
        assert beside > 0
        assert hung.finished and hung.observations and time.monotonic() - start >= 1.0
        assert turns.counts["tool_timeouts"] >= 1
    finally:
        engine.turn_ends = frozenset()
        engine.groups.clear()


def test_a_checkpointed_trajectory_comes_back_with_its_tools_state_and_runs_its_call_again(
    engine, tmp_path
):
    """Cut while its call ran (a slow tool): the state goes through the checkpoint's JSON
    bytes; the resumed response waits again (its last token ends the model's turn), the
    tool gets its state back (no create) and the call runs again: the same answer."""
    prompts = ToolLookupTask(DataConfig(num_prompts=8)).prompts()
    turns, tools = make_turns(engine, tmp_path, delay="0.5")
    r = Response()
    groups = {(0, 4): ResponseGroup([1], [r])}
    model_turn(r, ids(engine, " ".join(CALL)))
    turns.advance(groups, lambda key: prompts[key[1]])  # the call is running
    assert r.waiting and tools["lookup"].answers
    partial = groups[(0, 4)].partial(WIDTH, engine.pad_id)
    saved = decode_state(np.frombuffer(encode_state(turns.state((0, 4), 1)), np.uint8).tobytes())

    again, tools = make_turns(engine, tmp_path)  # a new rank after the resume
    group = ResponseGroup.of(partial, again.turn_ends)
    assert group.responses[0].waiting
    again.load((0, 4), group, saved)
    resumed = {(0, 4): group}
    settle(again, resumed, {4: None})  # no prompt needed: the state has the answer
    words = engine.tokenizer.convert_ids_to_tokens(group.responses[0].tokens)
    assert words[-1] == prompts[4].ground_truth
    assert again.finish((0, 4), 1) == [pytest.approx(0.1)]


class OnceOnly(LookupTool):
    """A lookup tool that must not run a call twice (as one that charges, or sends)."""

    rerun_safe = False


def test_a_call_of_a_tool_not_safe_to_rerun_answers_an_error_after_the_resume(engine, tmp_path):
    prompts = ToolLookupTask(DataConfig(num_prompts=8)).prompts()
    config = lookup_tool_config().replace(
        "hpc_asyncppo.tasks.tool_lookup.LookupTool", f"{__name__}.OnceOnly"
    )
    path = tmp_path / "once.yaml"
    path.write_text(config)
    cfg = MultiTurnConfig(enable=True, tool_config_path=str(path))
    turns = Turns(cfg, engine.tokenizer, load_tools(path), engine.eos_id, 64)  # room for two
    r = Response()
    model_turn(r, ids(engine, " ".join(CALL)), 64)  # cut while its call ran
    group = ResponseGroup.of(ResponseGroup([1], [r]).partial(64, engine.pad_id), turns.turn_ends)
    turns.load((0, 5), group, {})
    resumed = {(0, 5): group}
    settle(turns, resumed, prompts)
    response = group.responses[0]
    assert prompts[5].ground_truth not in engine.tokenizer.convert_ids_to_tokens(
        response.tokens[2:]
    )
    assert turns.counts["tool_errors"] == 1 and turns.cut_calls == 1
    # its next turn's call is a new one, and runs
    model_turn(response, ids(engine, " ".join(CALL)), 64)
    settle(turns, resumed, prompts)
    assert response.tokens[-1] == ids(engine, prompts[5].ground_truth)[0]


def test_an_environment_answers_in_plain_text_until_it_ends_the_trajectory(engine, tmp_path):
    """A task with ``respond`` (an environment): after a turn without a call it answers as
    the user, through the chat template, counted against max_user_turns; None ends it."""
    seen = []

    def respond(prompt, text):
        seen.append(text)
        return "3" if len(seen) == 1 else None

    path = tmp_path / "tools.yaml"
    path.write_text(lookup_tool_config())
    cfg = MultiTurnConfig(enable=True, tool_config_path=str(path))
    turns = Turns(cfg, engine.tokenizer, load_tools(path), engine.eos_id, WIDTH, respond)
    prompts = ToolLookupTask(DataConfig(num_prompts=8)).prompts()
    r = Response()
    groups = {(0, 0): ResponseGroup([1], [r])}
    model_turn(r, ids(engine, "5 <eos>"))
    turns.advance(groups, lambda key: prompts[0])
    # the user's answer after the model's EOS: the template's text without that EOS
    assert engine.tokenizer.convert_ids_to_tokens(r.tokens) == ["5", "<eos>", "3"]
    assert r.observations == [(2, 3)] and r.runnable
    model_turn(r, ids(engine, "3 <eos>"))
    turns.advance(groups, lambda key: prompts[0])
    assert r.finished and seen == ["5", "5 3 3"]

    limited = Turns(
        MultiTurnConfig(enable=True, tool_config_path=str(path), max_user_turns=1),
        engine.tokenizer, load_tools(path), engine.eos_id, WIDTH, lambda p, t: "3",
    )  # fmt: skip
    r = Response()
    groups = {(0, 0): ResponseGroup([1], [r])}
    for _ in range(2):
        model_turn(r, ids(engine, "5 <eos>"))
        limited.advance(groups, lambda key: prompts[0])
    assert r.finished and len(r.observations) == 1
