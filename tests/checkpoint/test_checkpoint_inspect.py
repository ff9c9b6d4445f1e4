"""python -m hpc_asyncppo.checkpoint.inspect on a part file, a checkpoint folder and a run
directory.

The checkpoints are the trainer's own: one tiny real run under mpirun writes them (steps
2 and 4), so the layout inspected is the one a run leaves, not one made up for the test.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_asyncppo.checkpoint.protocol import step_dir
from hpc_asyncppo.checkpoint.store import load_checkpoint
from hpc_asyncppo.runlog import read_jsonl
from tests.harness import REPO, Run

# 2 prompts x 8 responses a step, a sync every 2 steps, checkpoints after steps 2 and 4
RUN = ["trainer.total_steps=4", "actor.ppo_mini_batch_size=2", "checkpoint.save_every=2",
       "async_training.trigger_parameter_sync_step=2"]  # fmt: skip


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("inspect") / "run"
    proc = Run.start(run_dir, *RUN).finish()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


@pytest.fixture
def copy_of_run(real_run: Path, tmp_path: Path) -> Path:
    """The run's checkpoints, to damage without touching the shared run."""
    shutil.copytree(real_run / "checkpoints", tmp_path / "checkpoints")
    return tmp_path


def inspect(target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpc_asyncppo.checkpoint.inspect", str(target)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def leaves(tree: object) -> int:
    """Tensors and arrays in a loaded state tree (lists of encoded groups not counted)."""
    if isinstance(tree, dict):
        return sum(leaves(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        if tree and all(isinstance(x, np.ndarray) and x.dtype == np.uint8 for x in tree):
            return 0
        return sum(leaves(v) for v in tree)
    return int(isinstance(tree, (torch.Tensor, np.ndarray, np.generic)))


@pytest.mark.mpi
def test_inspect_a_checkpoint_folder_and_a_part(real_run: Path) -> None:
    folder = step_dir(real_run, 4)
    proc = inspect(folder)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    trained = read_jsonl(real_run / "metrics.jsonl")[-1]["samples/total"]
    assert trained == 4 * 16
    assert "step            4" in out
    # the sync after step 4 made version 2 (0 at the start, 1 after step 2)
    assert "param version   2" in out and f"samples_trained={trained}" in out
    assert "rollout_ranks=1" in out and "train_ranks=1" in out
    for part in ("trainer0.h5", "rollout0.h5", "leader.h5"):
        assert f"  {part}" in out and "checksums ok" in out
    # every state object the checkpoint collected, by name, with the files that hold it
    assert "state progress  manifest.json" in out and "state intake    leader.h5" in out
    assert "state policy    trainer0.h5" in out
    assert "state rng       trainer0.h5, rollout0.h5" in out
    assert "state cut_groups rollout0.h5" in out
    trainer, _ = load_checkpoint(folder / "trainer0.h5")
    assert f"{leaves(trainer)} tensors" in out
    queued = len(load_checkpoint(folder / "leader.h5")[0]["queue"])
    if queued:
        assert f"/queue: {queued} items" in out and f"{queued * 8} responses" in out
    proc = inspect(folder / "trainer0.h5")  # one part file
    assert proc.returncode == 0 and "checksums       ok" in proc.stdout
    assert f"tensors         {leaves(trainer)} (" in proc.stdout


@pytest.mark.mpi
def test_inspect_a_run_dir_lists_every_checkpoint_and_fails_on_a_bad_one(
    real_run: Path, copy_of_run: Path
) -> None:
    proc = inspect(real_run)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    queued = len(load_checkpoint(step_dir(real_run, 4) / "leader.h5")[0]["queue"])
    assert lines[0].startswith(
        f"step_00000004  ok  step 4  param_version 2  parts 3  queued {queued}"
    )
    assert lines[1].startswith("step_00000002  ok  step 2  param_version 1")

    part = step_dir(copy_of_run, 4) / "trainer0.h5"
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only reading every byte finds it
    part.write_bytes(bytes(raw))
    proc = inspect(copy_of_run / "checkpoints")
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("step_00000004  BAD  checkpoint ")
    assert "trainer0.h5" in lines[0]
    assert lines[1].startswith("step_00000002  ok")

    proc = inspect(step_dir(copy_of_run, 4))
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "trainer0.h5" in proc.stderr


def test_inspect_a_run_dir_without_checkpoints_fails(tmp_path: Path) -> None:
    proc = inspect(tmp_path)
    assert proc.returncode == 1 and "no checkpoints" in proc.stderr
