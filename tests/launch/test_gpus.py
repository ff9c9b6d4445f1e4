"""The per-rank GPU sets (launch/gpus.py), for the shipped layouts and odd ones; no GPU needed.

| layout                                   | ranks                  | each rank sees            |
|------------------------------------------|------------------------|---------------------------|
| 8 GPUs, 4 rollout ranks, TP 2 (7B)       | SLURM_LOCALID 0..3     | [0,1] [2,3] [4,5] [6,7]   |
| 8 GPUs, 8 trainer ranks (7B trainer)     | SLURM_LOCALID 0..7     | [0] .. [7]                |
| 4 GPUs, 4 rollout ranks, TP 1 (0.5B)     | SLURM_LOCALID 0..3     | [0] .. [3]                |
| 4 GPUs, 1 rollout rank, TP 4             | SLURM_LOCALID 0        | [0,1,2,3]                 |
| Slurm bound the task (--gpus-per-task)   | CUDA_VISIBLE_DEVICES=4,5 | 4,5 (kept)              |
| --gres: node's GPUs visible, indexed     | CUDA_VISIBLE_DEVICES=2,3,6,7 | slice of those      |
| local, one GPU, 1 rollout + 1 trainer    | mpirun ranks 0, 1      | [0] and [0] (shared)      |
| local, 2 GPUs, 1 + 1                     | mpirun ranks 0, 1      | [0] and [1]               |
| local, no GPU                            | any                    | [] (CPU)                  |
refused: TP above the node's GPUs, more trainer ranks than GPUs, more rollout ranks x TP
than GPUs, a layout that leaves GPUs unused, GPUs on one component only.
"""

from __future__ import annotations

import pytest

from hpc_asyncppo.config import ConfigError, load_config
from hpc_asyncppo.config.slurm import layout_problem
from hpc_asyncppo.launch.gpus import (
    GpuLayoutError,
    bind_gpus,
    gpu_set,
    local_gpu_set,
    rank_gpus,
)


def test_8_gpus_4_rollout_ranks_at_tp_2() -> None:
    sets = [gpu_set("rollout", r, 4, 8, tensor_parallel_size=2) for r in range(4)]
    assert sets == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_8_gpus_8_trainer_ranks() -> None:
    assert [gpu_set("trainer", r, 8, 8, tensor_parallel_size=2) for r in range(8)] == [
        [r] for r in range(8)
    ]


def test_4_gpus_1_rollout_rank_at_tp_4() -> None:
    assert gpu_set("rollout", 0, 1, 4, tensor_parallel_size=4) == [0, 1, 2, 3]


def test_no_gpus_requested_is_a_cpu_rank() -> None:
    assert gpu_set("rollout", 0, 2, 0, 1) == [] and gpu_set("trainer", 1, 2, 0) == []


def test_a_task_slurm_already_bound_keeps_its_set() -> None:
    # --gpus-per-task=2: the task sees exactly its two GPUs, whatever its local rank.
    assert gpu_set("rollout", 3, 4, 8, 2, visible=["4", "5"]) == [0, 1]
    assert gpu_set("trainer", 5, 8, 8, visible=["5"]) == [0]


def test_sets_index_into_what_the_task_sees() -> None:
    # --gres: every task sees the node's allocation (not necessarily GPUs 0..N-1).
    visible = ["2", "3", "6", "7"]
    assert [gpu_set("rollout", r, 2, 4, 2, visible) for r in range(2)] == [[0, 1], [2, 3]]


def test_local_one_gpu_roles_share_it() -> None:
    assert local_gpu_set(0, 1, 1, 1, gpus=1) == [0]
    assert local_gpu_set(1, 1, 1, 1, gpus=1) == [0]


def test_local_gpus_enough_for_both_roles_are_split() -> None:
    assert [local_gpu_set(r, 1, 1, 1, gpus=2) for r in (0, 1)] == [[0], [1]]
    # 2 rollout ranks at TP 2 and 2 trainer ranks on 6 GPUs
    assert [local_gpu_set(r, 2, 2, 2, gpus=6) for r in range(4)] == [[0, 1], [2, 3], [4], [5]]
    # too few for both: each role starts at GPU 0, rollout ranks wrap around
    assert [local_gpu_set(r, 3, 2, 1, gpus=2) for r in range(5)] == [[0], [1], [0], [0], [1]]


def test_local_without_gpus_is_cpu() -> None:
    assert local_gpu_set(0, 1, 1, 4, gpus=0) == []


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda: gpu_set("rollout", 0, 4, 4, 2), "4 rollout rank.* need 2 GPU.* shows 4"),
        (lambda: gpu_set("trainer", 0, 8, 4), "8 trainer rank.* shows 4"),
        (lambda: gpu_set("rollout", 0, 1, 2, 4), "need 4 GPU.* shows 2"),
        (lambda: gpu_set("rollout", 0, 1, 8, 2, visible=["0"]), "need 2 GPU.* shows 1"),
        (lambda: gpu_set("trainer", 4, 4, 4), "local rank 4"),
        (lambda: local_gpu_set(0, 1, 1, 2, gpus=1), "tensor_parallel_size=2 .* 1 GPU"),
        (lambda: local_gpu_set(1, 1, 2, 1, gpus=1), "2 trainer ranks .* --train-ranks 1"),
    ],
)
def test_refused_sets(call, expected: str) -> None:
    with pytest.raises(GpuLayoutError, match=expected):
        call()


