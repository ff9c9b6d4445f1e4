"""Checkpoints and resume on real runs: determinism, exactly-once under SIGTERM, corrupt
checkpoints, a different model, and the replay overflow file."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from hpc_asyncppo.checkpoint.protocol import (
    checkpoint_step,
    list_checkpoints,
    read_manifest,
    step_dir,
)
from hpc_asyncppo.config import DataConfig, TinyModelConfig
from hpc_asyncppo.models.tiny import build_tiny_model
from hpc_asyncppo.runlog import read_jsonl
from hpc_asyncppo.tasks import load_task
from hpc_asyncppo.tasks.order import PromptOrder
from tests.harness import SMALL, Run

pytestmark = pytest.mark.mpi


def order_prefix(seed: int, num_prompts: int, count: int) -> set[tuple[int, int]]:
    """(epoch, prompt) of the first ``count`` prompts of the run's data order."""
    order = PromptOrder(num_prompts, seed)
    return {order.split(order.take()) for _ in range(count)}


def prompts_generated(rows: list[dict]) -> collections.Counter:
    """Responses per (epoch, prompt) among trained and dropped rows."""
    responses = collections.Counter()
    for row in rows:
        _, e, p, _ = row["uid"].split("-")
        responses[(int(e[1:]), int(p[1:]))] += 1
    return responses


