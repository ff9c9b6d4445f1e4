"""python -m hpc_asyncppo.checkpoint.inspect on a file and on a run directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from hpc_asyncppo.checkpoint.store import checkpoint_path, save_checkpoint
from hpc_asyncppo.transport.arrays import pack_arrays

REPO = Path(__file__).resolve().parents[2]


def inspect(target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpc_asyncppo.checkpoint.inspect", str(target)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def fake_group(n: int) -> np.ndarray:
    """An encoded sample group as far as inspect cares: a packed message with rewards (n,)."""
    return pack_arrays({"rewards": np.zeros(n, np.float32)}, {"seed": 0})


def write_run(run_dir: Path) -> None:
    for step in (2, 4):
        tree = {
            "model": {"w": torch.zeros(256, 256), "b": torch.zeros(256, dtype=torch.bfloat16)},
            "samples": {
                "queued": [fake_group(4) for _ in range(step)],
                "in_flight": [fake_group(2)],
            },
        }
        meta = {"step": step, "param_version": step // 2, "samples_trained": 8 * step}
        save_checkpoint(checkpoint_path(run_dir, step), tree, meta)


def test_inspect_a_checkpoint_file(tmp_path):
    write_run(tmp_path)
    proc = inspect(checkpoint_path(tmp_path, 4))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "format version  1" in out and "step            4" in out
    assert "param version   2" in out and "samples_trained=32" in out
    assert "/samples/queued: 4 items" in out and "16 responses" in out
    assert "/samples/in_flight: 1 items" in out
    assert "tensors         2 (256.5 KiB)" in out and "checksums       ok" in out


def test_inspect_a_run_dir_lists_every_checkpoint_and_fails_on_a_bad_one(tmp_path):
    write_run(tmp_path)
    proc = inspect(tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("ckpt_00000004.h5  ok  step 4  param_version 2  queued 5")
    assert lines[1].startswith("ckpt_00000002.h5  ok  step 2")

    os.truncate(checkpoint_path(tmp_path, 4), 5000)
    proc = inspect(tmp_path / "checkpoints")
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("ckpt_00000004.h5  BAD  checkpoint ")
    assert lines[1].startswith("ckpt_00000002.h5  ok")

    proc = inspect(checkpoint_path(tmp_path, 4))
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1
    assert str(checkpoint_path(tmp_path, 4)) in proc.stderr


def test_inspect_a_run_dir_without_checkpoints_fails(tmp_path):
    proc = inspect(tmp_path)
    assert proc.returncode == 1 and "no checkpoints" in proc.stderr
