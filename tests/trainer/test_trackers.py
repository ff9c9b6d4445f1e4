"""The experiment trackers (``trainer/trackers.py``) with the real ``wandb`` (offline: the
files it writes, read with its own protobuf classes) and the real ``mlflow`` (a file store,
read back through its client): a run's rows, then a resumed attempt that writes some steps
and a validation again, each step in the trackers once, in one W&B run and one MLflow run;
asking for a tracker that is not installed is one line. (In a real run, stopped and
resumed: ``integration/test_validation_runs.py``.)"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from hpc_asyncppo.config import ConfigError, load_config
from hpc_asyncppo.goodput import GOODPUT
from hpc_asyncppo.trainer import trackers
from hpc_asyncppo.trainer.trackers import Trackers
from tests.harness import mlflow_run, wandb_history, wandb_records

STEPS = 8


def step_row(step: int, reward: float) -> dict:
    return {"step": step, "param_version": step // 2, "reward/mean": reward,
            "time/unix": 1.8e9 + step}  # fmt: skip


def val_row(step: int, passed: float) -> dict:
    return {"step": step, "val/param_version": step // 2, "val/pass@1": passed,
            "val/reward/mean": passed, "time/unix": 1.8e9 + step + 0.5}  # fmt: skip


def attempts(run_dir: Path, *rows: dict) -> None:
    (run_dir / GOODPUT).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_resumed_run_logs_each_step_once_in_the_same_tracker_runs(tmp_path, capsys):
    cfg = load_config(None, ["trainer.logger=[console,wandb,mlflow]",
                             f"trainer.total_steps={STEPS}", "trainer.project_name=proj",
                             "trainer.experiment_name=exp"])  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # the first attempt: steps 1-5 and step 4's validation, then a stop (its checkpoint: 3)
    attempts(run_dir, {"attempt": 0, "requeue_wait_s": 0.0, "lost_s": 0.0, "reason": None})
    first = Trackers(cfg, run_dir, 0)
    lines = capsys.readouterr().out
    assert "offline" in lines and f"wandb sync {run_dir / 'wandb'}/offline-run-*-" in lines
    for step in range(1, 6):
        first.write([step_row(step, step / 10)])
        if step == 4:
            first.write([val_row(4, 0.25)])
    first.close(finished=False)
    # the resumed attempt: from step 3's checkpoint, steps 4-8 again, step 4's validation
    # again (a resume validates its step when it is one), step 8's
    attempts(run_dir,
             {"attempt": 0, "requeue_wait_s": 0.0, "lost_s": 0.0, "reason": "signal SIGTERM"},
             {"attempt": 1, "requeue_wait_s": 5.0, "lost_s": 2.0, "reason": None})  # fmt: skip
    # W&B names a run's folder by its start to the second: an attempt starts seconds after
    # the last one's end, here at once, so the next second is waited for
    time.sleep(1.05 - time.time() % 1)
    second = Trackers(cfg, run_dir, 3)
    for step in range(4, STEPS + 1):
        second.write([step_row(step, 0.9)])
        if step in (4, 8):
            second.write([val_row(step, 0.75)])
    second.close(finished=True)
    state = json.loads((run_dir / trackers.STATE).read_text())

    # W&B: two offline runs of one id (``wandb sync`` joins them), W&B's step rising
    rows = wandb_history(run_dir)
    runs = [record.run for kind, record in wandb_records(run_dir) if kind == "run"]
    assert len(runs) == 2 and {r.run_id for r in runs} == {state["wandb"]["id"]}
    assert runs[0].project == "proj" and runs[0].display_name == "exp"
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert config["trainer.total_steps"] == STEPS and config["run_dir"] == str(run_dir)
    assert config["code_commit"]
    assert [r["_step"] for r in rows] == list(range(len(rows)))
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["trainer/step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["reward/mean"] for r in steps] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.9, 0.9, 0.9]
    vals = [r for r in rows if "val/pass@1" in r]
    assert [(r["trainer/step"], r["val/pass@1"]) for r in vals] == [(4, 0.25), (8, 0.75)]
    (resumed,) = [r for r in rows if "run/attempt" in r]
    assert resumed["trainer/step"] == 3 and resumed["run/attempt"] == 1
    assert resumed["run/preemptions"] == 1 and resumed["run/restarts"] == 0
    assert resumed["run/lost_s"] == 2.0 and resumed["run/requeue_wait_s"] == 5.0

    # MLflow: one run, continued, the same steps once each
    client, run = mlflow_run(run_dir)
    assert run.info.run_id == state["mlflow"]["run_id"] and run.info.status == "FINISHED"
    assert run.info.run_name == "exp"
    assert run.data.params["trainer.total_steps"] == str(STEPS)
    assert run.data.tags["mlflow.source.git.commit"] == config["code_commit"]
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [
        (s, v) for s, v in zip(range(1, 9), [0.1, 0.2, 0.3, 0.4, 0.5, 0.9, 0.9, 0.9], strict=True)
    ]
    history = client.get_metric_history(run.info.run_id, "val/pass_at_1")
    assert sorted((m.step, m.value) for m in history) == [(4, 0.25), (8, 0.75)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "run/attempt")] == [3]


def test_a_tracker_that_dies_is_dropped_and_the_others_go_on(tmp_path, caplog):
    """W&B's writer process killed (as a job's stop signal reaches every process under
    Slurm) before step 3: its rows stop there with one warning, MLflow gets every step, and
    closing raises nothing."""
    cfg = load_config(None, ["trainer.logger=[wandb,mlflow]", "trainer.total_steps=4"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tracked = Trackers(cfg, run_dir, 0)
    tracked.write([step_row(1, 0.1), step_row(2, 0.2)])
    cores = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "wandb-core"],
                           capture_output=True, text=True).stdout.split()  # fmt: skip
    assert len(cores) == 1, cores
    os.kill(int(cores[0]), signal.SIGKILL)
    os.waitpid(int(cores[0]), 0)
    with caplog.at_level(logging.WARNING):
        tracked.write([step_row(3, 0.3), step_row(4, 0.4)])
        tracked.close(finished=True)
    warned = [
        r.getMessage() for r in caplog.records if "trainer.logger wandb failed" in r.getMessage()
    ]
    assert len(warned) == 1, warned
    # what its killed writer had put on disk, at most the rows before the kill
    assert {r["trainer/step"] for r in wandb_history(run_dir)} <= {1, 2}
    client, run = mlflow_run(run_dir)
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4] and run.info.status == "FINISHED"


def test_auto_goes_offline_without_a_key_or_a_way_to_w_and_b(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent")
    monkeypatch.setattr(trackers, "_netrc_has", lambda host: False)
    assert trackers.wandb_online("auto") == (False, "no W&B key on this node (WANDB_API_KEY "
                                                    "or wandb login)")  # fmt: skip
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setattr(trackers, "WANDB_HOST", closed)
    online, why = trackers.wandb_online("auto")
    assert not online and "does not reach" in why
    assert trackers.wandb_online("online")[0] and not trackers.wandb_online("offline")[0]


def test_a_tracker_that_is_unknown_or_not_installed_is_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"trainer.logger: 'neptune' is not one of: console"):
        load_config(None, ["trainer.logger=[console,neptune]"])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else find_spec(name, *a))  # fmt: skip
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.logger=[mlflow]"])
    assert str(info.value) == (
        "trainer.logger has 'mlflow' but mlflow is not installed: "
        "pip install 'hpc_asyncppo[mlflow]' (or drop it from trainer.logger)"
    )
