"""Faults at a named moment (runtime/faults.py): a child process reaches the moments its
fault names and dies (or stops) at exactly the one named, once per run. A fault in a real
run, mid-broadcast in a vLLM worker: tests/integration/test_vllm_runs.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_asyncppo.runtime import faults

HANG_S = 60  # a bound for a hang, never a speed
REACH = """
import sys
from hpc_asyncppo.runtime import faults
for sync in (1, 2):
    for bucket in (1, 2, 3):
        faults.at("bucket", bucket, sync=sync)
        print(sync, bucket, flush=True)
"""


def reach(run_dir: Path, spec: str, rank: int = 0) -> subprocess.Popen:
    env = {
        **os.environ,
        faults.FAULTS_ENV: spec,
        faults.RUN_DIR_ENV: str(run_dir),
        faults.RANK_ENV: str(rank),
    }
    return subprocess.Popen(
        [sys.executable, "-c", REACH], env=env, stdout=subprocess.PIPE, text=True
    )


def fired(run_dir: Path) -> list[str]:
    path = run_dir / "faults_fired.jsonl"
    return (
        [json.loads(line)["fault"] for line in path.read_text().splitlines()]
        if path.exists()
        else []
    )


def test_a_fault_fires_at_its_moment_and_once_per_run(tmp_path):
    spec = "kill_rank@bucket=2:sync=2:rank=0"
    proc = reach(tmp_path, spec)
    out, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode == -signal.SIGKILL
    assert out.split("\n")[:-1] == ["1 1", "1 2", "1 3", "2 1"]  # died as bucket 2 of sync 2 came
    assert fired(tmp_path) == [spec]
    again = reach(tmp_path, spec)  # the next attempt of the same run: fired already
    out, _ = again.communicate(timeout=HANG_S)
    assert again.returncode == 0 and len(out.split()) == 12
    assert fired(tmp_path) == [spec]


def test_a_fault_for_another_rank_does_not_fire(tmp_path):
    proc = reach(tmp_path, "kill_rank@bucket=1:rank=1", rank=0)
    proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0 and fired(tmp_path) == []


def test_a_stopped_process_stays_stopped_until_killed(tmp_path):
    proc = reach(tmp_path, "stop_rank@bucket=3:sync=1")
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
        assert proc.stdout.readline() == "1 1\n" and proc.stdout.readline() == "1 2\n"
    finally:
        proc.kill()
        proc.wait(timeout=HANG_S)
    assert fired(tmp_path) == ["stop_rank@bucket=3:sync=1"]


def test_kill_engine_outside_a_vllm_worker_kills_only_the_process(tmp_path):
    proc = reach(tmp_path, "kill_engine@bucket=1")
    proc.communicate(timeout=HANG_S)
    assert proc.returncode == -signal.SIGKILL  # and this test process, its parent, lives on


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("kill_rank", "is not ACTION@MOMENT=N"),
        ("kill_rank@bucket=x", "is not ACTION@MOMENT=N"),
        ("explode@bucket=1", "actions are kill_engine, kill_rank, stop_rank"),
        ("kill_rank@decode=1", "moments are bucket, step, part_written"),
        ("kill_rank@step=3:sync=1", "step takes the filters rank, not sync"),
        ("kill_rank@bucket=1:step=3", "bucket takes the filters rank, sync, not step"),
    ],
)
def test_a_malformed_fault_is_named(spec, says):
    with pytest.raises(ValueError, match=says) as err:
        faults.parse(f"kill_rank@bucket=1, {spec}")
    assert repr(spec) in str(err.value)


def test_no_faults_set_is_nothing_to_do(monkeypatch):
    monkeypatch.delenv(faults.FAULTS_ENV, raising=False)
    faults.at("bucket", 1, sync=1)  # returns: nothing set
    assert faults.parse("") == [] and faults.parse(" , ") == []
