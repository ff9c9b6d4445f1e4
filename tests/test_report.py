"""The report and status of real local runs: finished, killed midway, and restarted.

Each run is a real job under mpirun (tiny model, a few steps). The report's numbers must
agree with metrics.jsonl. Its idle ratios come from two clocks (the ranks' counters and
the timeline's spans, read at instants that the machine's load moves apart), so here they
are held to what holds at any pace: ratios in [0, 1], spans in order and inside their
session, checkpoints' counters that only grow. The bookkeeping behind them is checked
exactly on an injected clock: tests/test_timeline.py, tests/trainer/test_progress.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from hpc_asyncppo import report, status
from hpc_asyncppo import timeline as tl
from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.config import load_resolved
from hpc_asyncppo.paths import METRICS, REPORT, TRAINED
from hpc_asyncppo.runlog import read_jsonl
from tests.harness import HANG_S, Run

pytestmark = pytest.mark.mpi

# The killed run's end is out of reach of a kill from a test process the machine may starve
# for seconds; its resumed copy ends RESUMED_STEPS past the checkpoint it resumes from.
KILLED_TOTAL_STEPS, RESUMED_STEPS = 100_000, 10


# A staleness budget of 0.1 (not the default 0.5) keeps the leader's queue shallow: the
# leader waits for samples at most steps, and its idle ratio moves.
SHALLOW_QUEUE = ["async_training.staleness_threshold=0.1", "algorithm.rollout_is=none"]


def submit(run_dir: Path, *args: str, **ranks: int) -> Run:
    # its own process group: the killed-run test kills the launcher, mpirun and every rank
    return Run.start(
        run_dir, *args, *SHALLOW_QUEUE, env={"PYTHONUNBUFFERED": "1"}, own_session=True, **ranks
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("report") / "finished"
    proc = submit(run_dir, "trainer.total_steps=10", train_ranks=2).finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def killable(rows: list[dict]) -> bool:
    return len(rows) >= 7 and rows[-1]["time/unix"] - rows[0]["time/unix"] > 2 * tl.FLUSH_EVERY_S


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("report") / "killed"
    run = submit(run_dir, f"trainer.total_steps={KILLED_TOTAL_STEPS}", "checkpoint.save_every=5")
    # past the checkpoint of step 5, and long enough that the ranks flushed their timelines
    run.wait_until(lambda: killable(read_jsonl(run_dir / METRICS)), "steps before the kill")
    # Like a lost node: every rank, mpirun and the launcher at once. Each has its own
    # process group (mpirun its own session, each rank its own group).
    pids = [info["pid"] for info in status.read_rank_info(run_dir)]
    launcher = run.proc.pid
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in children:  # mpirun
        os.killpg(int(pid), signal.SIGKILL)
    run.kill()  # the launcher's process group
    deadline = time.monotonic() + HANG_S
    while any(status.process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(status.process_alive(p) for p in pids), "a rank outlived its process group"
    return run_dir


@pytest.fixture(scope="module")
def resumed_run(killed_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the killed run, started again: it resumes from its step-5 checkpoint."""
    run_dir = tmp_path_factory.mktemp("report") / "resumed"
    shutil.copytree(killed_run, run_dir)
    total = protocol.checkpoint_step(protocol.list_checkpoints(run_dir)[0]) + RESUMED_STEPS
    proc = Run(run_dir).resume(f"trainer.total_steps={total}").finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def pairs(items: list) -> list[tuple]:
    return list(zip(items[:-1], items[1:], strict=True))


