"""The rollout rank's loop, driven in one process: a scripted leader's control messages (a
fake ``SampleSender``) and an engine that finishes groups when told to. Checks what the
loop does on each message: the first weights before any group, credits turned into groups
up to ``prompts_per_generate``, a checkpoint part with the cut groups and the unused draws,
a sync that finishes the groups in flight first (no partial rollout), STOP, and an engine
that dies under the rank (restarted in place). The part is written with the real
checkpoint code; only MPI and the model are replaced."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.checkpoint.store import CheckpointReader
from hpc_asyncppo.config import load_config
from hpc_asyncppo.models.tiny import TinyTokenizer
from hpc_asyncppo.rollout.engine import EngineDied
from hpc_asyncppo.rollout.generation import Generation, PartialGroup
from hpc_asyncppo.rollout.rollouter import Rollouter
from hpc_asyncppo.rollout.validation import Validator
from hpc_asyncppo.tasks import next_digit
from hpc_asyncppo.transport.arrays import unpack_arrays
from hpc_asyncppo.transport.samples import Control
from hpc_asyncppo.transport.weight_group import WeightGroupSpec
from hpc_asyncppo.transport.weights import WeightUpdate

N = 2  # responses per group
LENGTH = 3  # tokens per response


class ScriptedLeader:
    """A SampleSender whose control messages come from a script, one batch per poll; the
    script's callables run at their turn (the test's hand on the engine). STOP at the end."""

    def __init__(self, script: list):
        self.script = deque(script)
        self.sent: list = []
        self.states: list[tuple[np.ndarray, dict]] = []
        self.controls: list[tuple[Control, int]] = []  # what the rank told the leader
        self.validations: list[tuple[dict, dict]] = []  # (arrays, meta) of each result
        self.finished = False

    @property
    def groups_sent(self) -> int:
        return len(self.sent)

    def poll_control(self):
        if not self.script:
            return [(Control.STOP, 0)]
        batch = self.script.popleft()
        if callable(batch):
            batch()
            return []
        return batch

    def send(self, group) -> None:
        self.sent.append(group)

    def send_state(self, state: np.ndarray, timeout_s: float) -> None:
        self.states.append(unpack_arrays(state))

    def send_control(self, kind, value=0) -> None:
        self.controls.append((kind, value))

    def send_validation(self, result) -> None:
        self.validations.append(unpack_arrays(result))

    def finish(self, timeout_s: float) -> None:
        self.finished = True


class FakeEngine:
    """Every submitted group finishes at the next ``step`` unless ``hold`` is set; then it
    stays in flight until an ``interrupt`` makes it a cut group (one token per response).
    With ``dead`` set, every call but ``unfinished`` and ``close`` raises ``EngineDied``."""

    stages_weights = False

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_id = self.pad_id = 0
        self.should_stop = None
        self.running: dict = {}  # key -> prompt
        self.hold = False
        self.loaded: list[int] = []
        self.version = -1
        self.closed = False
        self.dead = False
        self.joined: list = []  # the weight-group specs it joined
        self.resumed: dict = {}  # key -> the partial group it continued
        self.submitted: list = []  # (key, the version it held) of each group submitted

    @property
    def in_flight(self) -> int:
        return len(self.running)

    def alive(self) -> None:
        if self.dead:
            raise EngineDied("the fake engine's process died (signal SIGKILL)")

    def join_weights(self, spec, first_rank) -> None:
        self.alive()
        self.joined.append(spec)

    def update_weights(self, expected: int, digest: bool = False) -> WeightUpdate:
        self.alive()
        self.loaded.append(expected)
        self.version = expected
        return WeightUpdate(expected, [""], 0.0)

    def submit(self, key, prompt, n, temperature=None) -> None:
        self.alive()
        assert n == N
        self.running[key] = prompt
        self.submitted.append((key, self.version))

    def resume(self, key, partial) -> None:
        self.alive()
        self.resumed[key] = partial
        self.running[key] = partial.prompt

    def step(self):
        self.alive()
        if self.hold:
            return []
        done = [(key, self.generation(LENGTH)) for key in self.running]
        self.running.clear()
        return done

    def generation(self, length: int) -> Generation:
        return Generation(
            np.full((N, length), 7, np.int32), np.full(N, length, np.int32),
            np.full((N, length), -0.5, np.float32), np.full((N, length), self.version, np.int32),
        )  # fmt: skip

    def interrupt(self) -> None:
        self.alive()

    def unfinished(self):
        return [
            (key, PartialGroup(list(prompt), self.generation(1), np.zeros(N, bool)))
            for key, prompt in self.running.items()
        ]

    def decode(self, ids) -> str:
        return self.tokenizer.backend.decode([int(i) for i in ids])

    def close(self) -> None:
        self.closed = True


def rollouter(tmp_path, tiny_model_dir, script, *overrides: str, engines: list | None = None):
    """The rank, its engine and the scripted leader; ``engines`` (if given) collects every
    engine built, the restarts' included."""
    cfg = load_config(
        overrides=[
            f"model.path={tiny_model_dir}",
            f"rollout.n={N}",
            "rollout.prompts_per_generate=2",
            "async_training.partial_rollout=false",
            *overrides,
        ]  # fmt: skip
    )
    topo = SimpleNamespace(
        world_rank=0, rollout_ranks=1, device=torch.device("cpu"), inter=None,
        weights=WeightGroupSpec("127.0.0.1", 0, 2, "gloo", 10.0), workers_per_rank=1,
    )  # fmt: skip
    built = engines if engines is not None else []

    def new_engine() -> FakeEngine:
        built.append(FakeEngine(TinyTokenizer(tiny_model_dir)))
        return built[-1]

    engine = new_engine()
    leader = ScriptedLeader(script)
    (tmp_path / "logs").mkdir(exist_ok=True)
    rank = Rollouter(cfg, topo, tmp_path, engine=engine, sender=leader, new_engine=new_engine)
    return rank, engine, leader


