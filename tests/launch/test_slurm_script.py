"""The generated batch script, against golden files; and slurm/hetjob.sbatch against it.

Regenerate the golden files after an intended change with
``UPDATE_GOLDEN=1 pytest tests/launch/test_slurm_script.py`` and review the diff.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from hpc_asyncppo.config import load_config
from hpc_asyncppo.config.slurm import SlurmConfig
from hpc_asyncppo.launch.slurm.script import (
    TEMPLATE_PATH,
    batch_script,
    standalone_script,
    template_config,
)

GOLDEN = Path(__file__).parent / "golden"
RUN_DIR = "/shared/runs/golden"
STEP_START = '"$HPC_ASYNCPPO_PYTHON" -m hpc_asyncppo.launch.slurm.step'

CASES: dict[str, list[str]] = {
    # The local test cluster's YAML plus the flags a user would add.
    "local_cluster": ["slurm.rollout.partition=rollout", "slurm.train.partition=train"],
    # Defaults only: no partitions (cluster default), one task per node.
    "defaults": [],
    # Every option: GPUs requested per task (the default), multi-node trainer, job-wide limits.
    "gpus_all_options": [
        "slurm.rollout.partition=a100",
        "slurm.rollout.gpus_per_node=4",
        "slurm.rollout.gpu_type=a100",
        "slurm.rollout.cpus_per_task=8",
        "slurm.rollout.mem=200G",
        "slurm.rollout.constraint=ib&nvlink",
        "slurm.train.partition=h100",
        "slurm.train.nodes=2",
        "slurm.train.gpus_per_node=8",
        "slurm.train.ntasks_per_node=8",
        "slurm.train.mem=0",
        "slurm.train.extra_sbatch=[--exclusive]",
        "slurm.job_name=grpo-7b",
        "slurm.time=1-12:00:00",
        "slurm.account=proj42",
        "slurm.qos=high",
        "slurm.signal=USR2@90",
        "slurm.extra_sbatch=[--mail-type=END,--requeue]",
        'slurm.setup=["module load cuda/12.4","source /shared/venv/bin/activate"]',
        "slurm.srun_args=[--cpu-bind=none]",
        "slurm.mpi=pmi2",
    ],
    # Clusters that only take --gres.
    "gres": [
        "slurm.gpu_request=gres",
        "slurm.rollout.gpus_per_node=2",
        "slurm.train.gpus_per_node=4",
        "slurm.train.gpu_type=h100",
    ],
    # The shipped GPU configs as `submit --dry-run --config NAME` prints them.
    "qwen2.5-0.5b-gsm8k": [],
    "qwen2.5-7b-gsm8k": [],
    "dapo-qwen2.5-7b-gsm8k": [],
    "gspo-qwen2.5-7b-gsm8k": [],
}
CONFIG_OF = {
    "local_cluster": "local-slurm",
    "qwen2.5-0.5b-gsm8k": "qwen2.5-0.5b-gsm8k",
    "qwen2.5-7b-gsm8k": "qwen2.5-7b-gsm8k",
    "dapo-qwen2.5-7b-gsm8k": "dapo-qwen2.5-7b-gsm8k",
    "gspo-qwen2.5-7b-gsm8k": "gspo-qwen2.5-7b-gsm8k",
}


def _script(name: str) -> str:
    cfg = load_config(CONFIG_OF.get(name), CASES[name])
    return batch_script(cfg.slurm, RUN_DIR, python="/shared/venv/bin/python")


@pytest.mark.parametrize(
    ("name", "rollout_per_task", "train_per_task"),
    [
        ("qwen2.5-0.5b-gsm8k", 1, 1),
        ("qwen2.5-7b-gsm8k", 2, 1),
        ("dapo-qwen2.5-7b-gsm8k", 2, 1),
        ("gspo-qwen2.5-7b-gsm8k", 2, 1),
    ],
)
def test_qwen_scripts_give_each_task_its_own_gpus(
    name: str, rollout_per_task: int, train_per_task: int
) -> None:
    """Each rollout task its tensor_parallel_size GPUs, each trainer task one: tasks x
    GPUs per task is the node's GPUs, and no other GPU request competes with it."""
    cfg = load_config(name)
    assert cfg.rollout.tensor_parallel_size == rollout_per_task
    before, after = _script(name).split("#SBATCH hetjob\n")
    for part, c, per in (
        (before, cfg.slurm.rollout, rollout_per_task),
        (after, cfg.slurm.train, train_per_task),
    ):
        assert f"#SBATCH --ntasks-per-node={c.tasks_per_node}\n" in part
        # every task sees the node's GPUs (NCCL keeps P2P); each rank binds its own set
        assert f"#SBATCH --gpus-per-node={c.gpus_per_node}\n" in part
        assert c.tasks_per_node * per == c.gpus_per_node
        assert "--gpus-per-task" not in part and "--gres" not in part


