"""The sharded (FSDP2) mixed-precision trainer in real runs under mpirun: the result does
not depend on how the batch is split over trainer ranks and micro-batches, exact resume with
several trainer ranks, and every trainer path runs (bf16 with fp32 master weights included)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from hpc_asyncppo.checkpoint.protocol import read_full, read_manifest, step_dir
from hpc_asyncppo.runlog import read_jsonl
from tests.harness import SMALL, Run, final_weights

pytestmark = pytest.mark.mpi


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).norm() / a[n].norm().clamp(min=1e-12)) for n in a)


def test_sync_runs_end_equal_whatever_the_split_and_resume_exactly_onto_any_count(tmp_path):
    """Same seed, sync mode, 8 steps on 2 trainer ranks with micro-batches of 4. Stopped
    after 4 steps and resumed, it ends bitwise equal to the uninterrupted run; the same
    checkpoint resumed on 1 trainer rank (shards and optimizer state re-cut, one
    micro-batch) trains the same samples to the same weights within 1e-4: steps on 1 rank
    equal steps on 2. (That a step's gradients do not depend on the split, ranks and
    micro-batches and token budgets, from the model's files on 1 or 2 ranks:
    test_policy's test_gradients_do_not_depend_on_the_split.)"""
    common = [*SMALL, "async_training.mode=sync", "checkpoint.save_every=0"]
    two_micro4 = ["--train-ranks", "2", "actor.ppo_micro_batch_size_per_gpu=4"]
    whole, half, moved = tmp_path / "whole", tmp_path / "half", tmp_path / "moved"
    Run.start(whole, *two_micro4, *common, "trainer.total_steps=8").finish(expect=0)
    run = Run.start(half, *two_micro4, *common, "trainer.total_steps=4")
    run.finish(expect=0)
    shutil.copytree(half, moved)  # the same first half, to resume on another rank count
    run.resume("trainer.total_steps=8").finish(expect=0)
    a, b = final_weights(whole, 8), final_weights(half, 8)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume on 2 ranks"
    rows = {d: [r["uid"] for r in read_jsonl(d / "trained_samples.jsonl")] for d in (whole, half)}
    assert rows[whole] == rows[half]
    # written by 2 trainer ranks, resumed on 1: the shards are re-cut, the run goes on
    Run(moved).resume("trainer.total_steps=8", train_ranks=1).finish(expect=0)
    assert relative_difference(a, final_weights(moved, 8)) <= 1e-4
    rows = [r["uid"] for r in read_jsonl(moved / "trained_samples.jsonl")]
    assert rows == [r["uid"] for r in read_jsonl(whole / "trained_samples.jsonl")]
    rewards = {
        d: [m["reward/mean"] for m in read_jsonl(d / "metrics.jsonl")] for d in (whole, moved)
    }
    assert rewards[moved] == rewards[whole]  # the same samples, the same rewards


def finite_metrics(run_dir: Path, keys: list[str]) -> list[dict]:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    for row in metrics:
        for key in keys:
            assert key in row and math.isfinite(row[key]), (key, row)
    return metrics


def test_value_head_reference_entropy_epochs_and_mini_batches_in_bf16_on_two_ranks(tmp_path):
    """GAE with the value head, the KL reference, the entropy bonus, ppo_epochs > 1 and
    require_batches > 1, the rollout's log-probs as the old ones, in bf16 over 2 trainer
    ranks; the checkpoint holds fp32 master weights. (That small bf16 updates survive in
    them: test_policy's test_bf16_compute_keeps_fp32_master_weights_that_take_small_updates.)"""
    run_dir = tmp_path / "run"
    Run.start(run_dir, *SMALL, "model.dtype=bfloat16",
              "algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1",
              "actor.entropy_coeff=0.01", "actor.ppo_epochs=2", "async_training.require_batches=2",
              "async_training.use_rollout_log_probs=true", "algorithm.rollout_is=none",
              "trainer.total_steps=6", train_ranks=2).finish(expect=0)  # fmt: skip
    keys = ["critic/vf_loss", "actor/kl_loss", "actor/entropy", "actor/pg_loss",
            "actor/grad_norm", "actor/ppo_kl"]  # fmt: skip
    metrics = finite_metrics(run_dir, keys)
    assert metrics[-1]["samples/total"] == 6 * 2 * 4 * 8
    assert metrics[-1]["actor/kl_loss"] > metrics[0]["actor/kl_loss"]  # moving off the reference
    folder = step_dir(run_dir, 6)
    assert set(read_full(folder, "value_head")) == {"weight", "bias"}
    assert {t.dtype for t in read_full(folder, "model").values()} == {torch.float32}
    assert sorted(read_manifest(folder)["parts"]) == [
        "leader.h5", "rollout0.h5", "trainer0.h5", "trainer1.h5"
    ]  # fmt: skip


def test_importance_weights_token_budget_checkpointing_and_lr_schedule(tmp_path):
    run_dir = tmp_path / "run"
    Run.start(run_dir, *SMALL, "actor.lr=1e-3", "algorithm.rollout_is=token",
              "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=40",
              "actor.gradient_checkpointing=true", "actor.lr_scheduler=cosine",
              "actor.lr_warmup_steps=2", "actor.min_lr_ratio=0.1", "trainer.total_steps=6",
              train_ranks=2).finish(expect=0)  # fmt: skip
    metrics = finite_metrics(run_dir, ["actor/pg_loss", "actor/lr"])
    lrs = [m["actor/lr"] for m in metrics]  # the rate of the next step, after each step
    assert lrs[0] == pytest.approx(0.5e-3) and lrs[1] == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4) and lrs[2] > lrs[3] > lrs[4]
