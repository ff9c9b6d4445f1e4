"""Local backend: every rank on this machine under ``mpirun`` (no Slurm).

The same per-rank entry point as under Slurm; rollout ranks are world ranks [0, R).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpc_asyncppo import goodput
from hpc_asyncppo.config import Config, ConfigError
from hpc_asyncppo.launch import job_restarts
from hpc_asyncppo.launch.progress import follow
from hpc_asyncppo.launch.rundir import (
    rank_errors,
    report_resume_point,
    write_rank_error,
)
from hpc_asyncppo.paths import LOGS, PREEMPTED
from hpc_asyncppo.runlog import read_rank_info
from hpc_asyncppo.runtime import heartbeat, startup

# Set by an MPI runtime for its own processes: a launcher that inherits them (started from a
# process that ran MPI_Init, or from inside a Slurm step) makes mpirun fail without a word.
_RUNTIME_VARIABLES = ("PMIX_", "ORTE_", "OMPI_COMM_WORLD", "OMPI_APP_CTX", "OMPI_UNIVERSE",
                      "OMPI_FIRST_RANKS", "OMPI_MCA_orte_", "OMPI_MCA_ess", "OMPI_MCA_pmix")  # fmt: skip


def local_environment(rollout_ranks: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_RUNTIME_VARIABLES)}
    env.update(
        {
            "HPC_ASYNCPPO_ROLLOUT_RANKS": str(rollout_ranks),
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            # Ranks outnumber cores on a laptop: yield instead of spinning when MPI idles.
            "OMPI_MCA_mpi_yield_when_idle": "1",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def mpirun_command(run_dir: Path, rollout_ranks: int, train_ranks: int) -> list[str]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise ConfigError(
            "mpirun not found: install Open MPI (apt-get install openmpi-bin libopenmpi-dev)"
        )
    return [
        mpirun, "-np", str(rollout_ranks + train_ranks), "--oversubscribe", "--bind-to", "none",
        sys.executable, "-m", "hpc_asyncppo.rank", str(run_dir),
    ]  # fmt: skip


_MPIRUN_DEATH = re.compile(
    r"process rank (\d+) with PID (\d+) on node (\S+) exited on signal (\d+)"
)


def explain_failure(run_dir: Path, rollout_ranks: int, mpirun_log: str) -> list[str]:
    """Why the job failed, one line per failed rank: its own error, or how mpirun saw it die."""
    lines = rank_errors(run_dir)
    info = {r["rank"]: r for r in read_rank_info(run_dir)}
    for rank, pid, node, sig in _MPIRUN_DEATH.findall(mpirun_log):
        role = "rollout" if int(rank) < rollout_ranks else "trainer"
        name = signal.Signals(int(sig)).name if int(sig) in signal.valid_signals() else sig
        # mpirun may print PID 0; the rank's own record knows better
        pid, node = (
            info.get(int(rank), {}).get("pid", pid),
            info.get(int(rank), {}).get("host", node),
        )
        if not any(line.startswith(f"rank {rank} ") for line in lines):
            lines.append(
                f"rank {rank} ({role}, {node}, pid {pid}) died: killed by signal {sig} ({name})"
            )
    return lines


class RankWarnings:
    """Passes the ranks' one-line warnings (a skipped corrupt checkpoint...) from mpirun's
    log on to the user's terminal as they appear."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0  # earlier attempts' lines

    def show(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # being written
                self.offset += len(raw)
                line = raw.decode(errors="replace").rstrip()
                if line.startswith("warning: "):
                    print(line, file=sys.stderr, flush=True)


class SilentRanks:
    """The heartbeat watch of a local attempt (``runtime/heartbeat.py``): a rank that fell
    silent gets its line as its error record and is killed (SIGKILL ends a stopped process
    too); mpirun then ends the attempt as for any dead rank."""

    CHECK_S = 1.0

    def __init__(self, run_dir: Path, started: float, stall_timeout_s: float):
        self.run_dir = run_dir
        self.watch = heartbeat.Watch(run_dir, started, stall_timeout_s)
        self.next_check = 0.0
        self.ended = False

    def end_if_silent(self) -> None:
        now = time.monotonic()
        if self.ended or now < self.next_check:
            return
        self.next_check = now + self.CHECK_S
        lines = self.watch.silent(now)
        if not lines:
            return
        self.ended = True
        pids = {info["rank"]: info.get("pid") for info in read_rank_info(self.run_dir)}
        for rank, line in lines.items():
            print(f"{line}; ending the attempt", file=sys.stderr, flush=True)
            write_rank_error(self.run_dir, rank, line)
            if pids.get(rank):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pids[rank], signal.SIGKILL)


