"""Slurm settings checked before submission, and what we read back from Slurm (no cluster needed)."""

from __future__ import annotations

import argparse

import pytest

from hpc_asyncppo.config import ConfigError, load_config
from hpc_asyncppo.config.slurm import ComponentConfig, SlurmConfig
from hpc_asyncppo.launch.slurm import cli
from hpc_asyncppo.launch.slurm.checks import check_against_partitions, check_options
from hpc_asyncppo.launch.slurm.cluster import combine_states, parse_job_states, parse_partitions
from hpc_asyncppo.launch.slurm.placement import het_group_of, slurm_placement

# Two lines of `scontrol show partition -o` from the local test cluster (trimmed).
SCONTROL_PARTITIONS = (
    "PartitionName=rollout AllowGroups=ALL Default=YES MaxNodes=UNLIMITED Nodes=n1 State=UP "
    "TotalCPUs=4 TotalNodes=1\n"
    "PartitionName=train AllowGroups=ALL Default=NO MaxNodes=2 Nodes=n[2-5] State=UP "
    "TotalCPUs=16 TotalNodes=4\n"
)


def _slurm(*overrides: str) -> SlurmConfig:
    return load_config(None, list(overrides)).slurm


def test_tasks_per_node_defaults_to_one_per_gpu() -> None:
    assert ComponentConfig().tasks_per_node == 1
    assert ComponentConfig(gpus_per_node=4).tasks_per_node == 4
    assert ComponentConfig(gpus_per_node=4, ntasks_per_node=1, nodes=3).ranks == 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("slurm.rollout.nodes=0", "slurm.rollout.nodes=0 must be >= 1"),
        ("slurm.train.gpus_per_node=-1", "slurm.train.gpus_per_node=-1 must be >= 0"),
        ("slurm.time=soon", "slurm.time='soon' is not a Slurm time limit"),
        ("slurm.train.mem=lots", "slurm.train.mem='lots' is not a memory size"),
        (
            "slurm.gpu_request=gpus",
            "slurm.gpu_request='gpus' is not one of: gpus-per-task, gpus-per-node, gres",
        ),
        ("slurm.rollout.extra_sbatch=[exclusive]", "slurm.rollout.extra_sbatch entry 'exclusive'"),
        ("slurm.rollout.partition=a b", "slurm.rollout.partition='a b' is not a partition name"),
        ("slurm.rollout.gpu_type=a100", "needs slurm.rollout.gpus_per_node >= 1"),
        ("slurm.signal=USR2 @90", "is not a signal spec"),
        ('slurm.mpi="pm ix"', "is not an srun MPI plugin name"),
    ],
)
def test_bad_values_are_one_line_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_options(_slurm(override))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("time", ["30", "4:00:00", "1-12:00:00", "2-0", "90:00", "UNLIMITED"])
def test_slurm_time_formats_accepted(time: str) -> None:
    check_options(_slurm(f"slurm.time={time!r}"))


def test_parse_partitions() -> None:
    parts = parse_partitions(SCONTROL_PARTITIONS)
    assert parts["rollout"].default and parts["rollout"].total_nodes == 1
    assert parts["rollout"].max_nodes is None
    assert parts["train"].max_nodes == 2 and parts["train"].total_nodes == 4


def test_unknown_partition_names_the_valid_ones_and_the_flag() -> None:
    with pytest.raises(ConfigError) as info:
        check_against_partitions(
            _slurm("slurm.train.partition=h100"), parse_partitions(SCONTROL_PARTITIONS)
        )
    assert str(info.value) == (
        "slurm.train.partition='h100': no such partition on this cluster "
        "(partitions: rollout, train); set --partition-train"
    )


def test_more_nodes_than_the_partition_has() -> None:
    parts = parse_partitions(SCONTROL_PARTITIONS)
    with pytest.raises(
        ConfigError, match=r"slurm.rollout.nodes=2 but partition 'rollout' allows at most 1 node"
    ):
        check_against_partitions(_slurm("slurm.rollout.nodes=2"), parts)
    # MaxNodes caps a job below the partition's size.
    with pytest.raises(ConfigError, match=r"slurm.train.nodes=3 .* at most 2 node"):
        check_against_partitions(
            _slurm("slurm.train.partition=train", "slurm.train.nodes=3"), parts
        )
    check_against_partitions(_slurm("slurm.train.partition=train", "slurm.train.nodes=2"), parts)