def test_the_loop_answers_credits_syncs_a_checkpoint_and_stop(tmp_path, tiny_model_dir):
    engine_hold = []

    def hold(on: bool):
        return lambda: engine_hold[0].__setattr__("hold", on)

    script = [
        [(Control.CREDIT, 0), (Control.CREDIT, 1)],  # before any weights: nothing starts
        [(Control.SYNC, 0)],
        [],  # the two groups start and finish under version 0
        hold(True),
        [(Control.CREDIT, 2), (Control.CREDIT, 3), (Control.CREDIT, 4)],
        [],  # 2 and 3 start (prompts_per_generate), 4 waits
        [(Control.CHECKPOINT, 7)],
        hold(False),
        [(Control.SYNC, 1)],  # no partial rollout: 2 and 3 finish under version 0 first
    ]
    rank, engine, leader = rollouter(tmp_path, tiny_model_dir, script)
    engine_hold.append(engine)
    rank.run()

    assert engine.loaded == [0, 1]
    sent = [(g.prompt_index, g.param_version_start) for g in leader.sent]
    prompts = [p.index for p in rank.prompts]
    assert sent == [(prompts[d], 0) for d in (0, 1, 2, 3)]
    assert all(g.param_version_end == 0 for g in leader.sent)

    # the checkpoint: the two groups in flight, cut, in the part; the draw not started back
    (arrays, report) = leader.states[0]
    assert arrays["unused"].tolist() == [4]
    assert report["partial_groups"] == 2 and report["groups_sent"] == 2
    part = protocol.step_dir(tmp_path, 7) / protocol.rollout_part(0)
    with CheckpointReader(part) as reader:
        cut = reader.get("partial")
    assert sorted(int(t["index"]) for t in cut) == [2, 3]
    assert all(int(t["version_start"]) == 0 for t in cut)
    # draw 4's credit was void: it never started, even after the sync
    assert not engine.running and engine.closed and leader.finished


def test_a_resumed_cut_group_starts_again_under_new_weights_without_partial_rollout(
    tmp_path, tiny_model_dir
):
    sofar = Generation(
        np.full((N, 1), 7, np.int32), np.ones(N, np.int32),
        np.full((N, 1), -0.5, np.float32), np.zeros((N, 1), np.int32),
    )  # fmt: skip
    cut = (0, 5, 0, PartialGroup([1, 2], sofar, np.zeros(N, bool)))
    script = [[(Control.SYNC, 3)], []]
    rank, engine, leader = rollouter(tmp_path, tiny_model_dir, script)
    rank.resumed = [cut]
    rank.run()
    # sampled by version 0, the weights are version 3: generated again from the prompt
    assert [(g.prompt_index, g.param_version_start) for g in leader.sent] == [
        (rank.prompts[5].index, 3)
    ]
    assert rank.tokens_regenerated == N


