"""SpillQueue: FIFO order and exact bytes under a tiny memory limit, no file while nothing
spills, snapshots for checkpoints, and real encoded sample groups."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from hpc_asyncppo.checkpoint.store import load_checkpoint, save_checkpoint
from hpc_asyncppo.trainer.queue import SpillQueue


def item(i: int, rng: random.Random) -> np.ndarray:
    size = rng.choice([0, 1, 7, 100, 900, 3000])
    return np.frombuffer(rng.randbytes(size), dtype=np.uint8) if size else np.zeros(0, np.uint8)


def assert_items_equal(actual: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.dtype == np.uint8 and a.tobytes() == e.tobytes(), f"item {i}"


@pytest.mark.parametrize("memory_limit_mb, io_chunk_mb", [(0.01, 16.0), (0.02, 0.004), (0.0, 1.0)])
def test_random_pushes_and_pops_keep_fifo_order_and_bytes(tmp_path, memory_limit_mb, io_chunk_mb):
    rng = random.Random(0)
    queue = SpillQueue(tmp_path / "overflow.h5", memory_limit_mb, io_chunk_mb=io_chunk_mb)
    reference: deque[np.ndarray] = deque()
    largest, spilled_seen = 0, False
    returned: list[int] = []  # bytes of the items pushed back at the front, front first
    for i in range(4000):
        if rng.random() < 0.7:
            buf = item(i, rng)
            largest = max(largest, buf.nbytes)
            queue.push(buf)
            reference.append(buf.copy())
        elif reference:
            many = rng.random() < 0.1
            got = queue.popleft_many(rng.randint(1, 5)) if many else [queue.pop()]
            assert_items_equal(got, [reference[k] for k in range(len(got))])
            returned = returned[len(got) :]  # popped again: back under the limit
            if rng.random() < 0.2:  # a batch abandoned by a stop goes back to the front
                queue.push_front(got)
                returned = [g.nbytes for g in got] + returned
            else:
                for _ in got:
                    reference.popleft()
        assert len(queue) == len(reference)
        # At most the limit, except one item larger than the limit being read back and
        # items put back at the front, until they are popped again.
        assert queue.memory_bytes <= max(queue.memory_limit, largest) + sum(returned)
        spilled_seen |= queue.spilled_count > 0
        if i % 997 == 0:
            assert_items_equal(queue.snapshot(), list(reference))
    assert spilled_seen and queue.total_spilled > 500
    assert_items_equal(queue.popleft_many(len(reference) + 5), list(reference))
    assert len(queue) == 0 and queue.memory_bytes == 0
    assert not (tmp_path / "overflow.h5").exists()  # drained: the file is gone
    with pytest.raises(IndexError):
        queue.pop()


def test_a_backlog_of_thousands_spills_and_drains_in_order(tmp_path):
    rng = random.Random(1)
    items = [item(i, rng) for i in range(5000)]
    with SpillQueue(tmp_path / "overflow.h5", memory_limit_mb=0.05) as queue:
        queue.extend(items)
        assert queue.spilled_count > 4000 and queue.memory_bytes <= queue.memory_limit
        assert (tmp_path / "overflow.h5").exists()
        assert_items_equal(queue.snapshot(), items)
        assert len(queue) == 5000  # snapshot removes nothing
        assert_items_equal([queue.pop() for _ in range(5000)], items)


def test_nothing_touches_the_disk_while_everything_fits(tmp_path):
    queue = SpillQueue(tmp_path / "overflow.h5", memory_limit_mb=1)
    for i in range(100):
        queue.push(np.full(1000, i % 256, dtype=np.uint8))
    assert queue.spilled_count == 0 and queue.memory_bytes == 100_000
    assert not (tmp_path / "overflow.h5").exists()
    assert [int(b[0]) for b in queue.popleft_many(3)] == [0, 1, 2]


def test_items_larger_than_the_limit_still_pass_through(tmp_path):
    queue = SpillQueue(tmp_path / "overflow.h5", memory_limit_mb=0.001)
    big = [np.full(5000, i, dtype=np.uint8) for i in range(3)]
    queue.extend(big)
    assert queue.memory_bytes == 0 and queue.spilled_count == 3
    assert_items_equal(queue.popleft_many(3), big)


def test_only_1d_uint8_buffers_are_accepted(tmp_path):
    queue = SpillQueue(tmp_path / "overflow.h5", memory_limit_mb=1)
    for bad in (np.zeros(3, np.float32), np.zeros((2, 2), np.uint8), b"bytes"):
        with pytest.raises(TypeError):
            queue.push(bad)


def test_close_deletes_the_overflow_file(tmp_path):
    queue = SpillQueue(tmp_path / "overflow.h5", memory_limit_mb=0)
    queue.push(np.ones(10, np.uint8))
    assert (tmp_path / "overflow.h5").exists()
    queue.close()
    assert not (tmp_path / "overflow.h5").exists() and len(queue) == 0


def test_a_spilled_queue_survives_a_checkpoint_and_resumes_in_order(tmp_path):
    rng = random.Random(2)
    items = [item(i, rng) for i in range(2000)]
    queue = SpillQueue(tmp_path / "overflow.h5", memory_limit_mb=0.02)
    queue.extend(items)
    first = queue.popleft_many(300)
    save_checkpoint(tmp_path / "c.h5", {"queued": queue.snapshot()}, {"step": 1})
    queue.close()
    tree, _ = load_checkpoint(tmp_path / "c.h5")
    resumed = SpillQueue(tmp_path / "overflow.h5", memory_limit_mb=0.02)
    resumed.extend(tree["queued"])
    assert_items_equal(first + resumed.popleft_many(len(items)), items)


def test_encoded_sample_groups_come_back_decodable():
    samples = pytest.importorskip("hpc_asyncppo.transport.samples")  # imports mpi4py
    rng = np.random.default_rng(0)
    groups = []
    for index in range(200):
        n, length = 4, int(rng.integers(1, 40))
        groups.append(
            samples.SampleGroup(
                seed=1, epoch=0, prompt_index=index, rollout_rank=index % 3,
                param_version_start=index // 50, param_version_end=index // 50,
                prompt_ids=rng.integers(0, 100, 8), response_ids=rng.integers(0, 100, (n, length)),
                response_lengths=rng.integers(1, length + 1, n),
                rollout_log_probs=rng.normal(size=(n, length)), rewards=rng.normal(size=n),
            )
        )  # fmt: skip
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        queue = SpillQueue(Path(tmp) / "overflow.h5", memory_limit_mb=0.01)
        queue.extend(samples.encode_group(g) for g in groups)
        assert queue.spilled_count > 100
        for expected in groups:
            got = samples.decode_group(queue.pop())
            assert got.uid(0) == expected.uid(0)
            assert np.array_equal(got.response_ids, expected.response_ids)
            assert np.array_equal(got.rewards, expected.rewards.astype(np.float32))
