"""Fixtures of the launch tests: a directory every Slurm node sees, and the local cluster.

The local cluster (scripts/local_slurm.sh: two emulated nodes, partitions "rollout" and
"train") is started once per session by the first test marked ``slurm`` that asks for it.
Where it cannot start (not root, no packages) those tests skip, except under ``CI=true``,
where they fail: CI must run them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import REPO

LOCAL_SLURM = REPO / "scripts" / "local_slurm.sh"


@pytest.fixture
def shared_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory outside /tmp (each emulated node has its own /tmp)."""
    root = Path(os.environ.get("HPC_ASYNCPPO_TEST_SHARED_DIR", REPO / "runs" / "pytest"))
    path = root / f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"local Slurm cluster unavailable under CI=true: {reason}")
    pytest.skip(f"local Slurm cluster unavailable: {reason}")


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[None]:
    """The local two-node cluster, up; stopped at the end if this session started it."""
    if os.geteuid() != 0:
        _unavailable("scripts/local_slurm.sh needs root")
    was_up = subprocess.run([LOCAL_SLURM, "status"], capture_output=True).returncode == 0
    proc = subprocess.run([LOCAL_SLURM, "start"], capture_output=True, text=True, timeout=900)
    if proc.returncode:
        _unavailable(f"scripts/local_slurm.sh start failed: {proc.stderr.strip()[-500:]}")
    yield
    if not was_up:
        subprocess.run([LOCAL_SLURM, "stop"], capture_output=True, timeout=120)
