"""``python -m hpc_asyncppo.submit`` against fake Slurm commands: errors and what gets submitted.

Fake ``sbatch``/``srun``/``scontrol`` on an otherwise empty PATH stand in for a cluster
(the real one is exercised in test_slurm_cluster.py). The fake sbatch logs every call, so
a test can prove that nothing was submitted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_asyncppo.config import load_config
from hpc_asyncppo.launch.slurm.script import batch_script
from tests.harness import REPO

PARTITIONS = (
    "PartitionName=rollout Default=YES MaxNodes=UNLIMITED Nodes=n1 State=UP TotalNodes=1\n"
    "PartitionName=train Default=NO MaxNodes=UNLIMITED Nodes=n2 State=UP TotalNodes=1\n"
)
FAKE_SBATCH = """#!/bin/sh
echo "$@" >> "{log}"
/bin/cp "$1" "{dir}/submitted.sbatch"
if [ -n "$FAKE_SBATCH_ERROR" ]; then echo "sbatch: error: $FAKE_SBATCH_ERROR" >&2; exit 1; fi
echo "Submitted batch job 4242"
"""


@pytest.fixture
def fake_slurm(tmp_path: Path) -> Path:
    """A bin directory with fake sbatch, srun and scontrol (the local cluster's partitions)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "partitions.txt").write_text(PARTITIONS)
    scripts = {
        "sbatch": FAKE_SBATCH.format(log=tmp_path / "sbatch.log", dir=tmp_path),
        "srun": "#!/bin/sh\nexit 0\n",
        "scontrol": f'#!/bin/sh\n/bin/cat "{tmp_path / "partitions.txt"}"\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def submit(
    args: list[str], path: Path, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    # PATH holds only the fakes (or nothing): the real Slurm commands must not be found.
    env = {**os.environ, "PATH": str(path), **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-m", "hpc_asyncppo.submit", "--config", "local-slurm", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, text: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and text in errors[0], proc.stderr


def test_missing_sbatch(shared_dir: Path, tmp_path: Path) -> None:
    run_dir = shared_dir / "run"
    proc = submit(["--run-dir", str(run_dir), "trainer.total_steps=2"], tmp_path)
    assert_one_line_error(proc, "sbatch not found on PATH")
    assert proc.stderr.count("\n") == 1
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--partition-train", "h100"],
            "slurm.train.partition='h100': no such partition on this cluster (partitions: rollout, train); set --partition-train",
        ),
        (
            ["--nodes-rollout", "3"],
            "slurm.rollout.nodes=3 but partition 'rollout' allows at most 1 node(s)",
        ),
    ],
)
def test_impossible_request_submits_nothing(
    flags: list[str], message: str, shared_dir: Path, fake_slurm: Path
) -> None:
    run_dir = shared_dir / "run"
    proc = submit([*flags, "--run-dir", str(run_dir)], fake_slurm)
    assert_one_line_error(proc, message)
    assert proc.stderr.count("\n") == 1
    assert not (fake_slurm.parent / "sbatch.log").exists()
    assert not run_dir.exists()


def test_sbatch_refusal_is_one_line(shared_dir: Path, fake_slurm: Path) -> None:
    reason = "Batch job submission failed: Invalid qos specification"
    proc = submit(
        ["--run-dir", str(shared_dir / "run"), "--qos", "gold"],
        fake_slurm,
        {"FAKE_SBATCH_ERROR": reason},
    )
    assert_one_line_error(proc, f"sbatch refused the job: sbatch: error: {reason}")
    assert proc.returncode == 1


def test_submission_goes_through_submitit(shared_dir: Path, fake_slurm: Path) -> None:
    run_dir = shared_dir / "run"
    proc = submit(
        [
            "--run-dir",
            str(run_dir),
            "--partition-rollout",
            "train",
            "--partition-train",
            "rollout",
            "trainer.total_steps=3",
        ],
        fake_slurm,
    )
    assert proc.returncode == 0, proc.stderr
    assert "submitted job 4242: 2 rollout + 1 trainer ranks" in proc.stdout
    assert "scancel 4242" in proc.stdout
    cfg = load_config(
        "local-slurm", ["slurm.rollout.partition=train", "slurm.train.partition=rollout"]
    )
    submitted = (fake_slurm.parent / "submitted.sbatch").read_text()
    assert submitted == batch_script(cfg.slurm, str(run_dir.resolve()), python=sys.executable)
    # submitit's bookkeeping: the submission file kept under the job id, in the run directory.
    assert (run_dir / "slurm" / "4242_submission.sh").read_text() == submitted
    assert (run_dir / "slurm" / "job_id").read_text().strip() == "4242"
    assert (run_dir / "config.yaml").exists()


def test_dry_run_needs_no_cluster_and_submits_nothing(shared_dir: Path, tmp_path: Path) -> None:
    proc = submit(["--dry-run", "--run-dir", str(shared_dir / "run"), "--time", "30"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH hetjob" in proc.stdout and "#SBATCH --time=30" in proc.stdout
    assert "srun --mpi=pmix --het-group=0,1" in proc.stdout