def run_local(
    cfg: Config, run_dir: Path, rollout_ranks: int, train_ranks: int, resume_step: int | None = None
) -> int:
    """Run the job under mpirun, showing progress; returns the exit code for the CLI.

    Ctrl-C or SIGTERM asks the job to stop cleanly: the launcher sends mpirun SIGUSR2, which
    it forwards to every rank, and the trainer leader checkpoints at the next step boundary
    and stops the others. A second Ctrl-C kills the job at once.

    ``resume_step``: the step of the checkpoint a resumed run starts from (progress is shown
    from there). A job that fails for a reason other than its input starts again from its newest
    checkpoint after a back-off, at most ``trainer.max_restarts`` times (``job_restarts.py``
    says what is retried); each attempt is a row of goodput.jsonl.
    """
    log_path = run_dir / LOGS / "mpirun.log"
    cmd = mpirun_command(run_dir, rollout_ranks, train_ranks)
    started = startup.process_started_at()  # the attempt's start (goodput.py)
    previous: job_restarts.Failure | None = None
    for restarts_done in itertools.count():
        received: list[int] = []
        code = _run_mpirun(
            cfg,
            run_dir,
            rollout_ranks,
            cmd,
            log_path,
            received,
            started,
            resume_step,
            restarts_done > 0,
        )
        stopped_by = signal.Signals(received[0]).name if received else None
        if code == 0:
            goodput.close(run_dir, started, time.time(), stopped_by)
            return _stopped(run_dir, received)
        failure = job_restarts.Failure.of(
            run_dir, explain_failure(run_dir, rollout_ranks, log_path.read_text())
        )
        why_not = job_restarts.why_not_restart(
            failure, previous, restarts_done, cfg.trainer.max_restarts
        )
        restart = why_not is None and not received  # asked to stop: never restarted
        goodput.close(run_dir, started, time.time(), stopped_by, failure.record(restart))
        if received:
            return _failed(run_dir, log_path, code, failure)
        if why_not is not None:
            return _failed(run_dir, log_path, code, failure, f", not restarted: {why_not}")
        wait_s = job_restarts.backoff_s(cfg.trainer.restart_backoff_s, restarts_done)
        print(
            f"the job failed at step {failure.step} (mpirun exit code {code}); restarting it "
            f"from its newest checkpoint in {wait_s:g} s (restart {restarts_done + 1} of "
            f"{cfg.trainer.max_restarts})",
            file=sys.stderr,
            flush=True,
        )
        for line in failure.lines:
            print(f"  {line}", file=sys.stderr, flush=True)
        signum = _wait_unless_stopped(wait_s)
        if signum is not None:
            # the launcher is done with the attempt now: its row ends here, not restarted
            goodput.close(run_dir, started, time.time(), failure=failure.record(False))
            print(
                f"{signal.Signals(signum).name}: not restarting; continue with:\n"
                f"  python -m hpc_asyncppo.submit --cluster local --resume {run_dir}",
                file=sys.stderr,
            )
            return 128 + signum
        job_restarts.archive_errors(run_dir, len(goodput.read_attempts(run_dir)) - 1)
        try:
            resume_step = report_resume_point(run_dir)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        started = time.time()
        previous = failure
    raise AssertionError("unreachable")


def _stopped(run_dir: Path, received: list[int]) -> int:
    """The exit code of an attempt that ended well: finished, or stopped with a checkpoint."""
    preempted = run_dir / PREEMPTED
    if not preempted.exists():
        return 0
    step = json.loads(preempted.read_text())["step"]
    print(f"stopped at step {step} with a checkpoint; continue with:", file=sys.stderr)
    print(f"  python -m hpc_asyncppo.submit --cluster local --resume {run_dir}", file=sys.stderr)
    return 128 + received[0] if received else 1


def _failed(
    run_dir: Path, log_path: Path, code: int, failure: job_restarts.Failure, why: str = ""
) -> int:
    print(
        f"error: the job failed (mpirun exit code {code}){why}; log: {log_path}; "
        "once the cause below is fixed: "
        f"python -m hpc_asyncppo.submit --cluster local --resume {run_dir}",
        file=sys.stderr,
    )
    for line in failure.lines:
        print(f"  {line}", file=sys.stderr)
    return code or 1


def _wait_unless_stopped(seconds: float) -> int | None:
    """Sleep ``seconds``; a SIGINT or SIGTERM meanwhile ends the wait: its number."""
    received: list[int] = []

    def stop(signum: int, frame: object) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        deadline = time.monotonic() + seconds
        while not received and time.monotonic() < deadline:
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return received[0] if received else None


def _run_mpirun(
    cfg: Config,
    run_dir: Path,
    rollout_ranks: int,
    cmd: list[str],
    log_path: Path,
    received: list[int],
    started: float,
    resume_step: int | None,
    restarted: bool,
) -> int:
    """mpirun with the stop signals handled (``received``: those that came); its exit code."""

    def ask_to_stop(signum: int, frame: object) -> None:
        if received:  # asked twice: kill mpirun and every rank (each runs in its own group)
            os.killpg(proc.pid, signal.SIGKILL)
            for info in read_rank_info(run_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(info["pid"], signal.SIGKILL)
        else:
            print(
                f"\n{signal.Signals(signum).name}: asking the job to checkpoint and stop",
                file=sys.stderr,
            )
            proc.send_signal(signal.SIGUSR2)
        received.append(signum)

    with log_path.open("a") as log:
        if restarted:
            log.write(startup.line("launcher restarting the job", started) + "\n")
        else:
            log.write(startup.line("launcher python started", started) + "\n")
            log.write(startup.line("run directory written") + "\n")
        log.flush()
        # Its own session: a terminal's Ctrl-C reaches only this launcher, which asks for
        # a clean stop, instead of killing mpirun and every rank mid-step.
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,  # mpirun forwards stdin to rank 0; in its own session a tty would stop it
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**local_environment(rollout_ranks), goodput.ATTEMPT_START: repr(started)},
            start_new_session=True,
        )
        log.write(startup.line("mpirun started") + "\n")
        log.flush()
        previous = {sig: signal.signal(sig, ask_to_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        warnings = RankWarnings(log_path)
        watch = SilentRanks(run_dir, started, cfg.trainer.stall_timeout_s)

        def running() -> bool:
            warnings.show()
            watch.end_if_silent()
            return proc.poll() is None

        try:
            follow(run_dir, running, cfg.trainer.total_steps, poll_s=0.25, resume_step=resume_step,
                   console="console" in cfg.trainer.logger)  # fmt: skip
            proc.wait()
            warnings.show()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return proc.returncode