def test_layout_problem_names_the_key_to_change() -> None:
    assert layout_problem("rollout", 4, 8, 2) is None and layout_problem("trainer", 0, 0, 1) is None
    msg = layout_problem("rollout", 8, 8, 2)
    assert msg == (
        "slurm.rollout: 8 rollout rank(s) per node x rollout.tensor_parallel_size=2 GPU(s) each "
        "= 16 GPU(s), but slurm.rollout.gpus_per_node=8: set slurm.rollout.ntasks_per_node=4 "
        "(or slurm.rollout.gpus_per_node=16)"
    )
    assert "slurm.train.ntasks_per_node=8" in layout_problem("trainer", 4, 8, 1)
    # 6 GPUs cannot split into TP-4 sets: only the GPU count can change
    assert layout_problem("rollout", 1, 6, 4).endswith(": set slurm.rollout.gpus_per_node=4")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # TP above a rollout rank's GPUs
        (["slurm.rollout.gpus_per_node=4", "slurm.train.gpus_per_node=1",
          "rollout.tensor_parallel_size=2"], "each rollout rank has 1 GPU"),
        # more trainer ranks per node than GPUs
        (["slurm.rollout.gpus_per_node=1", "slurm.train.gpus_per_node=4",
          "slurm.train.ntasks_per_node=8"], "slurm.train: 8 trainer rank"),
        # a GPU no rank would use
        (["slurm.rollout.gpus_per_node=8", "slurm.rollout.ntasks_per_node=2",
          "slurm.train.gpus_per_node=1"], "slurm.rollout.ntasks_per_node=8"),
        # GPUs on one component only
        (["slurm.rollout.gpus_per_node=2"], "GPUs on one component only"),
        (["slurm.train.gpus_per_node=2"], "GPUs on one component only"),
    ],
)  # fmt: skip
def test_impossible_layouts_are_refused_before_submit(overrides, expected: str) -> None:
    vllm = ["rollout.engine=vllm", "model.tiny.num_heads=2"]
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(overrides=[*vllm, *overrides])
    assert "\n" not in str(info.value)


def test_shipped_qwen_layouts_are_accepted() -> None:
    for name in ("qwen2.5-0.5b-gsm8k", "qwen2.5-7b-gsm8k", "dapo-qwen2.5-7b-gsm8k",
                 "gspo-qwen2.5-7b-gsm8k"):  # fmt: skip
        cfg = load_config(name)
        for role, c in (("rollout", cfg.slurm.rollout), ("trainer", cfg.slurm.train)):
            tp = cfg.rollout.tensor_parallel_size
            sets = [gpu_set(role, r, c.tasks_per_node, c.gpus_per_node, tp) for r in
                    range(c.tasks_per_node)]  # fmt: skip
            assert sorted(g for s in sets for g in s) == list(range(c.gpus_per_node))


def _7b():
    return load_config("qwen2.5-7b-gsm8k")


def test_rank_under_srun_slices_the_nodes_gpus() -> None:
    cfg = _7b()  # 2 x 4 rollout ranks at TP 2, then 2 x 8 trainer ranks
    slurm, tp = cfg.slurm, cfg.rollout.tensor_parallel_size
    env = {"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert rank_gpus(slurm, tp, 7, 24, 8, env, 8) == ["6", "7"]
    assert rank_gpus(slurm, tp, 8 + 11, 24, 8, env, 8) == ["3"]
    # Slurm bound the task itself (--gpus-per-task=2): kept as it is
    env = {"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "6,7"}
    assert rank_gpus(slurm, tp, 7, 24, 8, env, 2) == ["6", "7"]


def test_rank_under_mpirun_indexes_into_cuda_visible_devices() -> None:
    cfg = load_config()
    slurm, tp = cfg.slurm, cfg.rollout.tensor_parallel_size
    env = {"HPC_ASYNCPPO_ROLLOUT_RANKS": "1", "CUDA_VISIBLE_DEVICES": "3,5"}
    assert [rank_gpus(slurm, tp, r, 2, 1, env, 2) for r in (0, 1)] == [["3"], ["5"]]
    # mpirun inside a Slurm allocation: SLURM_LOCALID is inherited, our launcher's wins
    env |= {"SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "GPU-aa"}
    assert [rank_gpus(slurm, tp, r, 2, 1, env, 1) for r in (0, 1)] == [["GPU-aa"], ["GPU-aa"]]


def test_bind_gpus_sets_the_environment_of_a_gpu_rank_only() -> None:
    cfg = _7b()
    env = {"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert bind_gpus(cfg.slurm, cfg.rollout.tensor_parallel_size, 1, 24, 8, env) == [2, 3]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["HPC_ASYNCPPO_GPUS"] == "2,3"
    cpu = {"HPC_ASYNCPPO_ROLLOUT_RANKS": "1", "CUDA_VISIBLE_DEVICES": ""}
    default = load_config()
    tp = default.rollout.tensor_parallel_size
    assert bind_gpus(default.slurm, tp, 0, 2, 1, cpu) == [] and "HPC_ASYNCPPO_GPUS" not in cpu
