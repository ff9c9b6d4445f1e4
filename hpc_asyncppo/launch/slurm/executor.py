"""submitit's SlurmExecutor, taught to submit one heterogeneous job.

submitit (1.5) writes a single-component batch script that unpickles a callable in
every task. We keep its submission machinery (submission file in the job folder, the
sbatch call, job-id parsing, the SlurmJob handle with ``cancel()``, ``stdout()``) and
replace the script with ours: two components, one ``srun --het-group=0,1`` step running
the per-rank entry point. Nothing is pickled; the job's result is the run directory.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import submitit
from submitit.core.utils import FailedJobError

from hpc_asyncppo.launch.slurm.cluster import SlurmError, last_line


class HetJobExecutor(submitit.SlurmExecutor):
    """Submits one prepared heterogeneous batch script; ``folder`` receives its logs."""

    def __init__(self, folder: Path, script: str, num_tasks: int):
        super().__init__(folder=folder)
        self._script = script
        self._ranks = num_tasks

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self._script

    def _num_tasks(self) -> int:
        return self._ranks

    def submit_script(self) -> submitit.SlurmJob:
        """sbatch the script; SlurmError with sbatch's own one-line reason if it refuses."""
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        stderr = io.StringIO()
        try:
            # submitit echoes sbatch's stderr on failure; we report it once, as one line.
            with contextlib.redirect_stderr(stderr):
                return self._submit_command(command="")
        except FailedJobError as exc:
            raise SlurmError(
                f"sbatch refused the job: {last_line(str(exc)) or 'no reason given'}"
            ) from None
