"""The checkpoint protocol collects states by name: a file's tree is the union of its
states' trees, and each state loads back its own keys, reading nothing else of a part."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.checkpoint.state import RngState
from hpc_asyncppo.checkpoint.store import CheckpointError, save_checkpoint


class Counter:
    def __init__(self, key: str, value: int = 0):
        self.key, self.value = key, value

    def state_dict(self) -> dict:
        return {self.key: self.value}

    def load_state_dict(self, state) -> None:
        self.value = int(state[self.key])


def test_a_files_tree_is_the_union_of_its_states_and_keys_never_collide():
    tree = protocol.tree_of({"a": Counter("x", 1), "b": Counter("y", 2)})
    assert tree == {"x": 1, "y": 2} and list(tree) == ["x", "y"]
    with pytest.raises(ValueError, match="states 'a' and 'b' both write 'x'"):
        protocol.tree_of({"a": Counter("x"), "b": Counter("x")})


def test_each_state_loads_its_own_keys_of_a_part(tmp_path):
    big = np.arange(1 << 16, dtype=np.float32)
    part = tmp_path / "part.h5"
    save_checkpoint(part, {**protocol.tree_of({"a": Counter("x", 7)}), "other": big}, {})
    a = Counter("x")
    read = protocol.load_part(part, {"a": a})
    assert a.value == 7 and read < big.nbytes  # the other state's array is not read


def test_a_key_the_part_lacks_is_refused_naming_the_file(tmp_path):
    part = tmp_path / "part.h5"
    save_checkpoint(part, {"x": 1}, {})
    with pytest.raises(CheckpointError, match=r"part\.h5 has no 'y'"):
        protocol.load_part(part, {"b": Counter("y")})


def test_rng_state_round_trips_through_a_part(tmp_path):
    part = tmp_path / "rng.h5"
    save_checkpoint(part, protocol.tree_of({"rng": RngState()}), {})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    protocol.load_part(part, {"rng": RngState()})
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