def test_a_dead_engine_is_restarted_and_its_groups_continue_from_their_tokens(
    tmp_path, tiny_model_dir
):
    """The engine dies with two groups mid-response: the rank says REJOIN at once, starts a
    new engine, writes the two groups (still cut) into a checkpoint asked for meanwhile,
    ignores the sync announced before the leader knew, joins the weight group's next
    generation on REGROUP, and once the weights are back continues the groups from their
    tokens (same version: kept even without partial rollout)."""
    engines: list[FakeEngine] = []

    def first(attr: str, value):
        return lambda: setattr(engines[0], attr, value)

    script = [
        [(Control.CREDIT, 0), (Control.CREDIT, 1)],
        first("hold", True),
        [(Control.SYNC, 0)],  # 0 and 1 start and stay in flight
        first("dead", True),
        [(Control.CREDIT, 2)],  # the next step raises EngineDied: restart
        [(Control.CHECKPOINT, 4)],  # the credit of 2 (not started) is void
        [(Control.SYNC, 1)],  # announced on the old group: void
        [(Control.REGROUP, 1)],
        [(Control.SYNC, 0)],  # the same version again
        [],
        [],
    ]
    rank, engine, leader = rollouter(tmp_path, tiny_model_dir, script, engines=engines)
    rank.run()

    assert len(engines) == 2 and engines[0].closed and engines[1].closed
    old, new = engines
    assert leader.controls == [(Control.REJOIN, 1)]
    assert old.loaded == [0] and new.loaded == [0]
    assert [spec.generation for spec in new.joined] == [1]
    # the groups of the dead engine continued in the new one from their tokens so far
    assert sorted(new.resumed) == [(0, 0), (0, 1)]
    assert all(p.tokens == N for p in new.resumed.values())
    assert rank.tokens_regenerated == 0
    prompts = [p.index for p in rank.prompts]
    sent = sorted((g.prompt_index, g.param_version_start) for g in leader.sent)
    assert sent == sorted((prompts[d], 0) for d in (0, 1))
    assert {g.engine_restarts for g in leader.sent} == {1}
    assert all(g.engine_restart_s > 0 for g in leader.sent)
    # the checkpoint taken while the engine was out: both groups cut, with their tokens
    (arrays, report) = leader.states[0]
    assert report["partial_groups"] == 2 and arrays["unused"].tolist() == [2]
    with CheckpointReader(protocol.step_dir(tmp_path, 4) / protocol.rollout_part(0)) as reader:
        cut = reader.get("partial")
    assert sorted(int(t["index"]) for t in cut) == [0, 1]
    assert all(int(t["response_lengths"].sum()) == N for t in cut)


def test_an_engine_dying_past_max_engine_restarts_fails_the_rank(tmp_path, tiny_model_dir):
    engines: list[FakeEngine] = []

    def kill(i: int):
        return lambda: setattr(engines[i], "dead", True)

    script = [
        [(Control.CREDIT, 0)],
        lambda: setattr(engines[0], "hold", True),
        [(Control.SYNC, 0)],
        kill(0),
        [],
        [(Control.REGROUP, 1)],
        lambda: setattr(engines[1], "hold", True),
        [(Control.SYNC, 0)],
        kill(1),
        [],
    ]
    rank, _, leader = rollouter(
        tmp_path, tiny_model_dir, script, "rollout.max_engine_restarts=1", engines=engines
    )
    with pytest.raises(
        RuntimeError, match=r"restarted 1 times already: rollout.max_engine_restarts=1"
    ):
        rank.run()
    assert leader.controls == [(Control.REJOIN, 1)]


VAL_PROMPTS = 3  # two engine steps of val groups at prompts_per_generate=2


