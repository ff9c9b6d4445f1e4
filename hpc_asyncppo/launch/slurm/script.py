"""The batch script of a run: one heterogeneous job, one ``srun --het-group=0,1`` step.

Component 0 (the rollout partition) holds ranks [0, R), component 1 (the train
partition) ranks [R, R+T): srun gives both one MPI_COMM_WORLD, and each rank learns R
from ``SLURM_NTASKS_HET_GROUP_0``. The text is a pure function of the config, so it is
golden-tested, and ``slurm/hetjob.sbatch`` (for users who call ``sbatch`` themselves) is
this function's standalone output: ``python -m hpc_asyncppo.launch.slurm.script``
rewrites it.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from hpc_asyncppo.config.slurm import ComponentConfig, SlurmConfig
from hpc_asyncppo.paths import CONFIG, PREEMPTED, RESTART, SLURM

RANK_MODULE = "hpc_asyncppo.rank"
STEP_MODULE = "hpc_asyncppo.launch.slurm.step"
TEMPLATE_PATH = Path(__file__).resolve().parents[3] / "slurm" / "hetjob.sbatch"

TEMPLATE_HEADER = """\
#!/bin/bash
# hpc_asyncppo as one Slurm heterogeneous job, for users who call sbatch themselves.
# `python -m hpc_asyncppo.submit --partition-rollout P0 --partition-train P1` writes and
# submits the same script for you; tests/launch checks that the two stay equivalent.
#
# 1. Edit the #SBATCH lines: the block before "hetjob" is component 0 (rollout ranks),
#    the block after it component 1 (trainer ranks). Partitions "rollout" and "train"
#    are those of the local test cluster (scripts/local_slurm.sh). Or override them on
#    the command line, one block per component:
#      sbatch -p a100 --ntasks-per-node=4 : -p h100 --ntasks-per-node=8 slurm/hetjob.sbatch
# 2. Set the variables (sbatch passes your environment to the job):
#      HPC_ASYNCPPO_RUN_DIR  (required) run directory on a filesystem every node sees.
#                            If it has no config.yaml yet, the job creates it from:
#      HPC_ASYNCPPO_ARGS     (optional) "[--config FILE.yaml] key=value ...", as for submit
#      HPC_ASYNCPPO_PYTHON   (optional) interpreter with hpc_asyncppo installed; default python3
#    plus whatever your cluster needs before srun (module load, venv activation):
#    put those lines where "setup" is below.
# 3. sbatch slurm/hetjob.sbatch; the job's output lands in hpc_asyncppo-<jobid>.out,
#    metrics in $HPC_ASYNCPPO_RUN_DIR/metrics.jsonl.
"""

# Every attempt (a requeue runs the script again) records when it started.
_ATTEMPT_START = """\
# this attempt's start, for RUN_DIR/goodput.jsonl (hpc_asyncppo/goodput.py)
HPC_ASYNCPPO_ATTEMPT_START=$(date +%s.%N)
export HPC_ASYNCPPO_ATTEMPT_START
"""

_TEMPLATE_PROLOGUE = f"""\
: "${{HPC_ASYNCPPO_RUN_DIR:?set HPC_ASYNCPPO_RUN_DIR to a run directory on a shared filesystem}}"
export HPC_ASYNCPPO_RUN_DIR
HPC_ASYNCPPO_PYTHON=${{HPC_ASYNCPPO_PYTHON:-python3}}
if [ ! -f "$HPC_ASYNCPPO_RUN_DIR/{CONFIG}" ]; then
    # shellcheck disable=SC2086  # HPC_ASYNCPPO_ARGS is a list of words on purpose
    "$HPC_ASYNCPPO_PYTHON" -m hpc_asyncppo.launch.slurm.prepare "$HPC_ASYNCPPO_RUN_DIR" ${{HPC_ASYNCPPO_ARGS:-}}