def test_a_run_stopped_twice_and_resumed_on_other_rank_counts_trains_every_sample_once(tmp_path):
    """Fully async with periodic checkpoints between the stops: 2 rollout x 2 trainer ranks,
    stopped by SIGTERM; resumed on 1 x 1, stopped again; finished on 3 x 1. The data order
    is the leader's: every prompt of the epoch's order is generated once, in order, whatever
    the ranks; every sample is trained exactly once, none lost; each stop checkpointed at
    once and the goodput record adds up over the three attempts."""
    run_dir = tmp_path / "run"
    launched = []  # each submit's (start, exit), measured outside it
    # The stops come once steps 9 and 24 are logged, from a test process the machine may
    # starve for seconds: the first attempts' end is out of reach, and the last resume sets
    # the run's length, at least 40 steps (past the first epoch: 16 steps of 4 groups).
    args = [*SMALL, "trainer.total_steps=100000", "checkpoint.save_every=7",
            "async_training.staleness_threshold=0.5", "data.reward_fn=tests.integration.faults:slow"]  # fmt: skip
    launched.append(time.time())
    run = Run.start(run_dir, *args, rollout_ranks=2, train_ranks=2)
    run.wait_for_step(9)
    run.stop()  # exit 143
    launched[-1] = (launched[-1], time.time())
    assert (run_dir / "preempted").exists()
    launched.append(time.time())
    run.resume(rollout_ranks=1, train_ranks=1).wait_for_step(24)
    run.stop()  # exit 143
    launched[-1] = (launched[-1], time.time())
    assert json.loads((run_dir / "launch.json").read_text())["rollout_ranks"] == 1
    steps = max(40, checkpoint_step(list_checkpoints(run_dir)[0]) + 10)
    launched.append(time.time())
    done = run.resume(f"trainer.total_steps={steps}", rollout_ranks=3).finish()
    launched[-1] = (launched[-1], time.time())
    assert done.returncode == 0, done.stderr
    assert not (run_dir / "preempted").exists()

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert metrics[-1]["samples/total"] == steps * 4 * 8  # as many as an uninterrupted run
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    dropped = read_jsonl(run_dir / "dropped_samples.jsonl")
    trained_uids = [r["uid"] for r in trained]
    assert len(trained_uids) == len(set(trained_uids)) == steps * 32, "a sample trained twice"
    assert not set(trained_uids) & {r["uid"] for r in dropped}
    assert {r["rollout_rank"] for r in trained} == {0, 1, 2}  # all three layouts trained
    assert all(r["reason"] in ("stale", "run_ended") for r in dropped)
    # Nothing lost: the groups of all ranks are exactly a prefix of the run's data order,
    # with all n responses of every group accounted for.
    responses = prompts_generated(trained + dropped)
    assert set(responses.values()) == {8}
    assert set(responses) == order_prefix(seed=1, num_prompts=64, count=len(responses))
    # 40 steps or more x 4 groups from 64 prompts: past the first epoch, each prompt once in it
    assert sorted(p for (e, p) in responses if e == 0) == list(range(64))
    # goodput: three attempts, each inside the submit that ran it (its start the launcher
    # process's, read from /proc in clock ticks: 0.05 s for the tick and the boot time's
    # rounding), whose times add up to the run's wall time, from the first launcher's
    # start to the last one's end; each stop checkpointed at once: the next attempt
    # resumed from the step it stopped at, nothing trained was lost
    attempts = read_jsonl(run_dir / "goodput.jsonl")
    assert [a["attempt"] for a in attempts] == [0, 1, 2]
    assert [a["reason"] for a in attempts] == ["signal SIGTERM"] * 2 + ["finished"]
    for a, (started, exited) in zip(attempts, launched, strict=True):
        assert started - 0.05 <= a["start"] < a["end"] <= exited, (a, started, exited)
        assert a["wall_s"] == pytest.approx(a["end"] - a["start"], abs=1e-6), a
    assert attempts[0]["lost_s"] == 0
    for before, a in zip(attempts[:-1], attempts[1:], strict=True):
        assert a["requeue_wait_s"] == pytest.approx(a["start"] - before["end"], abs=1e-6), a
        assert 0 <= a["lost_s"] <= before["wall_s"], a  # the stop's shutdown after its checkpoint
    recorded = sum(a["wall_s"] + a["requeue_wait_s"] for a in attempts)
    assert recorded == pytest.approx(attempts[-1]["end"] - attempts[0]["start"], abs=1e-6)
    assert [a["resumed_step"] for a in attempts[1:]] == [a["end_step"] for a in attempts[:2]]
    assert all(0 <= a["stop_latency_s"] <= a["wall_s"] for a in attempts[:2]), attempts


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 steps on 2 trainer ranks, checkpoints at steps 2, 4 and 6. Tests change a copy."""
    run_dir = tmp_path_factory.mktemp("two_rank_run") / "run"
    args = ["--train-ranks", "2", *SMALL, "trainer.total_steps=6", "checkpoint.save_every=2"]
    proc = Run.start(run_dir, *args).finish()
    assert proc.returncode == 0, proc.stderr
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def test_a_corrupt_or_missing_part_is_named_and_its_checkpoint_skipped(two_rank_run, tmp_path):
    run_dir = copy_of(two_rank_run, tmp_path)
    newest, older = list_checkpoints(run_dir)[:2]
    assert newest.name == "step_00000006" and older.name == "step_00000004"
    # a flipped byte in trainer rank 1's part: its size is right, so only the rank that
    # reads it (trainer rank 1, verifying in parallel) can tell
    part = newest / "trainer1.h5"
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    part.write_bytes(bytes(raw))
    resumed = Run(run_dir).resume("trainer.total_steps=8").finish()
    assert resumed.returncode == 0, resumed.stderr
    warnings = [line for line in resumed.stderr.splitlines() if "trainer1.h5" in line]
    assert len(warnings) == 1 and "step_00000006" in warnings[0], resumed.stderr
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 9))
    # a part gone from every checkpoint: refused before any rank starts, one line each
    for folder in list_checkpoints(run_dir):
        (folder / "rollout0.h5").unlink()
    failed = Run(run_dir).resume("trainer.total_steps=10").finish()
    assert failed.returncode == 2
    assert "no valid checkpoint" in failed.stderr
    assert failed.stderr.count("part rollout0.h5 is missing") == len(list_checkpoints(run_dir))


def test_a_rank_killed_while_parts_are_written_leaves_the_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--train-ranks", "2", *SMALL, "trainer.total_steps=6", "checkpoint.save_every=2",
            "trainer.max_restarts=0"]  # the resume below, by hand  # fmt: skip
    # world rank 2 (trainer1.h5) killed once its part of step 4 is written, before the commit
    run = Run.start(run_dir, *args, env={"HPC_ASYNCPPO_FAULTS": "kill_rank@part_written=4:rank=2"})
    killed = run.finish()
    assert killed.returncode != 0 and "killed by signal 9" in killed.stderr, killed.stderr
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000002"]
    assert (run_dir / "checkpoints" / "step_00000004" / "trainer1.h5").exists()  # no manifest
    resumed = run.resume().finish()
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout and "step_00000002" in resumed.stdout
    trained = [r["uid"] for r in read_jsonl(run_dir / "trained_samples.jsonl")]
    assert len(trained) == len(set(trained)) == 6 * 4 * 8
    # the rollout rank read its own part and nothing of the trainer's
    log = (run_dir / "logs" / "rank0.log").read_text()
    line = next(x for x in log.splitlines() if "resume read" in x)
    assert (
        "from rollout0.h5 only" in line and int(line.split("resume read ")[1].split()[0]) < 50_000
    )
    # the killed attempt's parts of step 4 were cleared; the resumed run committed its own
    assert [p.name for p in list_checkpoints(run_dir)] == [
        "step_00000006",
        "step_00000004",
        "step_00000002",
    ]
    assert read_manifest(step_dir(run_dir, 4))["step"] == 4


def test_checkpoint_of_another_model_shape_is_refused(two_rank_run, tmp_path):
    run_dir = copy_of(two_rank_run, tmp_path)
    other = build_tiny_model(
        tmp_path / "wide", load_task(DataConfig()).vocabulary(), TinyModelConfig(hidden_size=32), 1
    )
    resumed = Run(run_dir).resume(f"model.path={other}", "trainer.total_steps=8").finish()
    assert resumed.returncode != 0
    assert "has shape" in resumed.stderr and "the model has" in resumed.stderr


def test_slow_trainer_spills_to_the_overflow_file_and_loses_nothing(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--rollout-ranks", "2", *SMALL, "trainer.total_steps=12", "actor.ppo_epochs=8",
            "async_training.staleness_threshold=3", "async_training.max_staleness=2",
            "buffer.memory_limit_mb=0.005", "checkpoint.save_every=5"]  # fmt: skip
    proc = Run.start(run_dir, *args).finish()
    assert proc.returncode == 0, proc.stderr
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert max(m["queue/spilled_groups"] for m in metrics) > 0, "nothing spilled"
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    dropped = read_jsonl(run_dir / "dropped_samples.jsonl")
    assert len(trained) == 12 * 32
    uids = [r["uid"] for r in trained + dropped]
    assert len(uids) == len(set(uids))
    groups = collections.Counter(u.rsplit("-", 1)[0] for u in uids)
    assert set(groups.values()) == {8}
    assert json.loads(json.dumps(metrics[-1]))["samples/dropped"] == sum(
        r["reason"] == "stale" for r in dropped
    )


def test_after_a_resume_every_version_names_one_weight_set(tmp_path):
    """A checkpoint between two syncs holds weights trained past the last broadcast version:
    the resumed run broadcasts them as a new version, so no version names two weight sets."""
    run_dir = tmp_path / "run"
    args = [*SMALL, "trainer.total_steps=3", "async_training.trigger_parameter_sync_step=2",
            "checkpoint.save_every=0", "trainer.record_weight_digests=true"]  # fmt: skip
    run = Run.start(run_dir, *args)
    assert run.finish().returncode == 0
    resumed = run.resume("trainer.total_steps=6").finish()
    assert resumed.returncode == 0, resumed.stderr
    leader = read_jsonl(run_dir / "weights" / "rank1.jsonl")
    digests: dict[int, set[str]] = collections.defaultdict(set)
    for row in leader:
        digests[row["version"]].add(row["digest"])
    assert all(len(d) == 1 for d in digests.values()), digests
    # 0, 1 (after step 2), the resume's 2 (step 3's weights), 3 and 4 (after steps 4 and 6)
    assert sorted(digests) == [0, 1, 2, 3, 4]
    rollout = read_jsonl(run_dir / "weights" / "rank0.jsonl")
    assert {(r["version"], r["digest"]) for r in rollout} == {
        (r["version"], r["digest"]) for r in leader
    }
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    assert {r["param_version_start"] for r in trained} <= set(digests)


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of 64 MiB (tmpfs) at tmp_path/disk, to fill: mounting needs root,
    which CI has; elsewhere the test skips without it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot mount a tmpfs to fill: {mounted.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs to fill (root needed): {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` but ``leave`` bytes: the file that holds the rest."""
    filler = disk / "filler"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with filler.open("wb") as f:
        f.truncate(0)
        os.posix_fallocate(f.fileno(), 0, max(0, free - leave))
    return filler


