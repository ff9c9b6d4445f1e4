"""Which ranks share a GPU decides the weight group's backend (see tests/gpu for the runs)."""

from __future__ import annotations

from hpc_asyncppo.runtime.topology import _sharing


def test_ranks_on_distinct_gpus_share_nothing() -> None:
    gpus = [[11], [12], [13], [14]]
    assert _sharing(gpus, [0, 1, 2, 3]) == []


def test_only_the_ranks_of_the_group_on_a_common_gpu_are_named() -> None:
    # ranks 0 and 2 on one GPU; rank 3 shares rank 1's GPU, but rank 1 is not in the group
    gpus = [[7], [8], [7], [8]]
    assert _sharing(gpus, [0, 2, 3]) == [0, 2]
    assert _sharing(gpus, [2, 3]) == []
    assert _sharing(gpus, [1, 3]) == [1, 3]


def test_a_rollout_rank_shares_through_any_of_its_tensor_parallel_gpus() -> None:
    # rollout rank 0 drives vLLM workers on GPUs 1 and 2; the trainer leader (rank 1) is on 2
    gpus = [[1, 2], [2]]
    assert _sharing(gpus, [1, 0]) == [0, 1]
    assert _sharing([[1, 3], [2]], [1, 0]) == []
