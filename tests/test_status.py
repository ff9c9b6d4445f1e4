"""``python -m hpc_asyncppo.status`` and its readers on hand-made run directories.

Real runs (finished, killed, restarted) are checked in test_report.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_asyncppo import status
from hpc_asyncppo.paths import METRICS
from hpc_asyncppo.runlog import MetricsWriter
from hpc_asyncppo.timeline import Timeline


def metrics_row(step: int, reward: float = 0.5, version: int = 0) -> dict:
    return {
        "step": step,
        "param_version": version,
        "reward/mean": reward,
        "staleness/mean": 0.5,
        "staleness/max": 1,
        "samples/total": 128 * step,
        "samples/dropped": 0,
        "queue/groups": 2,
        "time/elapsed_s": float(step),
        "throughput/samples_per_s": 128.0,
        "trainer/idle_ratio": 0.25,
        "rollouter/idle_ratio": 0.1,
        "sync/time_s": 0.01,
    }


def write_rank(run_dir: Path, rank: int, role: str, state: str, pid: int, t: float) -> None:
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    info = {"rank": rank, "role": role, "host": socket.gethostname(), "pid": pid, "state": state}
    (run_dir / "ranks" / f"rank{rank}.json").write_text(json.dumps({**info, "time": t}))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.yaml").write_text("trainer:\n  total_steps: 20\n")
    return tmp_path


def test_a_resumed_runs_metrics_keep_the_last_row_of_each_step(run_dir: Path) -> None:
    rows = [metrics_row(s, reward=0.1) for s in range(1, 6)]  # first attempt: steps 1..5
    rows += [metrics_row(s, reward=0.9) for s in range(4, 8)]  # resumed from a step-3 checkpoint
    (run_dir / METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = status.metrics_rows(run_dir)
    assert [r["step"] for r in kept] == list(range(1, 8))
    assert [r["reward/mean"] for r in kept] == [0.1] * 3 + [0.9] * 4


def test_attempts_count_the_timeline_sessions(run_dir: Path) -> None:
    assert status.attempts_of(run_dir) == 1
    for _ in range(3):
        Timeline(run_dir, 0, "rollout").close()
    Timeline(run_dir, 1, "trainer").close()
    assert status.attempts_of(run_dir) == 3


def test_last_checkpoint_is_the_highest_step(run_dir: Path) -> None:
    assert status.last_checkpoint(run_dir) is None
    ckpts = run_dir / "checkpoints"
    for step in (10, 100, 20, 200):
        (ckpts / f"step_{step:08d}").mkdir(parents=True)
        if step != 200:  # 200 never got its manifest: not a checkpoint
            (ckpts / f"step_{step:08d}" / "manifest.json").write_text("{}")
    found = status.last_checkpoint(run_dir)
    assert found.path.name == "step_00000100" and found.step == 100


def test_states_from_the_ranks_records(run_dir: Path) -> None:
    now = time.time()
    write_rank(run_dir, 0, "rollout", "done", dead_pid(), now)
    write_rank(run_dir, 1, "trainer", "done", dead_pid(), now)
    assert status.collect(run_dir).state == "finished"
    write_rank(run_dir, 1, "trainer", "running", os.getpid(), now)
    assert status.collect(run_dir).state == "running"
    write_rank(run_dir, 1, "trainer", "running", dead_pid(), now)
    assert status.collect(run_dir).state == "killed"  # nobody alive, nobody said done


def test_an_error_from_an_earlier_attempt_is_old(run_dir: Path) -> None:
    (run_dir / "errors").mkdir()
    (run_dir / "errors" / "rank1.txt").write_text("rank 1 (trainer, h): RuntimeError: boom\n\ntb")
    past = time.time() - 100
    os.utime(run_dir / "errors" / "rank1.txt", (past, past))
    write_rank(run_dir, 0, "rollout", "running", os.getpid(), time.time())
    write_rank(run_dir, 1, "trainer", "running", os.getpid(), time.time())
    st = status.collect(run_dir)
    assert st.state == "running" and not st.errors[0].current
    write_rank(run_dir, 1, "trainer", "failed", os.getpid(), time.time())
    st = status.collect(run_dir)
    assert st.state == "failed" and st.errors[0].current


def test_the_screen_shows_where_the_run_stands(run_dir: Path, capsys) -> None:
    writer = MetricsWriter(run_dir)
    writer.write([metrics_row(s, version=s // 4) for s in range(1, 13)])
    writer.close()
    write_rank(run_dir, 0, "rollout", "running", os.getpid(), time.time())
    write_rank(run_dir, 1, "trainer", "running", os.getpid(), time.time())
    (run_dir / "errors").mkdir()
    (run_dir / "checkpoints" / "step_00000008").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000008" / "manifest.json").write_text("{}")
    assert status.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "running" in out and "step        12/20 (60%)  param version 3" in out
    assert "step_00000008 (step 8," in out
    assert "128.0 samples/s" in out and "trainer 25%" in out and "1536 trained" in out


def test_the_screen_shows_what_each_rank_is_doing_while_it_runs(run_dir: Path, capsys) -> None:
    write_rank(run_dir, 0, "rollout", "running", os.getpid(), time.time())
    write_rank(run_dir, 1, "trainer", "running", os.getpid(), time.time())
    (run_dir / "heartbeats").mkdir()
    for rank, doing in ((0, "generating under weights version 3"), (1, "training step 13")):
        beat = {"attempt": "1.0", "count": 4, "doing": doing}
        (run_dir / "heartbeats" / f"rank{rank}.json").write_text(json.dumps(beat))
    old = time.time() - 600  # rank 0's last beat, 10 minutes ago: stopped or hung
    os.utime(run_dir / "heartbeats" / "rank0.json", (old, old))
    assert status.main([str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    doing = [line for line in out if "(last beat" in line]
    assert doing[0].startswith("doing       rank 0 (rollout): generating under weights version 3")
    assert doing[0].endswith("(last beat 10 min ago)")
    assert doing[1].strip().startswith("rank 1 (trainer): training step 13 (last beat")


def test_the_screen_before_the_first_step(run_dir: Path, capsys) -> None:
    assert status.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "not started" in out and "0/20" in out


def test_tensorboard_gets_the_same_scalars_as_metrics_jsonl(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path)
    writer.write([metrics_row(s) for s in (1, 2, 3)])
    writer.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "reward/mean" in acc.Tags()["scalars"]
    assert [(e.step, e.value) for e in acc.Scalars("samples/total")] == [
        (1, 128),
        (2, 256),
        (3, 384),
    ]
    row = json.loads((tmp_path / METRICS).read_text().splitlines()[0])
    assert row["time/unix"] == pytest.approx(time.time(), abs=60)
