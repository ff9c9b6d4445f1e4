"""Slurm backend: one heterogeneous job (rollout component + train component), via submitit.

- ``options``: the ``slurm:`` config section (per component, and job-wide).
- ``checks``: its values, alone and against the cluster's partitions (ConfigError).
- ``script``: the batch script, a pure function of the config (and slurm/hetjob.sbatch).
- ``executor``: submitit's SlurmExecutor submitting that script.
- ``cli`` / ``submit``: the flags of ``hpc_asyncppo.submit``, submission and ``--wait``.
- ``cluster``: what we ask Slurm (partitions, job state); ``placement``: where a rank runs.
- ``prepare``: creates a run directory from inside a hand-submitted job.
"""