def check_idle_ratios(run_dir: Path) -> None:
    """The logged idle ratios of every step, and the leader's recomputed from the timeline at
    each step's time, are fractions; each rank's spans of one kind follow one another, and
    the leader's wait for a step ends before its training of that step begins."""
    data = report.load(run_dir)
    for row in data.rows:
        assert 0 <= row["trainer/idle_ratio"] <= 1, row
        assert 0 <= row["rollouter/idle_ratio"] <= 1, row
    leader = data.timeline[data.leader]
    for row in data.rows:
        ratio = tl.trainer_idle_ratio(leader, row["time/unix"])
        assert ratio is None or 0 <= ratio <= 1, (row["step"], ratio)
    trainers = [r for r in data.timeline if r not in data.rollout_ranks()]
    for rank in trainers:
        for session in data.timeline[rank]:
            for kind in ("wait", "train", "checkpoint"):  # one after another in its loop
                spans = session.of(kind)
                assert all(s["start"] <= s["end"] for s in spans), kind
                assert all(a["end"] <= b["start"] for a, b in pairs(spans)), (rank, kind)
    for session in leader:
        waits = {s["step"]: s for s in session.of("wait")}
        for train in session.of("train"):
            if train["step"] in waits:
                assert waits[train["step"]]["end"] <= train["start"], train


def check_checkpoint_times(run_dir: Path) -> None:
    """Each checkpoint's elapsed and waiting seconds, which a resume carries on from: the
    waiting a part of the elapsed time, both growing from one checkpoint to the next."""
    manifests = [protocol.read_manifest(path) for path in protocol.list_checkpoints(run_dir)]
    manifests.sort(key=lambda m: m["step"])
    assert manifests
    for m in manifests:
        assert 0 <= m["idle_s"] <= m["elapsed_s"], m
    for a, b in pairs(manifests):
        assert a["elapsed_s"] < b["elapsed_s"] and a["idle_s"] <= b["idle_s"], (a, b)


def check_panels(fig, data: report.RunData) -> None:
    """What the report draws is the run's data: the curves are the logged rows, the
    timelines have a bar for each rank's spans."""
    panels = {ax.get_title(): ax for ax in fig.axes}
    rows = data.rows
    steps = [r["step"] for r in rows]

    def curve(title: str, i: int = 0) -> tuple[list, list]:
        line = panels[title].get_lines()[i]
        return list(line.get_xdata()), list(line.get_ydata())

    reward = curve("reward (mean over the step's samples)")
    assert reward == (steps, [r["reward/mean"] for r in rows])
    idle = "idle ratio since the first weight sync"
    assert curve(idle, 0) == (steps, [r["trainer/idle_ratio"] for r in rows])
    assert curve(idle, 1) == (steps, [r["rollouter/idle_ratio"] for r in rows])
    throughput = "throughput (samples trained / s)"
    assert curve(throughput) == (steps, [r["throughput/samples_per_s"] for r in rows])
    gantt = panels["timeline of every rank (whole run; dashed: a rank restarted)"]
    labels = [t.get_text() for t in gantt.get_yticklabels()]
    assert len(labels) == len(data.timeline) and gantt.collections


def check_report_agrees_with_metrics(run_dir: Path, capsys) -> report.Summary:
    assert report.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    png = run_dir / REPORT
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = report.load(run_dir)
    summary = report.summarize(data)
    rows = status.metrics_rows(run_dir)
    check_panels(report.figure(data, summary), data)
    last = rows[-1]
    assert summary.steps == last["step"] and summary.param_version == last["param_version"]
    assert summary.samples_trained == last["samples/total"]
    checked = rows[summary.idle_step - 1]
    assert summary.idle_step >= last["step"] - 10  # at most a second behind
    assert summary.trainer_idle_logged == checked["trainer/idle_ratio"]
    assert 0 <= summary.trainer_idle_timeline <= 1
    assert 0 <= summary.rollout_idle_timeline <= 1
    n = summary.reward_window
    assert summary.reward_last == pytest.approx(sum(r["reward/mean"] for r in rows[-n:]) / n)
    assert f"step {last['step']}/" in out and f"{last['samples/total']} trained" in out
    return summary


