"""The experiment trackers of ``trainer.logger`` besides the run's own files: W&B and
MLflow. Only the trainer leader logs, the rows it writes to ``metrics.jsonl`` (each step's,
and each validation's as its results come in), as it writes them.

``wandb``: a W&B run in ``RUN_DIR/wandb`` (project ``trainer.project_name``, name
``trainer.experiment_name`` or the run directory's). ``trainer.wandb_mode``: ``online``,
``offline``, or ``auto`` (the default): online when this node has a W&B key
(``WANDB_API_KEY`` or a netrc entry) and reaches its host within a few seconds, offline
otherwise, which compute nodes without a network are; an offline run says so at start and
gives the ``wandb sync`` command to run later from a login node. The charts' x axis is
``trainer/step`` (validations arrive after later steps, so W&B's own step is only a
counter the tracker keeps).

``mlflow``: an MLflow run under experiment ``trainer.project_name`` at
``trainer.mlflow_tracking_uri``, by default a file store in ``RUN_DIR/mlruns``
(``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri RUN_DIR/mlruns`` shows it). Metric names keep MLflow's characters:
``val/pass@1`` is logged as ``val/pass_at_1``.

Both get the config (flattened ``section.key``), the run directory and the code's commit
at the run's start. A resume continues the same tracker runs: their ids are kept in
``RUN_DIR/trackers.json`` with the last step and validation each has logged, and rows a
resumed attempt writes again for those steps (it trains again from its checkpoint) are not
sent twice, so each step is in the tracker once (the first attempt's values). Each attempt
after the first logs ``run/attempt``, ``run/restarts``, ``run/preemptions``,
``run/lost_s`` and ``run/requeue_wait_s`` (``goodput.py``) at its resumed step.

A tracker that fails mid-run (W&B's writer process killed by the job's stop signal, a
tracking server gone) is dropped for the rest of the attempt with one warning (the rows it
missed are not sent later): a tracker never ends a run, and ``metrics.jsonl`` keeps every
row.

Memory: nothing per step beyond the row being sent (W&B's writer is its own process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
import subprocess
import uuid
from pathlib import Path
from typing import Any

from hpc_asyncppo import goodput
from hpc_asyncppo.config import Config

log = logging.getLogger(__name__)
STATE = "trackers.json"  # in RUN_DIR: the tracker runs' ids and what each has logged
WANDB_DIR = "wandb"
MLRUNS = "mlruns"
WANDB_HOST = ("api.wandb.ai", 443)
REACH_S = 3.0  # how long ``auto`` tries to reach W&B before it goes offline
STEP_KEY = "trainer/step"


def flat_config(cfg: Config) -> dict[str, Any]:
    """``{"section.key": value}`` of every knob (lists and dicts as JSON)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(f"{prefix}{f.name}.", getattr(value, f.name))
        elif isinstance(value, (list, tuple, dict)):
            out[prefix[:-1]] = json.dumps(value)
        else:
            out[prefix[:-1]] = value

    walk("", cfg)
    return out


def code_commit() -> str:
    """The git commit of the installed code (and "+dirty" with local changes), else its
    version."""
    from hpc_asyncppo import __version__

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return f"hpc_asyncppo {__version__}"
    return head + ("+dirty" if dirty else "")


def wandb_online(mode: str) -> tuple[bool, str]:
    """Whether W&B runs online, and why (``auto``'s reason, for the line at start)."""
    if mode != "auto":
        return mode == "online", f"trainer.wandb_mode={mode}"
    if not os.environ.get("WANDB_API_KEY") and not _netrc_has(WANDB_HOST[0]):
        return False, "no W&B key on this node (WANDB_API_KEY or wandb login)"
    try:
        socket.create_connection(WANDB_HOST, timeout=REACH_S).close()
    except OSError:
        return False, f"this node does not reach {WANDB_HOST[0]}"
    return True, f"this node reaches {WANDB_HOST[0]}"


