"""The rollout rank's weight state (``rollout/engine_weights.py``) alone, on a fake engine:
a sync with and without in-flight updates and partial rollout, a regroup, an engine that
dies during a load and its restart, the digests' check. The engine's real members (the hf
engine's receiver, vLLM's workers) are tested in test_hf_engine.py and test_vllm_engine.py;
the rank around it in test_rollouter.py."""

from __future__ import annotations

import threading

import pytest

from hpc_asyncppo.config import load_config
from hpc_asyncppo.rollout.engine import EngineDied
from hpc_asyncppo.rollout.engine_weights import EngineWeights
from hpc_asyncppo.runlog import read_jsonl
from hpc_asyncppo.transport.weight_group import WeightGroupSpec
from hpc_asyncppo.transport.weights import Background, WeightUpdate
from tests.harness import HANG_S

SPEC = WeightGroupSpec("127.0.0.1", 0, 2, "gloo", 10.0)


class Engine:
    """What the owner calls of an engine, recorded in ``calls``. ``staged``: it receives a
    sync on a side thread (the hf engine's in-flight updates), which completes once
    ``arrive`` is set. With ``dead`` set every call raises ``EngineDied``."""

    def __init__(self, staged: bool = False, digests: tuple[str, ...] = ("d",)):
        self.stages_weights = staged
        self.calls: list[tuple] = []
        self.arrive = threading.Event()
        self.dead = False
        self.digests = list(digests)

    def _call(self, *call) -> None:
        if self.dead:
            raise EngineDied("the fake engine's process died (signal SIGKILL)")
        self.calls.append(call)

    def join_weights(self, spec: WeightGroupSpec, first_rank: int) -> None:
        self._call("join", spec.generation, first_rank)

    def update_weights(self, expected: int, digest: bool = False) -> WeightUpdate:
        self._call("update", expected)
        return WeightUpdate(expected, self.digests, 0.5)

    def receive_staged(self, staging: dict) -> Background:
        self._call("receive")
        return Background(lambda: self.arrive.wait(HANG_S) and "received", "fake receive")

    def load_staged(self, expected, received, staging, digest=False) -> WeightUpdate:
        assert received == "received"
        self._call("load", expected)
        return WeightUpdate(expected, self.digests, 0.01)


def owner(tmp_path, engine, *overrides: str):
    """The owner of ``engine``'s weights, and the record of its hooks: "before" when the
    weights are about to change, ("loaded", version) once they have."""
    cfg = load_config(overrides=list(overrides))
    hooks: list = []
    weights = EngineWeights(
        cfg, 0, engine, SPEC, 0, tmp_path,
        before_load=lambda: hooks.append("before"),
        loaded=lambda update, start, wall: hooks.append(("loaded", update.version)),
    )  # fmt: skip
    return weights, hooks


def test_a_sync_runs_the_hook_before_the_weights_change_and_after(tmp_path):
    engine = Engine()
    weights, hooks = owner(tmp_path, engine)
    assert engine.calls == [("join", 0, 0)] and not weights.held
    weights.sync(0)
    weights.sync(1)
    assert engine.calls[1:] == [("update", 0), ("update", 1)]
    assert hooks == ["before", ("loaded", 0), "before", ("loaded", 1)]
    assert weights.held and weights.version == weights.announced == 1
    assert weights.pause_s == 0.5


@pytest.mark.parametrize("partial_rollout", [False, True])
def test_an_inflight_sync_loads_between_steps_once_received(tmp_path, partial_rollout):
    """fully_async with in-flight updates: the first sync loads at once (nothing to
    generate under yet); later ones arrive on a side thread and load once complete. Without
    partial rollout the groups in flight finish first (no new group starts meanwhile); with
    it they are cut at once."""
    engine = Engine(staged=True)
    weights, hooks = owner(
        tmp_path, engine, "async_training.mode=fully_async",
        "async_training.inflight_weight_update=true",
        f"async_training.partial_rollout={str(partial_rollout).lower()}",
        "rollout.hf_step_tokens=8",  # the hf engine cuts groups between two such steps
    )  # fmt: skip
    weights.sync(0)
    assert engine.calls[-1] == ("update", 0)
    weights.sync(1)
    assert engine.calls[-1] == ("receive",) and weights.version == 0
    weights.load_pending(groups_in_flight=True)  # still arriving: nothing loads
    assert weights.version == 0 and not weights.draining
    engine.arrive.set()
    weights.pending.result(HANG_S)  # received (the side thread ended)
    assert weights.draining is not partial_rollout
    weights.load_pending(groups_in_flight=True)
    if not partial_rollout:  # the groups in flight finish first
        assert weights.version == 0
        weights.load_pending(groups_in_flight=False)
    assert engine.calls[-1] == ("load", 1) and weights.version == 1
    assert hooks[-2:] == ["before", ("loaded", 1)] and not weights.draining


