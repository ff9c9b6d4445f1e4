"""The run harness every test that starts a local run shares: ``Run`` starts
``python -m hpc_asyncppo.submit --cluster local`` on one run directory, waits for an event
of the run (a trainer step, any condition), signals the launcher (a preemption's SIGTERM,
a kill) or a named rank, and resumes the run; the audits check what a finished run wrote
(every trained sample's staleness, every rollout rank's weights at every sync).

Each wait is bounded by ``HANG_S`` only: a bound for a hang, never a speed. A test asserts
what the run did, never how fast. A wait that fails ends the job first (no rank is left
running), and a job a test left running is ended when the test ends (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

from hpc_asyncppo.checkpoint.protocol import read_full, read_manifest, step_dir
from hpc_asyncppo.goodput import read_attempts
from hpc_asyncppo.paths import LOGS, METRICS
from hpc_asyncppo.runlog import read_jsonl, read_rank_info, split_metrics

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[1]

# The bound of every wait: a hang's, not a speed. The slowest start seen: two rollout
# ranks' vLLM engines at tensor_parallel_size=2 (six vLLM processes, 17 s of imports each)
# took more than 300 s on a loaded machine with 25% CPU steal.
HANG_S = 600.0
POLL_S = 0.1
# The launcher's exit code after a stop signal with a checkpoint (128 + SIGTERM): the batch
# script requeues on it, and the launcher says how to continue
PREEMPTED_EXIT = 128 + signal.SIGTERM

# 4 prompts x 8 responses = 32 samples per step, from 64 prompts
SMALL = ["actor.ppo_mini_batch_size=4", "data.num_prompts=64", "timeouts.sample_wait_s=120"]
# 6 steps of SMALL's size (from the default prompts), a sync every 2 steps, and the
# records check_audit and check_weights_match read
SMALL_AUDITED = [
    "trainer.total_steps=6",
    "actor.ppo_mini_batch_size=4",
    "async_training.trigger_parameter_sync_step=2",
    "trainer.record_weight_digests=true",
    "rollout.record_sent_groups=true",
    "timeouts.sample_wait_s=120",
]

T = TypeVar("T")
_running: list[Run] = []  # started and not yet seen to end: ended after each test


@dataclass(eq=False)
class Run:
    """One run directory and the launcher of its current attempt (``proc``)."""

    run_dir: Path
    own_session: bool = False  # the launcher in its own session: kill() ends its group
    proc: subprocess.Popen | None = None
    result: subprocess.CompletedProcess | None = None  # the last launch's, once it ended
    _output: tuple[IO[bytes], IO[bytes]] | None = field(default=None, repr=False)

    @classmethod
    def start(
        cls,
        run_dir: Path,
        *args: str,
        rollout_ranks: int | None = None,
        train_ranks: int | None = None,
        env: dict[str, str] | None = None,
        own_session: bool = False,
    ) -> Run:
        """``submit --cluster local --run-dir RUN_DIR [--rollout-ranks R] [--train-ranks T]
        ARGS``, started from the repository (``env``: variables added to this process's)."""
        run = cls(Path(run_dir), own_session=own_session)
        run._launch(["--run-dir", str(run_dir)], args, rollout_ranks, train_ranks, env)
        return run

    def resume(
        self,
        *args: str,
        rollout_ranks: int | None = None,
        train_ranks: int | None = None,
        env: dict[str, str] | None = None,
    ) -> Run:
        """``submit --cluster local --resume RUN_DIR ...``, once the previous launch ended."""
        assert self.proc is None or self.proc.poll() is not None, "the run is still going"
        self._launch(["--resume", str(self.run_dir)], args, rollout_ranks, train_ranks, env)
        return self

    def _launch(
        self,
        where: list[str],
        args: tuple[str, ...],
        rollout_ranks: int | None,
        train_ranks: int | None,
        env: dict[str, str] | None,
    ) -> None:
        ranks = []
        if rollout_ranks is not None:
            ranks += ["--rollout-ranks", str(rollout_ranks)]
        if train_ranks is not None:
            ranks += ["--train-ranks", str(train_ranks)]
        cmd = [sys.executable, "-m", "hpc_asyncppo.submit", "--cluster", "local", *where]
        # Files, not pipes: nobody reads a pipe while the test waits, and a full one would
        # block the launcher's progress lines
        self._output = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
        self.result = None
        self.proc = subprocess.Popen(
            [*cmd, *ranks, *args],
            cwd=REPO,
            stdout=self._output[0],
            stderr=self._output[1],
            env=None if env is None else {**os.environ, **env},
            start_new_session=self.own_session,
        )
        _running.append(self)

    # -- the end of a launch -------------------------------------------------------------

    def finish(self, expect: int | None = None) -> subprocess.CompletedProcess:
        """Wait for the launch to end (HANG_S at most); its exit code and output, asserted
        to be ``expect`` when given."""
        assert self.proc is not None, "never started"
        try:
            self.proc.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            self.end()
            raise AssertionError(f"the job did not end within {HANG_S:g} s (a hang)\n"
                                 f"{self.output()}") from None  # fmt: skip
        done = self._ended()
        if expect is not None:
            assert done.returncode == expect, done.stdout + done.stderr
        return done

    def stop(self) -> subprocess.CompletedProcess:
        """SIGTERM to the launcher, as a preemption: the job checkpoints and stops, the
        launcher exits 143 and says how to continue."""
        assert self.proc is not None, "never started"
        self.proc.send_signal(signal.SIGTERM)
        done = self.finish()
        assert done.returncode == PREEMPTED_EXIT and "continue with" in done.stderr, (
            done.stdout + done.stderr
        )
        return done

    def kill(self) -> subprocess.CompletedProcess:
        """SIGKILL to the launcher (its whole process group with ``own_session``)."""
        assert self.proc is not None, "never started"
        with contextlib.suppress(ProcessLookupError):
            if self.own_session:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
        return self.finish()

    def end(self) -> None:
        """End the job whatever it is doing, so that nothing is left running: a second
        SIGTERM makes the launcher kill mpirun and every rank; SIGKILL if it does not end."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            for _ in range(2):
                with contextlib.suppress(ProcessLookupError):
                    self.proc.terminate()
                time.sleep(1)
            try:
                self.proc.wait(timeout=60)  # then SIGKILL: a cleanup, not a check
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    if self.own_session:
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    else:
                        self.proc.kill()
                self.proc.wait()
        self._ended()

    def _ended(self) -> subprocess.CompletedProcess:
        if self.result is None:
            stdout, stderr = self._read_output()
            self.result = subprocess.CompletedProcess(
                self.proc.args, self.proc.returncode, stdout, stderr
            )
            if self in _running:
                _running.remove(self)
        return self.result

    def _read_output(self) -> tuple[str, str]:
        # pread: the launcher's descriptors share the files' offset with ours
        texts = [os.pread(f.fileno(), os.fstat(f.fileno()).st_size, 0) for f in self._output]
        return texts[0].decode(errors="replace"), texts[1].decode(errors="replace")

    def output(self) -> str:
        """What the launcher wrote so far, stdout then stderr (for failure messages)."""
        stdout, stderr = self._read_output()
        return f"stdout:\n{stdout}\nstderr:\n{stderr}"

    # -- waiting for an event ------------------------------------------------------------

    def wait_until(self, predicate: Callable[[], T], what: str) -> T:
        """Poll ``predicate`` until it is true (its value returned). Fails, naming ``what``,
        with the job's output, if the job ends first or HANG_S passes; the job ended then."""
        assert self.proc is not None, "never started"
        deadline = time.monotonic() + HANG_S
        while True:
            value = predicate()
            if value:
                return value
            ended = self.proc.poll() is not None
            if ended and (value := predicate()):  # it came as the job ended
                return value
            if ended or time.monotonic() > deadline:
                why = f"the job ended (exit {self.proc.returncode})" if ended else "a hang"
                self.end()
                raise AssertionError(f"{what}: not seen, {why}\n{self.output()}")
            time.sleep(POLL_S)

    def wait_for_step(self, step: int) -> None:
        """Until metrics.jsonl holds trainer step ``step`` (validation rows not counted)."""
        self.wait_until(lambda: self.steps_done() >= step, f"step {step}")

    # -- what the run wrote --------------------------------------------------------------

    def steps_done(self) -> int:
        """The newest trainer step in metrics.jsonl (0 before the first)."""
        steps = self.metrics()
        return steps[-1]["step"] if steps else 0

    def metrics(self) -> list[dict[str, Any]]:
        """The trainer step rows of metrics.jsonl, the last of each step, in step order."""
        return split_metrics(read_jsonl(self.run_dir / METRICS))[0]

    def vals(self) -> list[dict[str, Any]]:
        """The validation rows of metrics.jsonl, the last of each step, in step order."""
        return split_metrics(read_jsonl(self.run_dir / METRICS))[1]

    def attempts(self) -> list[dict[str, Any]]:
        """goodput.jsonl: one row per attempt of the job."""
        return read_attempts(self.run_dir)

    def log(self, rank: int) -> str:
        return (self.run_dir / LOGS / f"rank{rank}.log").read_text()

    def rank_info(self, rank: int) -> dict[str, Any]:
        """What world rank ``rank`` of the current attempt wrote about itself (pid, host...)."""
        return next(info for info in read_rank_info(self.run_dir) if info["rank"] == rank)

    def signal_rank(self, rank: int, sig: signal.Signals) -> int:
        """Send ``sig`` to world rank ``rank``; its pid."""
        pid = self.rank_info(rank)["pid"]
        os.kill(pid, sig)
        return pid


def end_leftover_runs() -> None:
    """End every job a test started and left running (a failed assertion mid-run)."""
    for run in list(_running):
        if run.proc is not None and run.proc.poll() is None:
            run.end()
        elif run in _running:
            _running.remove(run)


# -- the audits of a finished run ----------------------------------------------------------


def void_sends(run_dir: Path, rows: list[dict]) -> set[int]:
    """Indices of ``rows`` (sent groups) that no checkpoint holds as sent: sent by a rollout
    rank after its last part of a checkpoint in an attempt that did not finish the run (a
    failure, or a stop whose signal reached the rank after the leader's CHECKPOINT: the rank
    generates on until STOP, and what it sends meanwhile is dropped as the run ends). The
    resumed run generates their groups again, from their cut tokens or their prompts."""
    ends = {}  # rollout rank -> the ends of its checkpoint parts, from its timeline
    for rank in {row["rollout_rank"] for row in rows}:
        timeline = run_dir / "timeline" / f"rank{rank}.jsonl"
        spans = read_jsonl(timeline) if timeline.exists() else []
        ends[rank] = [span["end"] for span in spans if span["span"] == "checkpoint"]
    void = set()
    for attempt in read_attempts(run_dir)[:-1]:  # the last one finished the run
        start = attempt["start"]
        end = attempt["end"] if attempt.get("end") is not None else float("inf")
        for i, row in enumerate(rows):
            if start <= row["time"] <= end:
                parts = [t for t in ends[row["rollout_rank"]] if start <= t <= end]
                if not parts or row["time"] > max(parts):
                    void.add(i)
    return void


def sent_versions(run_dir: Path, partial: bool = False) -> dict[str, int]:
    """uid prefix (seed, epoch, prompt) -> the weights version its rollout rank started the
    group under, from the rollout ranks' own logs (not from anything the trainer wrote).
    Each group is sent once, but for sends no checkpoint holds (``void_sends``): the send
    that counts is the last."""
    rows = [
        row for path in sorted((run_dir / "sent").glob("rank*.jsonl")) for row in read_jsonl(path)
    ]
    void = void_sends(run_dir, rows)
    order = sorted(range(len(rows)), key=lambda i: rows[i]["time"])
    sent: dict[str, int] = {}
    voided: set[str] = set()
    for i in order:
        row = rows[i]
        uid = row["uid_prefix"]
        assert uid not in sent or uid in voided, f"group {uid} sent twice"
        voided.discard(uid)
        if i in void:
            voided.add(uid)
        # without partial rollout a group finishes under the weights it started with
        if partial:
            assert row["version_at_send"] >= row["version_generated"], row
        else:
            assert row["version_at_send"] == row["version_generated"], row
        sent[uid] = row["version_generated"]
    assert sent, "no rollout rank recorded a sent group (rollout.record_sent_groups)"
    return sent


def check_audit(
    run_dir: Path, sync_every: int, max_staleness: int, partial: bool = False
) -> list[dict]:
    """Every trained sample's staleness against an independent record: the version its
    rollout rank says it generated it under, and the version the trainer must hold at
    that step by its sync schedule (version 0 first, a new one after every ``sync_every``
    steps). Stale-dropped samples must be exactly those beyond ``max_staleness``."""
    sent = sent_versions(run_dir, partial)
    metrics = {row["step"]: row for row in split_metrics(read_jsonl(run_dir / "metrics.jsonl"))[0]}
    for step, row in metrics.items():
        assert row["param_version"] == (step - 1) // sync_every, row
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    uids = [row["uid"] for row in trained]
    assert len(uids) == len(set(uids)), "a sample was trained twice"
    for row in trained:
        generated = sent[row["uid"].rsplit("-r", 1)[0]]  # KeyError: trained but never sent
        staleness = (row["step"] - 1) // sync_every - generated
        assert row["param_version_start"] == generated, row
        assert row["staleness"] == staleness, row
        assert 0 <= staleness <= max_staleness, row
    for row in read_jsonl(run_dir / "dropped_samples.jsonl"):
        if row["reason"] == "stale":
            generated = sent[row["uid"].rsplit("-r", 1)[0]]
            assert (row["step"] - 1) // sync_every - generated > max_staleness, row
    return trained


def check_weights_match(
    run_dir: Path, rollout_ranks: int, versions: int, restarts: bool = False
) -> None:
    """After every sync, every rollout rank holds exactly the trainer leader's weights.

    With ``restarts`` a rank may lack the versions the leader published while its engine was
    down (it gets the newest one when it rejoins), but what it holds is the leader's, and it
    ends on the last version."""
    leader = {
        r["version"]: r["digest"]
        for r in read_jsonl(run_dir / "weights" / f"rank{rollout_ranks}.jsonl")
    }
    assert sorted(leader) == list(range(versions))
    for rank in range(rollout_ranks):
        mine = {
            r["version"]: r["digest"] for r in read_jsonl(run_dir / "weights" / f"rank{rank}.jsonl")
        }
        if restarts:
            assert versions - 1 in mine, f"rollout rank {rank} does not end on the last version"
            leader_held = {v: leader.get(v) for v in mine}
            assert mine == leader_held, f"rollout rank {rank} differs from the trainer after a sync"
        else:
            assert mine == leader, f"rollout rank {rank} differs from the trainer after a sync"


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model weights of a run's checkpoint of ``step``, whole (gathered from its parts)."""
    assert read_manifest(step_dir(run_dir, step))["step"] == step
    return read_full(step_dir(run_dir, step), "model")


def one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    """A command that failed on bad input: no traceback, one line ``error: ...`` on stderr
    that names each of ``words``; the line."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def leftovers(parent: Path) -> list[str]:
    """The hidden (temporary) files and folders a command left in ``parent``."""
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def wandb_records(run_dir: Path) -> list[tuple[str, Any]]:
    """Every record W&B wrote for the run's offline W&B runs (``RUN_DIR/wandb/offline-run-*``,
    oldest first): (the record's kind, the record), read from its ``.wandb`` files with W&B's
    own protobuf classes. The file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log chunks of 32 KiB blocks (4-byte checksum, 2-byte length, 1-byte type: full,
    first, middle, last), each record one serialized ``Record``."""
    import struct

    from wandb.proto import wandb_internal_pb2

    block = 32768
    out = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B", (path, data[:7])
        pos, pending = 7, b""
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:  # a block's tail too short for a chunk header: padding
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if length == 0 and kind == 0:  # zeros to the block's end
                pos += left
                continue
            chunk = data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                out.append((record.WhichOneof("record_type"), record))
    return out


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The rows logged to the run's W&B runs (``history`` records), oldest first."""
    import json

    rows = []
    for kind, record in wandb_records(run_dir):
        if kind == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def mlflow_run(run_dir: Path) -> tuple[Any, Any]:
    """(an MlflowClient of the run's file store RUN_DIR/mlruns, the run it holds)."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    experiments = client.search_experiments()
    runs = [r for e in experiments for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, runs
    return client, runs[0]