def test_a_stop_on_a_full_disk_still_requeues_from_the_previous_checkpoint(small_disk):
    """The disk fills up mid-run (a real filesystem, 256 KiB left: logs and metrics still
    fit, a trainer part of the stop's checkpoint, 0.6 MB, does not): the stop's checkpoint
    fails the way h5py fails, the job still ends as preempted (exit 143, the marker the
    batch script requeues on), with the reason in one line and no half-written checkpoint;
    once there is room again it resumes from the checkpoint before, losing nothing."""
    run_dir = small_disk / "run"
    run = Run.start(run_dir, *SMALL, "trainer.total_steps=3")
    first = run.finish()
    assert first.returncode == 0, first.stderr  # its final checkpoint: step 3
    run.resume("trainer.total_steps=400", "checkpoint.save_every=0",
               "data.reward_fn=tests.integration.faults:slow")  # fmt: skip
    run.wait_for_step(6)
    filler = fill(small_disk, leave=256 * 1024)
    err = run.stop().stderr  # exit 143
    failed = [
        line for line in err.splitlines() if "checkpoint at step" in line and "failed" in line
    ]
    assert len(failed) == 1 and "No space left" in failed[0], err
    assert "Traceback" not in err, err
    assert (run_dir / "preempted").exists()  # so the batch script requeues
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000003"]
    assert not [p for p in (run_dir / "checkpoints").rglob("*") if p.name.startswith(".")]
    filler.unlink()  # room again
    done = run.resume("trainer.total_steps=8").finish()
    assert done.returncode == 0, done.stderr
    assert "step_00000003" in done.stdout
    trained = [r["uid"] for r in read_jsonl(run_dir / "trained_samples.jsonl")]
    assert len(trained) == len(set(trained)) == 8 * 32
    attempts = read_jsonl(run_dir / "goodput.jsonl")
    assert [a["reason"] for a in attempts] == ["finished", "signal SIGTERM", "finished"]
    assert attempts[2]["resumed_step"] == 3 and attempts[2]["lost_s"] > 0  # the lost attempt
