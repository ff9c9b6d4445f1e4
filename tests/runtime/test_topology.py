"""Which ranks share a GPU decides the weight group's backend (see tests/gpu for the runs);
the ranks meet without spinning, and not beyond their timeout (real ranks under mpirun)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_asyncppo.launch.local import local_environment, mpirun_command
from hpc_asyncppo.runtime.topology import _sharing
from tests.harness import HANG_S, REPO


def test_ranks_on_distinct_gpus_share_nothing() -> None:
    gpus = [[11], [12], [13], [14]]
    assert _sharing(gpus, [0, 1, 2, 3]) == []


def test_only_the_ranks_of_the_group_on_a_common_gpu_are_named() -> None:
    # ranks 0 and 2 on one GPU; rank 3 shares rank 1's GPU, but rank 1 is not in the group
    gpus = [[7], [8], [7], [8]]
    assert _sharing(gpus, [0, 2, 3]) == [0, 2]
    assert _sharing(gpus, [2, 3]) == []
    assert _sharing(gpus, [1, 3]) == [1, 3]


def test_a_rollout_rank_shares_through_any_of_its_tensor_parallel_gpus() -> None:
    # rollout rank 0 drives vLLM workers on GPUs 1 and 2; the trainer leader (rank 1) is on 2
    gpus = [[1, 2], [2]]
    assert _sharing(gpus, [1, 0]) == [0, 1]
    assert _sharing([[1, 3], [2]], [1, 0]) == []


def build_with_a_late_rank(
    out: Path, late_s: float, timeout_s: float
) -> subprocess.CompletedProcess:
    """Two ranks under mpirun build the topology, rank 1 ``late_s`` after rank 0."""
    cmd = [*mpirun_command(out, 1, 1)[:-4], sys.executable, "-m", "tests.runtime.topology_probe",
           str(out), str(late_s), str(timeout_s)]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=local_environment(1), capture_output=True,
                          text=True, timeout=HANG_S)  # fmt: skip


@pytest.mark.mpi
def test_a_rank_waiting_for_a_late_one_polls_instead_of_spinning(tmp_path: Path) -> None:
    """Ranks finish their imports seconds apart (more under Slurm): the first waits for the
    last in a polled barrier. A blocking MPI collective there spins a core for the whole
    wait (Open MPI; as CPU time even when it yields), taking it from the ranks still
    importing on a shared node: 3 s of waiting cost about 3 s of CPU before."""
    proc = build_with_a_late_rank(tmp_path, late_s=3, timeout_s=HANG_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    early = json.loads((tmp_path / "rank0.json").read_text())
    assert early["role"] == "rollout" and early["cpu_s"] < 1.0, early


@pytest.mark.mpi
def test_a_rank_that_never_arrives_ends_the_wait_within_its_timeout(tmp_path: Path) -> None:
    """A rank hung before the topology (in its imports, its heartbeat going on) is not
    waited for beyond the timeout: the others fail, saying what they waited for."""
    proc = build_with_a_late_rank(tmp_path, late_s=HANG_S, timeout_s=2)
    assert proc.returncode != 0
    early = json.loads((tmp_path / "rank0.json").read_text())
    assert early["error"] == (
        "PeerTimeout: timed out after 2s waiting for every one of the job's 2 ranks to finish "
        "starting (timeouts.start_s)"
    ), early