@pytest.mark.parametrize("back", ["same", "newer", "none"])
def test_a_validation_asked_for_while_the_engine_restarts_is_of_the_announced_weights(
    tmp_path, tiny_model_dir, back
):
    """The engine dies as the weights of v1 arrive (that sync is void), and VALIDATE comes
    while it restarts. The validation is of v1, the version the leader announced: run on
    v1 when the leader sends v1 again ("same"); void when the weights come back as v2 (it
    trained past them, "newer") or never (STOP first, "none"), rather than generated on
    other weights (the restarted engine's own) and reported as v1 or v0."""
    engines: list[FakeEngine] = []
    val = tmp_path / "val.jsonl"
    next_digit.write_prompts(val, next_digit.held_out_prompts(VAL_PROMPTS))
    script = [
        [(Control.SYNC, 0)],
        lambda: setattr(engines[0], "dead", True),
        [(Control.SYNC, 1)],  # its loading raises EngineDied: restart, the sync void
        [(Control.VALIDATE, 2)],
    ]
    if back != "none":
        script += [[(Control.REGROUP, 1)], [(Control.SYNC, {"same": 1, "newer": 2}[back])], []]
    rank, _, leader = rollouter(
        tmp_path, tiny_model_dir, script, f"data.val={val}", f"rollout.val_n={N}", engines=engines
    )
    rank.run()

    assert leader.controls == [(Control.REJOIN, 1)]
    ((arrays, meta),) = leader.validations
    assert meta["step"] == 2 and meta["version"] == 1
    validated = [(key, v) for e in engines for key, v in e.submitted if Validator.owns(key)]
    if back == "same":
        assert "void" not in meta and arrays["rewards"].shape == (VAL_PROMPTS, N)
        assert len(validated) == VAL_PROMPTS and {v for _, v in validated} == {1}
        assert all(key in dict(engines[1].submitted) for key, _ in validated)
    else:
        assert meta["void"] and arrays["rewards"].shape == (0, N)
        assert validated == []


def test_a_rank_whose_share_of_val_prompts_is_empty_answers_at_once(tmp_path, tiny_model_dir):
    """More rollout ranks than val prompts: the last rank validates nothing and says so
    (an empty result, built without the arrays of a group it never generated)."""
    val = tmp_path / "val.jsonl"
    next_digit.write_prompts(val, next_digit.held_out_prompts(VAL_PROMPTS))
    cfg = load_config(
        overrides=[f"model.path={tiny_model_dir}", f"data.val={val}", f"rollout.val_n={N}"]
    )
    leader = ScriptedLeader([])
    validator = Validator(
        cfg, VAL_PROMPTS, VAL_PROMPTS + 1, FakeEngine(TinyTokenizer(tiny_model_dir)), leader
    )
    validator.request(4, 2)
    ((arrays, meta),) = leader.validations
    assert meta["step"] == 4 and meta["version"] == 2 and "void" not in meta
    assert arrays["rewards"].shape == (0, N) and arrays["prompt_index"].size == 0


def test_a_multi_turn_group_keeps_its_observations_through_a_checkpoint(tmp_path):
    """A response with a tool's answer inside, cut and written into a rollout part, read
    back and continued: the observation is where it was (log-prob 0, version -1, loss
    mask 0), and the group sent at the end carries the mask; a single-turn group none."""
    from hpc_asyncppo.checkpoint.store import load_checkpoint, save_checkpoint
    from hpc_asyncppo.rollout.cut_groups import CutGroups
    from hpc_asyncppo.rollout.generation import Response, ResponseGroup

    first, second = Response(), Response()
    for r, version in ((first, 3), (second, 3)):
        r.tokens, r.log_probs, r.versions = [5, 6], [-0.1, -0.2], [version, version]
    first.observe([9, 9, 9])  # a tool's answer, after the model's call
    first.tokens, first.log_probs, first.versions = (
        first.tokens + [7], first.log_probs + [-0.3], first.versions + [4]
    )  # fmt: skip
    group = ResponseGroup([1, 2], [first, second])
    tree = CutGroups([(0, 5, 3, group.partial(LENGTH * 3, 0))]).state_dict()
    save_checkpoint(tmp_path / "part.h5", tree, {})
    back = CutGroups()
    back.load_state_dict(load_checkpoint(tmp_path / "part.h5")[0])
    ((*_, partial),) = back.groups
    again = ResponseGroup.of(partial)
    assert again.responses[0].observations == [(2, 5)] and again.responses[1].observations == []
    gen = again.generation(LENGTH * 3, 0)
    assert gen.loss_mask[0, :6].tolist() == [1, 1, 0, 0, 0, 1]
    assert gen.log_probs[0, 2:5].tolist() == [0.0] * 3 and gen.versions[0, 2:5].tolist() == [-1] * 3
    assert gen.loss_mask[1].all()
    plain = ResponseGroup([1, 2], [second]).generation(LENGTH, 0)
    assert plain.loss_mask is None
    single = CutGroups([(0, 5, 3, ResponseGroup([1], [second]).partial(3, 0))]).state_dict()
    assert "loss_mask" not in single["partial"][0]