fi
"""


def _gpu_option(cfg: SlurmConfig, c: ComponentConfig) -> list[str]:
    """The GPU request of one component; none without GPUs (the local test cluster has none).

    Default (gpus-per-node): every task of a node sees the node's GPUs and takes its own set
    by SLURM_LOCALID (launch/gpus.py): tensor_parallel_size GPUs per rollout task, one per
    trainer task (config validation makes gpus_per_node exactly tasks x that). Nothing hides
    a node's other GPUs from a task, so NCCL keeps its peer-to-peer (NVLink) paths between
    the node's ranks. gres does the same with --gres=gpu:N. gpus-per-task has Slurm bind
    each task's set (--gpu-bind=per_task, inherited by srun); where Slurm constrains devices
    per task (ConstrainDevices), a task then cannot reach its neighbours' GPUs.
    """
    if not c.gpus_per_node:
        return []
    per = (
        c.gpus_per_node // c.tasks_per_node
        if cfg.gpu_request == "gpus-per-task"
        else c.gpus_per_node
    )
    count = f"{c.gpu_type}:{per}" if c.gpu_type else str(per)
    if cfg.gpu_request == "gres":
        return [f"--gres=gpu:{count}"]
    return [f"--{cfg.gpu_request}={count}"]  # --gpus-per-task=N or --gpus-per-node=N


def component_options(cfg: SlurmConfig, c: ComponentConfig) -> list[str]:
    """sbatch options of one component (job-wide limits repeated: each component has its own)."""
    opts = [f"--partition={c.partition}"] if c.partition else []
    opts += [f"--nodes={c.nodes}", f"--ntasks-per-node={c.tasks_per_node}"]
    opts += _gpu_option(cfg, c)
    if c.cpus_per_task:
        opts.append(f"--cpus-per-task={c.cpus_per_task}")
    if c.mem:
        opts.append(f"--mem={c.mem}")
    if c.constraint:
        opts.append(f"--constraint={c.constraint}")
    for key in ("time", "account", "qos", "signal"):
        if getattr(cfg, key):
            opts.append(f"--{key}={getattr(cfg, key)}")
    return opts + list(c.extra_sbatch)


def job_options(cfg: SlurmConfig, log_dir: str | None) -> list[str]:
    """Options of the whole job, given once in the first component."""
    # --requeue: a preempted run requeues itself (below); --open-mode=append keeps the
    # output of every attempt in the same log.
    opts = [f"--job-name={cfg.job_name}", "--requeue", "--open-mode=append"]
    if log_dir is None:
        opts.append("--output=hpc_asyncppo-%j.out")
    else:
        # The names submitit's job object reads (job.stdout(), job.stderr()).
        opts += [f"--output={log_dir}/%j_0_log.out", f"--error={log_dir}/%j_0_log.err"]
    return opts + list(cfg.extra_sbatch)


def sbatch_lines(cfg: SlurmConfig, log_dir: str | None) -> list[str]:
    lines = ["# component 0: rollout ranks"]
    lines += [
        f"#SBATCH {o}" for o in job_options(cfg, log_dir) + component_options(cfg, cfg.rollout)
    ]
    lines += ["#SBATCH hetjob", "# component 1: trainer ranks"]
    lines += [f"#SBATCH {o}" for o in component_options(cfg, cfg.train)]
    return lines


def srun_command(cfg: SlurmConfig) -> str:
    # --kill-on-bad-exit: a rank that dies ends every rank of both components (no orphan
    # component holding GPUs); --label prefixes each output line with the world rank.
    opts = [f"--mpi={cfg.mpi}", "--het-group=0,1", "--kill-on-bad-exit=1", "--label"]
    opts += [shlex.quote(a) for a in cfg.srun_args]
    srun = (
        f'srun {" ".join(opts)} "$HPC_ASYNCPPO_PYTHON" -u -m {RANK_MODULE} "$HPC_ASYNCPPO_RUN_DIR"'
    )
    # The step module runs srun and ends it if it outlives the ranks (a Slurm 22.05 hang).
    return f'"$HPC_ASYNCPPO_PYTHON" -m {STEP_MODULE} "$HPC_ASYNCPPO_RUN_DIR" \\\n    {srun}'


REQUEUE = f"""\
# On the warning signal (slurm.signal) or a preemption the ranks checkpoint and exit 0,
# leaving RUN_DIR/{PREEMPTED}; after a failure that is not the input's (a rank killed, a
# node lost) the step wrapper leaves RUN_DIR/{RESTART} and exits 0 (trainer.max_restarts).
# Either way requeue the whole job (a hetjob requeues from its leader); when it starts
# again the ranks resume from the newest checkpoint.
if [ -f "$HPC_ASYNCPPO_RUN_DIR/{PREEMPTED}" ] || [ -f "$HPC_ASYNCPPO_RUN_DIR/{RESTART}" ]; then
    scontrol requeue "$SLURM_JOB_ID"
fi"""


def _body(cfg: SlurmConfig, prologue: str) -> list[str]:
    setup = cfg.setup or ["# (module load ..., source .../bin/activate, exports)"]
    return [
        "set -e",
        _ATTEMPT_START.rstrip("\n"),
        "# setup (slurm.setup)",
        *setup,
        prologue.rstrip("\n"),
        srun_command(cfg),
        REQUEUE,
    ]


def batch_script(cfg: SlurmConfig, run_dir: str, python: str | None = None) -> str:
    """The script ``submit`` sends to sbatch for a run in ``run_dir`` (an absolute path)."""
    python = python or cfg.python or sys.executable
    prologue = (
        f"export HPC_ASYNCPPO_RUN_DIR={shlex.quote(run_dir)}\n"
        f"HPC_ASYNCPPO_PYTHON={shlex.quote(python)}\n"
    )
    header = ["#!/bin/bash", "# hpc_asyncppo run " + run_dir + " (written by hpc_asyncppo.submit)"]
    lines = header + sbatch_lines(cfg, f"{run_dir}/{SLURM}") + _body(cfg, prologue)
    return "\n".join(lines) + "\n"


def template_config() -> SlurmConfig:
    """The settings slurm/hetjob.sbatch is written for: the local test cluster's layout."""
    cfg = SlurmConfig()
    cfg.rollout.partition, cfg.rollout.ntasks_per_node = "rollout", 2
    cfg.train.partition, cfg.train.ntasks_per_node = "train", 1
    return cfg


def standalone_script(cfg: SlurmConfig | None = None) -> str:
    """The text of slurm/hetjob.sbatch: variables instead of a run directory."""
    cfg = cfg or template_config()
    lines = sbatch_lines(cfg, None) + _body(cfg, _TEMPLATE_PROLOGUE)
    return TEMPLATE_HEADER + "\n".join(lines) + "\n"


if __name__ == "__main__":
    TEMPLATE_PATH.write_text(standalone_script())
    print(f"wrote {TEMPLATE_PATH}")
