"""The trainer leader's side of validation: when to ask, what to log.

With ``trainer.test_freq`` = N > 0 (and ``data.val``), the leader asks every rollout rank to
validate (VALIDATE) at step 0 (``trainer.val_before_train``), N, 2N, ...: right after the
step's weight sync, if it has one, so the rollout ranks validate the weights of the leader's
version at that step (the newest they have). Training goes on meanwhile; the rollout
ranks' results come back whenever they are done (``ValidationLog.poll``, called wherever the
leader takes in samples) and are logged as one metrics row of that step with only ``val/``
keys (``validation_metrics``). A run ends after every validation it asked for is logged.

A rank whose engine restarted may no longer hold the weights it was asked to validate (the
leader trained past them, or the run ended before they were sent again): its result says
``void``, and that step has no validation row, with a warning that says why.
"""

from __future__ import annotations

import logging

import numpy as np

from hpc_asyncppo import runlog
from hpc_asyncppo.config import Config
from hpc_asyncppo.transport.arrays import unpack_arrays
from hpc_asyncppo.transport.samples import Control, SampleReceiver

log = logging.getLogger(__name__)
PASS_REWARD = 1.0  # a response passes when its reward is the full score (rewards in [0, 1])


def validation_metrics(rewards: np.ndarray, sources: list[str], version: int) -> dict[str, float]:
    """Metrics of one validation. ``rewards``: (P, k), the k = val_n responses' rewards of each
    of P prompts; ``sources``: each prompt's data_source (P,).

    ``val/reward/mean``: the mean over every response; ``val/pass@k``: the fraction of prompts
    with at least one of their k responses at the full reward (``PASS_REWARD``); the same
    under ``val/<source>/`` for each data_source when there are several; ``val/prompts``.
    """
    k = rewards.shape[1] if rewards.ndim == 2 else 0
    out: dict[str, float] = {"val/param_version": version, "val/prompts": int(rewards.shape[0])}

    def add(prefix: str, rows: np.ndarray) -> None:
        if rows.size:
            out[f"{prefix}reward/mean"] = float(rows.mean())
            out[f"{prefix}pass@{k}"] = float((rows >= PASS_REWARD).any(axis=1).mean())

    add("val/", rewards)
    names = sorted(set(sources))
    if len(names) > 1:
        index = np.asarray(sources)
        for name in names:
            add(f"val/{name or 'unknown'}/", rewards[index == name])
    return out


class ValidationLog:
    """Which validations were asked for and not yet logged; the results as they come in."""

    def __init__(self, cfg: Config, receiver: SampleReceiver, metrics: runlog.MetricsWriter):
        self.every = cfg.trainer.test_freq if cfg.data.val else 0
        self.before_train = cfg.trainer.val_before_train
        self.receiver, self.metrics = receiver, metrics
        self.waiting: dict[int, dict[int, tuple[dict, dict]]] = {}  # step -> rank -> result
        self.versions: dict[int, int] = {}  # step -> the version asked for
        self.void: set[int] = set()  # steps a rank could not validate: not logged

    def due(self, step: int, before_train: bool = False) -> bool:
        """Whether to validate after ``step``; ``before_train``: at the start of the loop, at
        step 0 (val_before_train) or at a resume's step, again if it is one to validate
        (its validation may have been lost with the stopped run)."""
        if not self.every:
            return False
        if before_train and step == 0:
            return self.before_train
        return step % self.every == 0

    def request(self, step: int, version: int) -> None:
        """Ask every rollout rank to validate the weights of ``version`` (the newest sent)."""
        self.receiver.broadcast_control(Control.VALIDATE, step)
        self.waiting[step] = {}
        self.versions[step] = version

    def settled(self) -> bool:
        return not self.waiting

    def poll(self) -> None:
        for rank, buf in self.receiver.poll_validation():
            arrays, meta = unpack_arrays(buf)
            step = meta["step"]
            if step in self.void:  # another rank's share of a validation that is void
                continue
            if meta.get("void"):
                log.warning(
                    "step %d has no validation row: rollout rank %d lost the weights of v%d "
                    "with its engine (restarted) before it could validate them",
                    step,
                    rank,
                    meta["version"],
                )
                self.void.add(step)
                del self.waiting[step], self.versions[step]
                continue
            if meta["version"] != self.versions[step]:
                raise RuntimeError(
                    f"rollout rank {rank} validated step {step} with weights v{meta['version']}, "
                    f"not the v{self.versions[step]} the leader had sent"
                )
            self.waiting[step][rank] = ({k: np.array(v) for k, v in arrays.items()}, meta)
            if len(self.waiting[step]) == self.receiver.rollout_ranks:
                self.log(step, self.waiting.pop(step))

    def log(self, step: int, results: dict[int, tuple[dict, dict]]) -> None:
        rewards, sources, skipped = [], [], 0
        for arrays, meta in results.values():
            rewards.append(arrays["rewards"])
            sources += [meta["sources"][i] for i in arrays["source"].tolist()]
            skipped += meta["skipped"]
        row = validation_metrics(np.concatenate(rewards), sources, self.versions.pop(step))
        self.metrics.write([{"step": step, **row, "val/skipped_prompts": skipped}])
