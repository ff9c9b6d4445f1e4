"""Real runs under mpirun with ``rollout.engine=vllm`` (vLLM's CPU build): the default task
learns, every sync reaches the vLLM worker, and partial rollout stamps cut groups.

Each run starts one vLLM engine per rollout rank (~25 s on two cores) before training.
The tiny model gets 2 attention heads: vLLM's CPU attention has no kernel for head size 16.
"""

from __future__ import annotations

import os

import pytest

from hpc_asyncppo.runlog import read_jsonl
from tests.integration.test_local_runs import check_audit, check_weights_match, submit

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh --with-vllm)")
pytestmark = pytest.mark.mpi

VLLM = [
    "rollout.engine=vllm",
    "model.tiny.num_heads=2",
    "checkpoint.save_every=0",
    "trainer.record_weight_digests=true",
    "rollout.record_sent_groups=true",
    "timeouts.sample_wait_s=120",
]


@pytest.fixture(autouse=True)
def vllm_env(tmp_path, monkeypatch):
    """Offline, no torch.compile (20 s for vLLM's log-prob helper), caches in the test folder."""
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TORCH_COMPILE_DISABLE": "1",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "TMPDIR": str(tmp_path / "tmp"),
    }.items():
        monkeypatch.setenv(key, value)
    os.makedirs(tmp_path / "tmp", exist_ok=True)


def mean_reward(metrics: list[dict], steps: range) -> float:
    rows = [m["reward/mean"] for m in metrics if m["step"] in steps]
    return sum(rows) / len(rows)


def test_default_task_learns_with_vllm(tmp_path):
    """150 steps (~45 s of training here, plus start-up): the hf engine's curve, measured
    at 0.07 -> 0.45 mean reward over the first and last 20 steps."""
    run_dir = tmp_path / "run"
    proc = submit(run_dir, "--rollout-ranks", "1", *VLLM, "trainer.total_steps=150", timeout=420)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 151))
    first, last = mean_reward(metrics, range(1, 21)), mean_reward(metrics, range(131, 151))
    assert last > 0.25 and last > first + 0.15, f"reward {first:.3f} -> {last:.3f}"
    # versions 0..37: the initial sync, then one every 4 steps
    check_weights_match(run_dir, rollout_ranks=1, versions=38)
    trained = check_audit(run_dir, sync_every=4, max_staleness=4)
    assert all(r["param_version_end"] == r["param_version_start"] for r in trained)


def test_partial_rollout_resumes_groups_across_syncs(tmp_path):
    """Two rollout ranks, long responses, a sync every step and room to run ahead: groups
    cut at a sync finish under the new weights (measured: 152 of 384 samples span 1-2
    versions); staleness counts from the start version."""
    run_dir = tmp_path / "run"
    args = [
        *VLLM,
        "async_training.partial_rollout=true",
        "async_training.trigger_parameter_sync_step=1",
        "actor.ppo_mini_batch_size=4",
        "rollout.response_length=64",
        "async_training.staleness_threshold=1.0",
        "trainer.total_steps=12",
    ]
    proc = submit(run_dir, "--rollout-ranks", "2", *args, timeout=420)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_weights_match(run_dir, rollout_ranks=2, versions=13)
    trained = check_audit(run_dir, sync_every=1, max_staleness=4, partial=True)
    spanning = [r for r in trained if r["param_version_end"] > r["param_version_start"]]
    assert spanning, "no group was cut by a sync and resumed"
    assert all(r["param_version_end"] >= r["param_version_start"] for r in trained)