def test_empty_partition_means_the_default_one() -> None:
    parts = parse_partitions(SCONTROL_PARTITIONS)
    check_against_partitions(_slurm(), parts)  # both components on "rollout", 1 node each
    no_default = parse_partitions(SCONTROL_PARTITIONS.replace("Default=YES", "Default=NO"))
    with pytest.raises(ConfigError, match="no default partition"):
        check_against_partitions(_slurm(), no_default)


def test_het_job_state_combines_components() -> None:
    assert combine_states(["RUNNING", "COMPLETED"]) == "RUNNING"
    assert combine_states(["COMPLETED", "COMPLETED"]) == "COMPLETED"
    assert combine_states(["FAILED", "CANCELLED"]) == "FAILED"
    assert combine_states(["COMPLETED", "TIMEOUT"]) == "TIMEOUT"
    assert combine_states([]) == "UNKNOWN"
    text = "JobId=7 HetJobId=7 JobState=FAILED Reason=NonZeroExitCode\nJobId=8 HetJobId=7 JobState=FAILED\n"
    assert parse_job_states(text) == ["FAILED", "FAILED"]


def test_flags_become_config_overrides() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        ["--partition-rollout", "a100", "--nodes-train", "2", "--time", "01:00:00", "--dry-run"]
    )
    overrides = cli.flag_overrides(args)
    assert overrides == [
        'slurm.rollout.partition="a100"',
        "slurm.train.nodes=2",
        'slurm.time="01:00:00"',
    ]
    cfg = load_config(None, overrides)
    assert (cfg.slurm.rollout.partition, cfg.slurm.train.nodes, cfg.slurm.time) == (
        "a100",
        2,
        "01:00:00",
    )
    assert args.dry_run and not args.wait


def test_rank_counts() -> None:
    cfg = load_config("local-slurm")
    assert cli.rank_counts(cfg) == (2, 1)
    with pytest.raises(ConfigError, match="slurm.train.nodes=0"):
        cli.rank_counts(load_config(None, ["slurm.train.nodes=0"]))


def test_run_dir_under_tmp_is_refused() -> None:
    cfg = load_config("local-slurm")
    args = argparse.Namespace(run_dir="/tmp/x", dry_run=False)
    with pytest.raises(ConfigError, match="under /tmp"):
        cli.check_submittable(cfg, args)


# Environment of one task of `srun --het-group=0,1` (2 + 1 ranks), as Slurm 22.05 sets it.
HET_ENV = {
    "SLURM_HET_SIZE": "2",
    "SLURM_NTASKS_HET_GROUP_0": "2",
    "SLURM_NTASKS_HET_GROUP_1": "1",
    "SLURM_JOB_PARTITION": "train",  # the same in every task: not to be trusted
    "SLURM_JOB_PARTITION_HET_GROUP_0": "rollout",
    "SLURM_JOB_PARTITION_HET_GROUP_1": "train",
    "SLURM_JOB_ID": "7",
    "SLURMD_NODENAME": "n1",
}


def test_placement_uses_the_component_of_the_rank() -> None:
    assert [het_group_of(r, HET_ENV) for r in range(4)] == [0, 0, 1, None]
    assert slurm_placement(1, HET_ENV)["slurm_partition"] == "rollout"
    assert slurm_placement(2, HET_ENV)["slurm_partition"] == "train"
    assert slurm_placement(0, HET_ENV)["slurm_job_id"] == "7"
    outside = slurm_placement(0, {})
    assert outside["slurm_partition"] is None and outside["slurm_het_group"] is None


def test_a_controller_that_does_not_answer_is_asked_again(monkeypatch):
    """A busy slurmctld (the test cluster under load) fails a query now and then: the job's
    state is asked again, not taken as UNKNOWN. Stands in for the controller: a timeout
    cannot be made to happen on demand."""
    from hpc_asyncppo.launch.slurm import cluster

    answers = [
        cluster.SlurmError("scontrol show job failed: Socket timed out on send/recv operation"),
        "JobId=7 JobState=RUNNING Reason=None\n",
    ]

    def client(command: list[str], timeout_s: float = 30.0) -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(cluster, "run_client", client)
    assert cluster.job_state("7", pause_s=0) == "RUNNING"
    # a job the controller no longer knows goes to accounting at once
    asked: list[list[str]] = []

    def gone(command: list[str], timeout_s: float = 30.0) -> str:
        asked.append(command)
        if command[0] == "scontrol":
            raise cluster.SlurmError("scontrol show job failed: Invalid job id specified")
        return "7|COMPLETED\n"

    monkeypatch.setattr(cluster, "run_client", gone)
    assert cluster.job_state("7", pause_s=0) == "COMPLETED"
    assert [c[0] for c in asked] == ["scontrol", "sacct"]