def _netrc_has(host: str) -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def mlflow_name(key: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_ - . /`` and spaces)."""
    return re.sub(r"[^\w\-./ ]", "_", key.replace("@", "_at_"))


class Trackers:
    """The W&B and MLflow runs of ``trainer.logger`` (none: nothing is imported)."""

    def __init__(self, cfg: Config, run_dir: Path, resumed_step: int):
        self.cfg, self.run_dir = cfg, run_dir
        names = set(cfg.trainer.logger)
        self.path = run_dir / STATE
        self.state: dict[str, Any] = json.loads(self.path.read_text()) if (
            self.path.exists()
        ) else {}  # fmt: skip
        self.wandb: Any = None
        self.mlflow: Any = None  # (client, run id)
        if not names & {"wandb", "mlflow"}:
            return
        name = cfg.trainer.experiment_name or run_dir.name
        params = {**flat_config(cfg), "run_dir": str(run_dir), "code_commit": code_commit()}
        if "wandb" in names:
            self.wandb = self._open_wandb(name, params)
        if "mlflow" in names:
            self.mlflow = self._open_mlflow(name, params)
        self._save()
        attempts = goodput.read_attempts(run_dir)
        if len(attempts) > 1:  # this attempt's row is the last
            earlier = attempts[:-1]
            self.write([{
                "step": resumed_step,
                "run/attempt": len(earlier),
                "run/restarts": sum(bool(a.get("restarted")) for a in earlier),
                "run/preemptions": sum(str(a.get("reason")).startswith("signal ") for a in earlier),
                "run/lost_s": sum(float(a.get("lost_s") or 0) for a in attempts),
                "run/requeue_wait_s": sum(float(a.get("requeue_wait_s") or 0) for a in attempts),
            }], force=True)  # fmt: skip

    # --- W&B ------------------------------------------------------------------------------
    def _open_wandb(self, name: str, params: dict) -> Any:
        import wandb

        mine = self.state.setdefault("wandb", {"id": uuid.uuid4().hex[:12], "sent": 0})
        online, why = wandb_online(self.cfg.trainer.wandb_mode)
        (self.run_dir / WANDB_DIR).mkdir(exist_ok=True)
        run = wandb.init(
            project=self.cfg.trainer.project_name,
            name=name,
            id=mine["id"],
            resume="allow",
            dir=str(self.run_dir),
            mode="online" if online else "offline",
            config=params,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        run.define_metric(STEP_KEY)
        run.define_metric("*", step_metric=STEP_KEY)
        where = "online" if online else "offline"
        line = f"W&B run {mine['id']} ({where}: {why})"
        if not online:
            line += (f"; to upload it later, from a node with a network: wandb sync "
                     f"{self.run_dir / WANDB_DIR}/offline-run-*-{mine['id']}")  # fmt: skip
        log.info(line)
        print(line, flush=True)
        return run

    # --- MLflow ---------------------------------------------------------------------------
    def _open_mlflow(self, name: str, params: dict) -> tuple[Any, str]:
        from mlflow.tracking import MlflowClient

        uri = self.cfg.trainer.mlflow_tracking_uri or (self.run_dir / MLRUNS).as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store but asks for this to use it; a file store on
            # the run's filesystem is what works on a cluster (SQLite wants file locks a
            # parallel filesystem may not give)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri=uri)
        mine = self.state.get("mlflow")
        if mine is None:
            project = self.cfg.trainer.project_name
            experiment = client.get_experiment_by_name(project)
            experiment_id = (
                experiment.experiment_id if experiment else client.create_experiment(project)
            )
            run = client.create_run(experiment_id, run_name=name, tags={
                "mlflow.source.git.commit": params["code_commit"], "run_dir": params["run_dir"]
            })  # fmt: skip
            mine = self.state["mlflow"] = {"run_id": run.info.run_id, "uri": uri}
            from mlflow.entities import Param

            items = [Param(k[:250], str(v)[:6000]) for k, v in params.items()]
            for start in range(0, len(items), 100):  # MLflow's batch limit
                client.log_batch(mine["run_id"], params=items[start : start + 100])
        else:
            client.update_run(mine["run_id"], status="RUNNING")
        line = f"MLflow run {mine['run_id']} at {uri}"
        log.info(line)
        print(line, flush=True)
        return client, mine["run_id"]

    # --- rows -----------------------------------------------------------------------------
    def write(self, rows: list[dict[str, Any]], force: bool = False) -> None:
        """Send the rows not yet sent (a validation row: ``val/`` keys; ``force``: the
        attempt's own row, sent as it is)."""
        if self.wandb is None and self.mlflow is None:
            return
        sent = False
        for row in rows:
            kind = "val_through" if any(k.startswith("val/") for k in row) else "step_through"
            step = int(row["step"])
            if not force and step <= self.state.get(kind, -1):
                continue
            values = {k: v for k, v in row.items()
                      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip
            if self.wandb is not None:
                counter = self.state["wandb"]["sent"]
                row_values = {**values, STEP_KEY: step}
                if self._guard("wandb", self.wandb.log, row_values, step=counter):
                    self.state["wandb"]["sent"] = counter + 1
            if self.mlflow is not None:
                from mlflow.entities import Metric

                client, run_id = self.mlflow
                stamp = int(float(row.get("time/unix", 0)) * 1000)
                metrics = [Metric(mlflow_name(k), float(v), stamp, step) for k, v in values.items()]
                for start in range(0, len(metrics), 1000):  # MLflow's batch limit
                    batch = metrics[start : start + 1000]
                    if not self._guard("mlflow", client.log_batch, run_id, metrics=batch):
                        break
            if not force:
                self.state[kind] = step
            sent = True
        if sent:
            self._save()

    def _save(self) -> None:
        tmp = self.path.with_name(STATE + ".tmp")
        tmp.write_text(json.dumps(self.state) + "\n")
        tmp.replace(self.path)

    def _guard(self, name: str, call: Any, *args: Any, **kwargs: Any) -> bool:
        """Make one call to a tracker; a tracker that fails (its W&B process killed by the
        job's stop signal, its store gone) is dropped for the rest of the attempt with one
        warning: training and metrics.jsonl go on, a tracker never ends a run."""
        try:
            call(*args, **kwargs)
            return True
        except Exception as exc:  # noqa: BLE001 - whatever the tracker's client raises
            log.warning("trainer.logger %s failed (%s: %s); it logs nothing more in this "
                        "attempt, metrics.jsonl has every row", name, type(exc).__name__,
                        " ".join(str(exc).split())[:200])  # fmt: skip
            setattr(self, name, None)
            if name == "wandb":  # its service connection, or its exit hook says so again
                import wandb

                with contextlib.suppress(Exception):
                    wandb.teardown()
            return False

    def close(self, finished: bool) -> None:
        """``finished``: the run reached its last step (else it stopped, to be resumed)."""
        if self.wandb is not None:
            self._guard("wandb", self.wandb.finish, exit_code=0 if finished else 1)
            self.wandb = None
        if self.mlflow is not None:
            client, run_id = self.mlflow
            self._guard(
                "mlflow", client.set_terminated, run_id, "FINISHED" if finished else "KILLED"
            )
            self.mlflow = None
