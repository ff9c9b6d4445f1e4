"""The rollout rank's loop, driven in one process: a scripted leader's control messages (a
fake ``SampleSender``) and an engine that finishes groups when told to. Checks what the
loop does on each message: the first weights before any group, credits turned into groups
up to ``prompts_per_generate``, a checkpoint part with the cut groups and the unused draws,
a sync that finishes the groups in flight first (no partial rollout), STOP. The part is
written with the real checkpoint code; only MPI and the model are replaced."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import torch

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.checkpoint.store import CheckpointReader
from hpc_asyncppo.config import load_config
from hpc_asyncppo.models.tiny import TinyTokenizer
from hpc_asyncppo.rollout.generation import Generation, PartialGroup
from hpc_asyncppo.rollout.rollouter import Rollouter
from hpc_asyncppo.transport.arrays import unpack_arrays
from hpc_asyncppo.transport.samples import Control
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

    def send_validation(self, result) -> None:
        raise AssertionError("no validation was asked for")

    def finish(self, timeout_s: float) -> None:
        self.finished = True


class FakeEngine:
    """Every submitted group finishes at the next ``step`` unless ``hold`` is set; then it
    stays in flight until an ``interrupt`` makes it a cut group (one token per response)."""

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

    @property
    def in_flight(self) -> int:
        return len(self.running)

    def join_weights(self, spec, first_rank) -> None:
        pass

    def update_weights(self, expected: int, digest: bool = False) -> WeightUpdate:
        self.loaded.append(expected)
        self.version = expected
        return WeightUpdate(expected, [""], 0.0)

    def submit(self, key, prompt, n, temperature=None) -> None:
        assert n == N
        self.running[key] = prompt

    def step(self):
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
        pass

    def unfinished(self):
        return [
            (key, PartialGroup(list(prompt), self.generation(1), np.zeros(N, bool)))
            for key, prompt in self.running.items()
        ]

    def decode(self, ids) -> str:
        return self.tokenizer.backend.decode([int(i) for i in ids])

    def close(self) -> None:
        self.closed = True


def rollouter(tmp_path, tiny_model_dir, script, *overrides: str):
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
        world_rank=0, rollout_ranks=1, device=torch.device("cpu"), weights=None,
        workers_per_rank=1, inter=None,
    )  # fmt: skip
    engine = FakeEngine(TinyTokenizer(tiny_model_dir))
    leader = ScriptedLeader(script)
    (tmp_path / "logs").mkdir(exist_ok=True)
    return Rollouter(cfg, topo, tmp_path, engine=engine, sender=leader), engine, leader


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
