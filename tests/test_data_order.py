"""The leader's data order: one shuffle per epoch, draws that name prompts, give-backs."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_asyncppo.checkpoint.store import CheckpointReader, save_checkpoint
from hpc_asyncppo.tasks.order import PromptOrder, epoch_order


def test_each_epoch_hands_out_every_prompt_once_in_its_shuffle():
    order = PromptOrder(10, seed=3)
    draws = [order.take() for _ in range(25)]
    epochs = [order.split(d) for d in draws]
    assert [e for e, _ in epochs] == [0] * 10 + [1] * 10 + [2] * 5
    assert [p for e, p in epochs if e == 0] == epoch_order(10, 3, 0).tolist()
    assert sorted(p for e, p in epochs if e == 1) == list(range(10))
    assert epoch_order(10, 3, 0).tolist() != epoch_order(10, 3, 1).tolist()


def test_200k_prompts_cost_one_shuffle_per_epoch():
    """O(1) per prompt: the epoch's order is computed once, not on every draw."""
    n = 200_000
    order = PromptOrder(n, seed=1)
    seen = np.fromiter((order.take() for _ in range(n + 10)), dtype=np.int64, count=n + 10)
    assert order.shuffles == 2  # epoch 0 and the start of epoch 1
    assert len(np.unique(seen[:n] % n)) == n  # the whole of epoch 0, each prompt once


def test_given_back_draws_go_out_again_first_in_their_order():
    order = PromptOrder(8, seed=0)
    first = [order.take() for _ in range(6)]
    order.give_back([first[5], first[2]])  # unused credits of two ranks, any order
    again = [order.take() for _ in range(2)]
    assert again == [first[2], first[5]]
    rest = [order.take() for _ in range(2)]
    assert sorted(order.split(d)[1] for d in first + rest) == list(range(8))


def test_state_round_trips_through_a_checkpoint_file(tmp_path):
    """A resumed order (another process: same seed) continues the same epoch exactly."""
    order = PromptOrder(12, seed=5)
    for _ in range(7):
        order.take()
    order.give_back([order.take(), order.take()][::-1])
    path = tmp_path / "leader.h5"
    save_checkpoint(path, {"order": order.state_dict()}, meta={})
    with CheckpointReader(path) as reader:
        state = reader.get("order")
    resumed = PromptOrder(12, seed=5)
    resumed.load_state_dict(state)
    assert [resumed.take() for _ in range(20)] == [order.take() for _ in range(20)]


def test_no_prompts_is_refused():
    with pytest.raises(ValueError, match="no prompts"):
        PromptOrder(0, seed=1)