@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_script_matches_golden(name: str) -> None:
    path = GOLDEN / f"{name}.sbatch"
    text = _script(name)
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"regenerate with UPDATE_GOLDEN=1 and review {path}"


def test_components_in_order_and_one_het_step() -> None:
    text = _script("gpus_all_options")
    before, after = text.split("#SBATCH hetjob\n")
    assert "--partition=a100" in before and "--partition=h100" in after
    # 4 GPUs over 4 rollout tasks, 8 over 8 trainer tasks: the node's GPUs to every task
    assert "--gpus-per-node=a100:4" in before and "--gpus-per-node=8" in after
    assert "--exclusive" in after and "--exclusive" not in before
    # Job-wide limits hold for each component.
    for part in (before, after):
        assert (
            "--time=1-12:00:00" in part
            and "--account=proj42" in part
            and "--signal=USR2@90" in part
        )
    srun = [line for line in text.splitlines() if line.lstrip().startswith("srun ")]
    assert len(srun) == 1 and "--het-group=0,1" in srun[0] and "--mpi=pmi2" in srun[0]
    # srun runs under the step wrapper, which ends it if it outlives the ranks.
    assert "-m hpc_asyncppo.launch.slurm.step " in _step(text)
    # setup lines run before srun.
    assert text.index("module load cuda/12.4") < text.index("srun ")


def test_run_dir_and_python_are_shell_quoted() -> None:
    text = batch_script(SlurmConfig(), "/a b/run", python="/opt/my python/bin/python")
    assert "export HPC_ASYNCPPO_RUN_DIR='/a b/run'" in text
    assert "HPC_ASYNCPPO_PYTHON='/opt/my python/bin/python'" in text


def test_template_file_is_up_to_date() -> None:
    assert TEMPLATE_PATH.read_text() == standalone_script(), (
        "slurm/hetjob.sbatch is stale: python -m hpc_asyncppo.launch.slurm.script rewrites it"
    )


def _sbatch_options(text: str) -> list[str]:
    """#SBATCH options, without the output paths (the template has no run directory)."""
    options = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    return [o for o in options if not re.match(r"#SBATCH --(output|error)=", o)]


def _step(text: str) -> str:
    """The job step's command: the step wrapper and the srun it runs (continued lines joined)."""
    start = text.index(STEP_START)
    end = text.index("\n", text.index("srun ", start))
    return " ".join(text[start:end].replace("\\\n", " ").split())


def test_template_is_equivalent_to_generated_script() -> None:
    """Same components, same resources, same step as submit writes for the same settings."""
    template = TEMPLATE_PATH.read_text()
    generated = batch_script(template_config(), "/shared/run", python="python3")
    assert _sbatch_options(template) == _sbatch_options(generated)
    assert _step(template) == _step(generated)
    # Both define the two variables the srun line reads before it runs.
    for text in (template, generated):
        head = text[: text.index(STEP_START)]
        assert "HPC_ASYNCPPO_RUN_DIR" in head and "HPC_ASYNCPPO_PYTHON=" in head
    assert "set -e" in template and "set -e" in generated


def test_template_is_what_local_cluster_yaml_submits() -> None:
    """The template's defaults are the local test cluster's (configs/local-slurm.yaml)."""
    cfg = load_config("local-slurm")
    assert _sbatch_options(standalone_script()) == _sbatch_options(
        batch_script(cfg.slurm, "/r", "python3")
    )
