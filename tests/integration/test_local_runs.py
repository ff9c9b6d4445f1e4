"""Real runs under mpirun: rollout and trainer ranks, MPI samples, gloo weight syncs."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal

import pytest

from hpc_asyncppo.runlog import read_jsonl
from hpc_asyncppo.runtime.heartbeat import interval_s
from hpc_asyncppo.timeline import read_timeline
from tests.harness import SMALL, SMALL_AUDITED, Run, check_audit, check_weights_match, sent_versions

pytestmark = pytest.mark.mpi


# Several rollout ranks beside a sharded trainer. One trainer rank is
# test_sync_mode_is_on_policy's (the same audit and weight checks); one rollout rank beside
# two trainer ranks is test_killed_and_stopped_ranks_restart_the_job_which_trains_every_
# sample_once's (the audit) and test_sharded_training.py's; its weight digests at every
# version, test_vllm_runs.py's stop-and-restart run's. (1, 1), (1, 2) and (2, 2) ran here
# too and checked nothing these do not (each launch costs ~10 s of rank start-up).
@pytest.mark.parametrize(("rollout_ranks", "train_ranks"), [(3, 2)])
def test_topology_trains_syncs_and_stays_within_staleness(tmp_path, rollout_ranks, train_ranks):
    run_dir = tmp_path / "run"
    proc = Run.start(
        run_dir, *SMALL_AUDITED, rollout_ranks=rollout_ranks, train_ranks=train_ranks
    ).finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert metrics[-1]["samples/total"] == 6 * 32
    # versions 0..3: initial sync, then after steps 2, 4 and 6
    check_weights_match(run_dir, rollout_ranks, versions=4)
    trained = check_audit(run_dir, sync_every=2, max_staleness=4)
    assert len(trained) == 6 * 32
    assert {row["rollout_rank"] for row in trained} == set(range(rollout_ranks))
    ranks = {
        r["rank"]: r
        for r in (json.loads(p.read_text()) for p in (run_dir / "ranks").glob("*.json"))
    }
    assert [ranks[i]["role"] for i in range(rollout_ranks + train_ranks)] == (
        ["rollout"] * rollout_ranks + ["trainer"] * train_ranks
    )
    assert all(r["state"] == "done" for r in ranks.values())
    # every trainer rank's steps say where their time went (scripts/profile_step.py), the
    # leader's as it logged them
    for rank in range(rollout_ranks, rollout_ranks + train_ranks):
        [session] = read_timeline(run_dir)[rank]
        trains = session.of("train")
        assert [t["step"] for t in trains] == list(range(1, 7)), rank
        for t in trains:
            assert set(t["phases"]) == {"log_probs", "forward", "backward", "optimizer"}
            assert 0 < sum(t["phases"].values()) <= t["end"] - t["start"], (rank, t)
        if rank == rollout_ranks:
            logged = [m["time/forward_s"] for m in metrics]
            assert logged == [t["phases"]["forward"] for t in trains]


def test_sync_mode_is_on_policy(tmp_path):
    run_dir = tmp_path / "run"
    proc = Run.start(run_dir, *SMALL_AUDITED, "async_training.mode=sync", rollout_ranks=2).finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trained = check_audit(run_dir, sync_every=1, max_staleness=0)
    assert {row["staleness"] for row in trained} == {0}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["param_version"] for m in metrics] == list(range(6))  # a sync after every step
    check_weights_match(run_dir, 2, versions=7)


def test_max_staleness_zero_drops_and_records_stale_samples(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        *SMALL_AUDITED,
        "async_training.max_staleness=0",
        "async_training.staleness_threshold=1.0",
        "trainer.total_steps=8",
    ]
    proc = Run.start(run_dir, *args, rollout_ranks=2).finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trained = check_audit(run_dir, sync_every=2, max_staleness=0)
    dropped = read_jsonl(run_dir / "dropped_samples.jsonl")
    # How many samples outlive their version depends on how far the rollout got ahead (the
    # machine's pace): whatever was dropped is checked; the drop itself, at a named moment,
    # in tests/trainer/test_intake.py
    assert {row["reason"] for row in dropped} <= {"stale", "run_ended"}
    assert all(row["staleness"] > 0 for row in dropped if row["reason"] == "stale")
    assert not {r["uid"] for r in trained} & {r["uid"] for r in dropped}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert metrics[-1]["samples/dropped"] == sum(1 for r in dropped if r["reason"] == "stale")


def test_dynamic_sampling_drops_flat_groups_refills_the_batch_and_the_audit_balances(tmp_path):
    """DAPO's dynamic sampling in a run: every group whose rewards are all equal (all of the
    even prompts, by this reward) is dropped with reason "filtered" and replaced, each step
    still trains a full batch, and every sent sample is trained or dropped exactly once."""
    run_dir = tmp_path / "run"
    args = [*SMALL_AUDITED, "algorithm.filter_groups.enable=true",
            "data.reward_fn=tests.integration.faults:flat_on_even_prompts",
            "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2"]  # fmt: skip
    proc = Run.start(run_dir, *args).finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trained = check_audit(run_dir, sync_every=2, max_staleness=4)
    assert len(trained) == 6 * 32  # refilled: a full batch every step
    dropped = read_jsonl(run_dir / "dropped_samples.jsonl")
    filtered = [r for r in dropped if r["reason"] == "filtered"]
    assert {r["reason"] for r in dropped} <= {"filtered", "stale", "run_ended"}
    groups: dict[str, list[float]] = {}
    for row in filtered:
        groups.setdefault(row["uid"].rsplit("-r", 1)[0], []).append(row["reward"])
    assert groups and all(
        len(set(rewards)) == 1 and len(rewards) == 8 for rewards in groups.values()
    )
    # no even prompt trained: each was filtered (or still queued at the end)
    assert not [r for r in trained if int(r["uid"].split("-")[2][1:]) % 2 == 0]
    # the audit balances: each sent group is trained or dropped, whole, and exactly once
    rows = trained + dropped
    uids = [r["uid"] for r in rows]
    assert len(uids) == len(set(uids)), "a sample trained or dropped twice"
    prefixes = collections.Counter(uid.rsplit("-r", 1)[0] for uid in uids)
    assert set(prefixes) == set(sent_versions(run_dir)) and set(prefixes.values()) == {8}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert sum(m["filter_groups/filtered_groups"] for m in metrics) == len(groups)
    assert metrics[-1]["samples/filtered"] == len(filtered)
    assert all(m["filter_groups/zero_variance_kept"] == 0 for m in metrics)  # no bound set
    assert all(m["reward/overlong_penalty_mean"] <= 0 for m in metrics)


def test_a_failing_rank_is_restarted_once_then_stopped_as_a_crash_loop(tmp_path):
    """Rollout rank 1's reward function fails after 64 calls, before the first checkpoint:
    the launcher restarts the job, which fails the same way with no checkpoint between, so
    it stops (not after trainer.max_restarts) and names the failure and the loop."""
    run_dir = tmp_path / "run"
    proc = Run.start(
        run_dir,
        "trainer.total_steps=200",
        "trainer.restart_backoff_s=1",
        "data.reward_fn=tests.integration.faults:raise_on_rank1",
        rollout_ranks=2,
    ).finish()
    assert proc.returncode != 0  # the harness's HANG_S is the bound: a hang fails
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "not restarted: a crash loop" in errors[0], proc.stderr
    assert "restarting it from its newest checkpoint in 1 s (restart 1 of 3)" in proc.stderr
    assert (
        "rank 1 (rollout" in proc.stderr
        and "injected failure in the reward function" in proc.stderr
    )
    attempts = read_jsonl(run_dir / "goodput.jsonl")
    assert [a["reason"] for a in attempts] == ["failed", "failed"], attempts
    assert all(any("injected failure" in line for line in a["failure"]) for a in attempts)
    assert attempts[1]["requeue_wait_s"] >= 1  # the back-off
    # the first attempt's record of its failure was kept apart from the second's
    assert "injected failure" in (run_dir / "errors" / "attempt0" / "rank1.txt").read_text()


def test_a_killed_rank_ends_the_job_within_bounded_time(tmp_path):
    """The trainer leader (world rank 2) killed as it begins step 3 (a fault at a named
    moment): the launcher names it and ends the job, with no restart left to make."""
    run_dir = tmp_path / "run"
    run = Run.start(run_dir, "trainer.total_steps=100000", "trainer.max_restarts=0",
                    rollout_ranks=2, env={"HPC_ASYNCPPO_FAULTS": "kill_rank@step=3:rank=2"})  # fmt: skip
    proc = run.finish()
    err = proc.stderr
    victim = run.rank_info(2)
    assert proc.returncode != 0
    assert [m["step"] for m in run.metrics()] == [1, 2], err  # it died before step 3
    assert (
        f"rank 2 (trainer, {victim['host']}, pid {victim['pid']}) died: killed by signal 9" in err
    ), err
    assert "not restarted: trainer.max_restarts=0 restarts made" in err, err


def test_killed_and_stopped_ranks_restart_the_job_which_trains_every_sample_once(tmp_path):
    """Three faults at named moments (``runtime/faults.py``), one per attempt: the rollout
    rank killed as the first bucket of its 2nd weight sync arrives; in the restarted attempt
    a trainer follower stopped (SIGSTOP: it never dies, its heartbeat stops) as it begins
    step 8; in the next one the rollout rank, the leader's sync peer, stopped as the first
    bucket of that attempt's 3rd sync arrives. Each time the attempt ends (a stopped rank
    named once trainer.stall_timeout_s has passed), the launcher starts the job again from
    its newest checkpoint, and the run finishes with every sample trained once and the
    failed attempts' lost work recorded.

    Why these moments: a sync every 4 steps, the first at the rank's start; the first attempt
    ends at its 2nd sync (after step 4) with at most a step or two trained from the queue, far
    from step 8; the second resumes from step 3 or 6 and stops before its 3rd sync (after
    step 8 or 12); the third resumes from step 6 and stops at its 3rd, after step 12."""
    run_dir = tmp_path / "run"
    steps, stall_s = 14, 10
    faults = ["kill_rank@bucket=1:rank=0:sync=2", "stop_rank@step=8:rank=2",
              "stop_rank@bucket=1:rank=0:sync=3"]  # fmt: skip
    run = Run.start(run_dir, *SMALL, f"trainer.total_steps={steps}", "checkpoint.save_every=3",
                    "trainer.restart_backoff_s=1", f"trainer.stall_timeout_s={stall_s}",
                    rollout_ranks=1, train_ranks=2, env={"HPC_ASYNCPPO_FAULTS": ",".join(faults)})  # fmt: skip
    try:
        proc = run.finish()
    finally:
        for row in read_jsonl(run_dir / "faults_fired.jsonl"):  # a stopped rank left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(row["pid"], signal.SIGKILL)
    fired = read_jsonl(run_dir / "faults_fired.jsonl")
    assert [row["fault"] for row in fired] == faults
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out + err
    assert err.count("restarting it from its newest checkpoint") == 3, err
    rows = run.attempts()
    assert [a["reason"] for a in rows] == ["failed", "failed", "failed", "finished"], rows
    # a stopped rank is named no sooner than the stall timeout after it stopped (less the
    # beat that may have come just before the stop)
    for attempt, fault in zip(rows[1:3], fired[1:], strict=True):
        assert attempt["end"] - fault["time"] >= stall_s - interval_s(stall_s), (attempt, fault)
    # each failed attempt's row names the rank killed or stopped (beside its peers' lost
    # connections), and a stopped rank's line says what it and the leader were doing
    assert any(x.startswith("rank 0 ") and "killed by signal 9" in x for x in rows[0]["failure"])
    [follower] = [x for x in rows[1]["failure"] if x.startswith("rank 2 ")]
    assert "fell silent: no heartbeat for trainer.stall_timeout_s=10 s" in follower, follower
    # what it last said it did (a beat every 2 s: a step, a sync, a checkpoint part...)
    assert "its last beat said it was " in follower and "the trainer leader is" in follower
    [rollout] = [x for x in rows[2]["failure"] if x.startswith("rank 0 ")]
    assert "fell silent" in rollout and "the trainer leader is" in rollout, rollout
    # each restart resumed from a checkpoint and lost the work since it
    resumed = [a["resumed_step"] for a in rows]
    assert resumed[1] in (3, 6) and resumed[2] == 6 and resumed[3] in (9, 12), rows
    assert all(a["lost_s"] > 0 for a in rows[1:]), rows
    # every sample trained exactly once, every group of the data order whole
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert sorted({m["step"] for m in metrics}) == list(range(1, steps + 1))
    trained = [r["uid"] for r in read_jsonl(run_dir / "trained_samples.jsonl")]
    assert len(trained) == len(set(trained)) == steps * 4 * 8, "a sample lost or trained twice"
    dropped = {r["uid"] for r in read_jsonl(run_dir / "dropped_samples.jsonl")}
    assert not dropped & set(trained)
    groups = collections.Counter(uid.rsplit("-r", 1)[0] for uid in [*trained, *dropped])
    assert set(groups.values()) == {8}
    # everything this run had trained is still accounted for
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    assert len({r["uid"] for r in trained}) == len(trained)


def test_a_run_driven_into_collapse_says_so_and_stop_on_collapse_ends_it_unrestarted(
    tmp_path, capsys
):
    """An absurd learning rate (0.5) wrecks the policy within a few steps: the collapse
    watch (``trainer/collapse.py``, a 5-step window here) names what it sees in the
    progress output and the report and, with trainer.stop_on_collapse, the attempt ends
    with that line, which the launcher does not restart (the same run would collapse
    again). A healthy run never names one: the default job at
    tests/integration/test_validation_runs.py."""
    from hpc_asyncppo import report

    run_dir = tmp_path / "run"
    proc = Run.start(run_dir, "actor.lr=0.5", "trainer.collapse_window=5",
                     "trainer.stop_on_collapse=true", "trainer.total_steps=100").finish()  # fmt: skip
    assert proc.returncode != 0
    warned = [line for line in proc.stdout.splitlines() if line.startswith("warning: collapse")]
    assert warned, proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "not restarted" in errors[0], proc.stderr
    [named] = [line for line in proc.stderr.splitlines() if "CollapseError: collapse" in line]
    assert named.strip().startswith("rank 1 (trainer") and "stop_on_collapse=true" in named
    assert warned[0].removeprefix("warning: ") in named  # the first sign ended it
    assert "Traceback" not in proc.stderr
    attempts = read_jsonl(run_dir / "goodput.jsonl")
    assert [a["reason"] for a in attempts] == ["failed"], attempts  # not restarted
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) < 100 and metrics[-1]["collapse/signs"] >= 1
    capsys.readouterr()
    report.main([str(run_dir)])
    assert warned[0].removeprefix("warning: ") in capsys.readouterr().out