def test_an_inflight_sync_with_no_group_in_flight_is_waited_for(tmp_path):
    """Nothing in flight to overlap the sync with: the rank waits for it, and the groups it
    starts next are sampled under the new weights, not a whole batch under the old."""
    engine = Engine(staged=True)
    weights, _ = owner(tmp_path, engine, "async_training.mode=fully_async",
                       "async_training.inflight_weight_update=true")  # fmt: skip
    weights.sync(0)
    weights.sync(1)
    assert engine.calls[-1] == ("receive",) and weights.version == 0
    arrives = threading.Timer(0.5, engine.arrive.set)  # (a late arrival only hides a bug)
    arrives.start()
    weights.load_pending(groups_in_flight=False)
    assert engine.calls[-1] == ("load", 1) and weights.version == 1
    arrives.join()


def test_a_regroup_loads_the_sync_received_before_then_joins_the_next_generation(tmp_path):
    engine = Engine(staged=True)
    weights, _ = owner(
        tmp_path, engine, "async_training.mode=fully_async",
        "async_training.inflight_weight_update=true",
    )  # fmt: skip
    weights.sync(0)
    weights.sync(1)  # on the side thread
    engine.arrive.set()
    weights.regroup(1)
    assert engine.calls[-3:] == [("receive",), ("load", 1), ("join", 1, 0)]
    assert weights.spec.generation == 1 and weights.version == 1


def test_an_engine_that_dies_during_a_load_is_out_of_the_group_until_regroup(tmp_path):
    """The engine dies as a sync loads: the version stays the last loaded; once the rank
    says so (``died``) the engine holds no weights, a SYNC announced before the leader
    knew is void, the restarted engine joins at REGROUP and holds weights again at the
    next sync, which ends the restart's time."""
    engine = Engine()
    weights, hooks = owner(tmp_path, engine, "rollout.max_engine_restarts=1")
    weights.sync(0)
    engine.dead = True
    with pytest.raises(EngineDied) as death:
        weights.sync(1)
    assert weights.version == 0 and weights.announced == 1
    weights.died(death.value)
    assert not weights.held and weights.out_of_group and weights.restarts == 1
    new = Engine()
    weights.attach(new)
    weights.sync(2)  # void: its broadcast broke on the dead engine
    assert new.calls == [] and weights.announced == 2 and not weights.held
    weights.regroup(1)
    weights.sync(2)
    assert new.calls == [("join", 1, 0), ("update", 2)]
    assert weights.held and weights.version == 2 and weights.restart_s > 0
    assert hooks == ["before", ("loaded", 0), "before", "before", ("loaded", 2)]
    with pytest.raises(
        RuntimeError, match=r"restarted 1 times already: rollout.max_engine_restarts=1"
    ):
        weights.died(EngineDied("again"))


def test_members_that_loaded_different_weights_fail_the_rank_and_equal_ones_are_recorded(
    tmp_path,
):
    (tmp_path / "weights").mkdir()
    weights, _ = owner(tmp_path, Engine(digests=("a", "a")), "trainer.record_weight_digests=true")
    weights.sync(0)
    assert [
        (r["version"], r["digest"]) for r in read_jsonl(tmp_path / "weights" / "rank0.jsonl")
    ] == [(0, "a")]
    split, _ = owner(tmp_path, Engine(digests=("a", "b")), "trainer.record_weight_digests=true")
    with pytest.raises(RuntimeError, match=r"members loaded different weights at version 0"):
        split.sync(0)
