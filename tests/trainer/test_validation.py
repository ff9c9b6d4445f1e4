"""Validation's numbers by hand: the metrics of one validation, the rollout rank's result
message, and the metrics rows a validation adds beside the trainer steps'."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_asyncppo.rollout.validation import result_message
from hpc_asyncppo.runlog import format_validation, split_metrics
from hpc_asyncppo.tasks import Prompt
from hpc_asyncppo.trainer.validation import validation_metrics
from hpc_asyncppo.transport.arrays import unpack_arrays

REWARDS = np.array([[1.0, 0.5], [0.25, 0.0], [1.0, 1.0]], dtype=np.float32)


def test_metrics_of_one_validation_by_hand():
    m = validation_metrics(REWARDS, ["a", "b", "a"], version=3)
    assert m["val/param_version"] == 3 and m["val/prompts"] == 3
    assert m["val/reward/mean"] == pytest.approx(3.75 / 6)
    assert m["val/pass@2"] == pytest.approx(2 / 3)  # prompts 0 and 2 have a full-reward response
    assert m["val/a/reward/mean"] == pytest.approx(3.5 / 4) and m["val/a/pass@2"] == 1.0
    assert m["val/b/reward/mean"] == pytest.approx(0.125) and m["val/b/pass@2"] == 0.0


def test_one_data_source_has_no_per_source_keys_and_greedy_is_pass_at_1():
    m = validation_metrics(REWARDS[:, :1], ["", "", ""], version=0)
    assert sorted(m) == [
        "val/param_version", "val/pass@1", "val/prompts", "val/reward/mean"
    ]  # fmt: skip
    assert m["val/reward/mean"] == pytest.approx(2.25 / 3) and m["val/pass@1"] == pytest.approx(
        2 / 3
    )


def test_result_message_carries_rewards_indices_and_sources():
    prompts = [Prompt(4, "1 =", "2", data_source="b"), Prompt(9, "5 =", "6", data_source="a")]
    buf = result_message(50, 12, 1, prompts, REWARDS[:2], skipped=1)
    arrays, meta = unpack_arrays(buf)
    assert meta == {"step": 50, "version": 12, "rank": 1, "sources": ["a", "b"], "skipped": 1}
    assert np.array_equal(arrays["rewards"], REWARDS[:2])
    assert arrays["prompt_index"].tolist() == [4, 9]
    assert [meta["sources"][i] for i in arrays["source"]] == ["b", "a"]


def test_validation_rows_are_apart_from_the_step_rows():
    rows = [
        {"step": 1, "reward/mean": 0.1},
        {"step": 0, "val/param_version": 0, "val/reward/mean": 0.05, "val/pass@1": 0.0},
        {"step": 2, "reward/mean": 0.2},
        {"step": 2, "val/param_version": 0, "val/reward/mean": 0.5, "val/pass@1": 0.25},
        {"step": 2, "reward/mean": 0.3},  # a resumed run's row of the same step
    ]
    steps, vals = split_metrics(rows)
    assert [(r["step"], r["reward/mean"]) for r in steps] == [(1, 0.1), (2, 0.3)]
    assert [r["step"] for r in vals] == [0, 2]
    assert format_validation(vals[1]) == "reward 0.500  pass@1 0.25  at step 2 (v0)"
    both = {**vals[1], "val/x/reward/mean": 0.75, "val/y/reward/mean": 0.25}
    assert "(x 0.750, y 0.250)" in format_validation(both)


def test_validation_is_due_every_test_freq_steps_and_before_training():
    from hpc_asyncppo.config import Config, DataConfig, TrainerConfig
    from hpc_asyncppo.trainer.validation import ValidationLog

    def due(before: bool, **trainer: object) -> list[int]:
        cfg = Config(data=DataConfig(val="v.jsonl"), trainer=TrainerConfig(**trainer))
        log = ValidationLog(cfg, None, None)  # type: ignore[arg-type]
        return [s for s in range(0, 13) if log.due(s, before_train=before)]

    assert due(False, test_freq=4) == [0, 4, 8, 12]  # after a step: its multiples
    assert due(True, test_freq=4) == [0, 4, 8, 12]  # at the start: 0, or a resume's step
    assert due(True, test_freq=4, val_before_train=False) == [4, 8, 12]
    assert due(False, test_freq=0) == due(True, test_freq=0) == []


class TwoRanks:
    """The receiver side the ValidationLog reads: two rollout ranks' results, as delivered."""

    rollout_ranks = 2

    def __init__(self):
        self.inbox: list[tuple[int, np.ndarray]] = []
        self.controls: list = []

    def broadcast_control(self, kind, value=0) -> None:
        self.controls.append((kind, value))

    def poll_validation(self):
        out, self.inbox = self.inbox, []
        return out


class Rows:
    def __init__(self):
        self.rows: list[dict] = []

    def write(self, rows: list[dict]) -> None:
        self.rows += rows


def test_a_void_share_leaves_its_step_without_a_row_and_the_others_with_theirs():
    """Rank 1 could not validate step 4 (its engine restarted and the weights of v2 were
    gone): step 4 gets no row, whatever rank 0 sends for it later; the run's
    other validations are logged, and nothing is left waiting."""
    from hpc_asyncppo.config import Config, DataConfig, TrainerConfig
    from hpc_asyncppo.trainer.validation import ValidationLog

    prompts = [Prompt(4, "1 =", "2")]
    receiver, rows = TwoRanks(), Rows()
    cfg = Config(data=DataConfig(val="v.jsonl"), trainer=TrainerConfig(test_freq=4))
    log = ValidationLog(cfg, receiver, rows)  # type: ignore[arg-type]
    log.request(4, 2)
    log.request(8, 3)
    void = result_message(4, 2, 1, [], np.zeros((0, 2), np.float32), 0, void=True)
    receiver.inbox = [(1, void)]
    log.poll()
    receiver.inbox = [(r, result_message(8, 3, r, prompts, REWARDS[r : r + 1], 0)) for r in (1, 0)]
    receiver.inbox.insert(1, (0, result_message(4, 2, 0, prompts, REWARDS[:1], 0)))
    log.poll()
    assert log.settled()
    assert [(r["step"], r["val/param_version"], r["val/prompts"]) for r in rows.rows] == [(8, 3, 2)]