def test_finished_run_report(finished_run: Path, capsys) -> None:
    summary = check_report_agrees_with_metrics(finished_run, capsys)
    assert summary.state == "finished" and summary.steps == 10 and summary.attempts == 1
    assert summary.idle_step == 10
    trained = read_jsonl(finished_run / TRAINED)
    assert summary.staleness_max == max(r["staleness"] for r in trained)
    assert summary.samples_trained == len(trained)


def test_finished_run_idle_ratios_match_the_timeline(finished_run: Path) -> None:
    check_idle_ratios(finished_run)


def test_finished_run_timeline_has_every_rank_and_span(finished_run: Path) -> None:
    timeline = tl.read_timeline(finished_run)
    assert sorted(timeline) == [0, 1, 2]  # 1 rollout rank, a leader and a follower
    kinds = {r: {s["span"] for s in sessions[-1].spans} for r, sessions in timeline.items()}
    assert {"generate", "send", "wait", "sync"} <= kinds[0]
    assert {"wait", "train", "sync"} <= kinds[1]
    assert {"wait", "train"} <= kinds[2]
    steps = [s["step"] for s in timeline[1][-1].of("train")]
    assert steps == list(range(1, 11))
    assert [s["step"] for s in timeline[2][-1].of("train")] == steps


def test_finished_run_tensorboard(finished_run: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(finished_run / "tensorboard"))
    acc.Reload()
    rows = status.metrics_rows(finished_run)
    scalars = acc.Scalars("reward/mean")
    assert [e.step for e in scalars] == [r["step"] for r in rows]
    assert [e.value for e in scalars] == pytest.approx([r["reward/mean"] for r in rows])
    assert {"trainer/idle_ratio", "throughput/samples_per_s", "actor/pg_loss"} <= set(
        acc.Tags()["scalars"]
    )
    # the always-on learning metrics (entropy with its coefficient 0), in the log and here
    learning = {"actor/entropy", "rollout_corr/kl", "rollout_corr/k3_kl",
                "batch/zero_variance_groups", "response_length/mean", "sync/pause_s"}  # fmt: skip
    assert learning <= set(rows[-1]) and learning <= set(acc.Tags()["scalars"])


def test_finished_run_status(finished_run: Path, capsys) -> None:
    assert status.main([str(finished_run)]) == 0
    out = capsys.readouterr().out
    assert "finished" in out and "step        10/10 (100%)" in out
    assert "1 rollout + 2 trainer ranks" in out


def test_killed_run_report_and_status(killed_run: Path, capsys) -> None:
    summary = check_report_agrees_with_metrics(killed_run, capsys)
    assert summary.state == "killed" and 7 <= summary.steps < KILLED_TOTAL_STEPS
    assert summary.checkpoint is not None and summary.checkpoint.step >= 5
    check_idle_ratios(killed_run)
    check_checkpoint_times(killed_run)
    assert status.main([str(killed_run)]) == 0
    assert "killed" in capsys.readouterr().out


def test_resumed_run_report(killed_run: Path, resumed_run: Path, capsys) -> None:
    summary = check_report_agrees_with_metrics(resumed_run, capsys)
    assert summary.state == "finished" and summary.attempts == 2
    total = load_resolved(resumed_run / "config.yaml").trainer.total_steps
    assert summary.steps == total
    assert summary.checkpoint.path.name == f"step_{total:08d}"
    data = report.load(resumed_run)
    assert [r["step"] for r in data.rows] == list(range(1, total + 1))
    # the steps up to the checkpoint it resumed from are the killed attempt's
    resumed_from = data.timeline[data.leader][-1].of("train")[0]["step"] - 1
    killed = {r["step"]: r for r in status.metrics_rows(killed_run)}
    assert resumed_from >= 5
    assert all(r == killed[r["step"]] for r in data.rows[:resumed_from])
    per_step = data.rows[0]["samples/total"]
    assert len(data.trained) == summary.samples_trained == total * per_step
    check_idle_ratios(resumed_run)
