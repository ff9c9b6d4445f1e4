"""The GPU check's own functions (hpc_asyncppo/gpu_check.py), run on the CPU: the same code
``scripts/gpu_check.sh`` runs on ``cuda:0``, so a broken check shows here, not on the lease."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_asyncppo import gpu_check

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpu_check")


@pytest.mark.parametrize(
    "name",
    [
        "gpu_binding",
        "fsdp2_step",
        "checkpoint",
        "recipe_budget",
        "memory_check",
        "weight_group_peer_missing",
        "weight_sync_peer_dies",
        "side_stream_sync",
        "lora_merge",
    ],
)
def test_check_runs_on_the_cpu(name: str, work: Path) -> None:
    detail = gpu_check.CHECKS[name](CPU, work)
    assert detail and "\n" not in detail


@pytest.mark.mpi
def test_job_checks_run_on_the_cpu(work: Path) -> None:
    """A short default job (too short to learn) through both job checks."""
    detail = gpu_check.check_default_job_learns(CPU, work, steps=8, min_reward=None)
    assert "trainer on cpu" in detail
    assert "through host memory" in gpu_check.check_weight_sync_via_host(CPU, work, steps=8)


def test_check_failure_is_one_line_and_counted(work: Path, capsys, monkeypatch) -> None:
    def broken(device: torch.device, work: Path) -> str:
        raise AssertionError("two\nlines")

    monkeypatch.setitem(gpu_check.CHECKS, "broken", broken)
    assert gpu_check.run_checks(CPU, work, ["gpu_binding", "broken"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("gpu_check: broken: FAILED (AssertionError: two lines)")
    assert lines[-1].startswith("gpu_check: 1/2 checks passed on cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_the_script_exits_2_with_one_line() -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (proc.stdout + proc.stderr).strip().count("\n") == 0, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout + proc.stderr
