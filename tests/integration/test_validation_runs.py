"""Validation in a real run under mpirun: the default job with a held-out ``data.val`` (two
data sources) and ``trainer.test_freq=50`` validates the weights at steps 0, 50, ..., 300
while it trains; the greedy validation reward rises from about 1/15 (random over the tiny
vocabulary) to >= 0.8 (next_digit.LEARNED_REWARD; over 5 seeds the worst was 0.977); the logs, TensorBoard, the progress lines and the report show it;
and no validation sample reaches the training queue or its audit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_asyncppo.runlog import read_jsonl, split_metrics
from hpc_asyncppo.tasks import next_digit
from hpc_asyncppo.tasks.next_digit import LEARNED_REWARD, UNTRAINED_REWARD_MAX, write_prompts
from tests.harness import REPO, Run, check_audit, mlflow_run, wandb_history

pytestmark = pytest.mark.mpi
VAL_PROMPTS = 128
STEPS = 300  # the default job's
SYNC_EVERY = 4


def held_out_prompts(path: Path) -> dict[str, int]:
    """VAL_PROMPTS held-out prompts of the default task, as JSONL; the count per source."""
    held = next_digit.held_out_prompts(VAL_PROMPTS)
    write_prompts(path, held)
    return {s: sum(p.data_source == s for p in held) for s in ("short", "long")}


@pytest.fixture(scope="module")
def validated_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("validated")
    held_out_prompts(root / "val.jsonl")
    run_dir = root / "run"
    proc = Run.start(
        run_dir,
        f"data.val={root / 'val.jsonl'}",
        "trainer.test_freq=50",
        "rollout.record_sent_groups=true",
        "timeouts.sample_wait_s=120",
    ).finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir, proc.stdout


def test_the_default_job_learns(validated_run):
    """The README's first command: the embedded default learns the synthetic task, judged
    by its greedy validation on held-out prompts at the end (the learning tests' one bar,
    ``next_digit.LEARNED_REWARD``). (Its run here also validates, which leaves training
    alone: see the tests below; one run serves them all, to keep the suite short.)"""
    run_dir, _ = validated_run
    steps, vals = split_metrics(read_jsonl(run_dir / "metrics.jsonl"))
    rewards = [m["reward/mean"] for m in steps]
    assert len(rewards) == STEPS
    first = sum(rewards[:10]) / 10
    assert first < UNTRAINED_REWARD_MAX, f"a random policy scores about 1/15, got {first}"
    last = vals[-1]["val/reward/mean"]
    assert vals[-1]["step"] == STEPS and last >= LEARNED_REWARD, f"greedy validation {last:.3f}"
    check_audit(run_dir, sync_every=SYNC_EVERY, max_staleness=4)
    # a run that learns shows no sign of collapse (trainer/collapse.py, default bounds)
    assert [m["collapse/signs"] for m in steps] == [0] * STEPS


def test_validation_at_every_test_freq_steps_shows_the_learning(validated_run):
    run_dir, _ = validated_run
    steps, vals = split_metrics(read_jsonl(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["step"] for r in vals] == list(range(0, STEPS + 1, 50))
    for row in vals:
        # the leader's newest version after the step's sync (every SYNC_EVERY steps)
        assert row["val/param_version"] == row["step"] // SYNC_EVERY, row
        assert row["val/prompts"] == VAL_PROMPTS and row["val/skipped_prompts"] == 0
        for key in ("val/reward/mean", "val/pass@1", "val/short/reward/mean", "val/long/pass@1"):
            assert 0.0 <= row[key] <= 1.0, (key, row)
        assert not any(k.startswith(("reward/", "samples/")) for k in row)
    first, last = vals[0]["val/reward/mean"], vals[-1]["val/reward/mean"]
    assert first < UNTRAINED_REWARD_MAX, (
        f"the untrained policy scored {first:.3f} (random: about 1/15)"
    )
    assert last >= LEARNED_REWARD, f"greedy validation reward {first:.3f} -> {last:.3f}"
    assert vals[-1]["val/pass@1"] > vals[0]["val/pass@1"]


def test_validation_samples_stay_out_of_training(validated_run):
    """Every group a rollout rank sent (its own record) was trained or dropped, and no more:
    the validation groups never went through the sample sender."""
    run_dir, _ = validated_run
    trained = check_audit(run_dir, sync_every=SYNC_EVERY, max_staleness=4)
    dropped = read_jsonl(run_dir / "dropped_samples.jsonl")
    sent = read_jsonl(run_dir / "sent" / "rank0.jsonl")
    assert len(trained) == STEPS * 16 * 8
    groups = {r["uid"].rsplit("-r", 1)[0] for r in trained + dropped}
    assert len(sent) == len(groups)


def test_progress_report_status_and_tensorboard_show_validation(validated_run):
    run_dir, stdout = validated_run
    lines = [line for line in stdout.splitlines() if line.startswith("validation ")]
    assert len(lines) == STEPS // 50 + 1
    assert "at step 0 (v0)" in lines[0] and f"at step {STEPS} (v{STEPS // SYNC_EVERY})" in lines[-1]
    assert "pass@1" in lines[-1] and "short" in lines[-1] and "long" in lines[-1]
    cmd = [sys.executable, "-m", "hpc_asyncppo.report", str(run_dir)]
    report = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert report.returncode == 0, report.stderr
    _, vals = split_metrics(read_jsonl(run_dir / "metrics.jsonl"))
    assert f"validation  reward {vals[0]['val/reward/mean']:.3f}" in report.stdout
    assert f"-> reward {vals[-1]['val/reward/mean']:.3f}" in report.stdout
    assert f"{len(vals)} validations" in report.stdout
    assert (run_dir / "report.png").stat().st_size > 0
    cmd = [sys.executable, "-m", "hpc_asyncppo.status", str(run_dir)]
    status = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert f"validation  reward {vals[-1]['val/reward/mean']:.3f}" in status.stdout
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    scalars = acc.Scalars("val/reward/mean")  # pytest's approx takes no nested data
    assert [e.step for e in scalars] == [r["step"] for r in vals]
    assert [e.value for e in scalars] == pytest.approx([r["val/reward/mean"] for r in vals])
    assert {"val/pass@1", "val/param_version", "val/short/reward/mean"} <= set(
        acc.Tags()["scalars"]
    )


def test_eval_of_a_checkpoint_scores_what_the_runs_validation_logged(validated_run):
    """``hpc-asyncppo eval RUN_DIR`` (its newest checkpoint, the final step's) and ``--step
    200`` (a periodic one) on the run's data.val, greedy: the same numbers as the run's
    validation of those steps, from generations it wrote one per prompt. (Both steps sync
    their weights, SYNC_EVERY, so the validation saw the checkpoint's weights; at step 250
    it saw step 248's.)"""
    run_dir, _ = validated_run
    _, vals = split_metrics(read_jsonl(run_dir / "metrics.jsonl"))
    logged = {row["step"]: row for row in vals}
    for step, args in ((STEPS, []), (200, ["--step", "200"])):
        cmd = [sys.executable, "-m", "hpc_asyncppo", "eval", str(run_dir), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
        assert proc.returncode == 0, proc.stderr
        out = run_dir / "eval" / f"step_{step}-val"
        summary = json.loads((out / "summary.json").read_text())
        assert summary["step"] == step and summary["n"] == 1 and summary["temperature"] == 0
        lines = read_jsonl(out / "generations.jsonl")
        assert sorted(r["prompt_index"] for r in lines) == list(range(VAL_PROMPTS))
        row = logged[step]
        for key in ("val/reward/mean", "val/pass@1", "val/short/reward/mean", "val/long/pass@1"):
            assert summary[key] == pytest.approx(row[key], abs=1e-6), (step, key)
        assert f"reward/mean {row['val/reward/mean']:.4f}" in proc.stdout
        assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_a_stop_signal_with_validations_in_flight_stops_and_the_resume_validates_on(tmp_path):
    """SIGTERM while validations (every 2 steps, 4 sampled responses each) run beside
    training: the run stops with its checkpoint without waiting for them; the resumed run
    validates from its checkpoint's step on and every step is trained once. Its trackers
    (``trainer.logger``: W&B offline, MLflow's file store) hold one run each, continued by
    the resume, with every step and every validation once and the resume's attempt row."""
    held_out_prompts(tmp_path / "val.jsonl")
    run_dir = tmp_path / "run"
    args = [
        f"data.val={tmp_path / 'val.jsonl'}", "trainer.test_freq=2",
        "rollout.val_n=4", "rollout.val_temperature=1.0", "trainer.total_steps=100000",
        "actor.ppo_mini_batch_size=4", "timeouts.sample_wait_s=120", "timeouts.rank_wait_s=60",
        "trainer.logger=[console,tensorboard,wandb,mlflow]",
    ]  # fmt: skip
    run = Run.start(run_dir, *args)
    # the stop comes once step 8 is logged, from a test process the machine may starve for
    # seconds: the first attempt's end is out of reach, the resume sets the run's length
    run.wait_for_step(8)
    run.stop()  # exit 143, "continue with" the resume
    assert (run_dir / "preempted").exists()
    stopped_at = max(r["step"] for r in split_metrics(read_jsonl(run_dir / "metrics.jsonl"))[0])
    total = max(24, stopped_at + 12)
    proc = run.resume(f"trainer.total_steps={total}").finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps, vals = split_metrics(read_jsonl(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in steps] == list(range(1, total + 1))
    assert {r["step"] for r in vals} >= set(range(stopped_at + stopped_at % 2, total + 1, 2))
    assert all(r["step"] % 2 == 0 and r["val/prompts"] == VAL_PROMPTS for r in vals)
    trained = [r["uid"] for r in read_jsonl(run_dir / "trained_samples.jsonl")]
    assert len(trained) == len(set(trained)) == total * 4 * 8

    rows = wandb_history(run_dir)
    assert [r["trainer/step"] for r in rows if "reward/mean" in r] == list(range(1, total + 1))
    validated = sorted(r["trainer/step"] for r in rows if "val/reward/mean" in r)
    assert validated == [r["step"] for r in vals]
    (resumed,) = [r for r in rows if "run/attempt" in r]
    assert resumed["trainer/step"] == stopped_at and resumed["run/preemptions"] == 1
    client, tracked = mlflow_run(run_dir)
    assert tracked.info.status == "FINISHED"
    history = client.get_metric_history(tracked.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == list(range(1, total + 1))
    history = client.get_metric_history(tracked.info.run_id, "val/pass_at_4")
    assert sorted(m.step for m in history) == validated
