"""The rollout rank's engine and the trainer's weights it holds: one owner for the state
every weight message changes.

What it keeps: the engine (the one running now; a restarted engine is attached through
``attach``), the version the engine holds (-1: none yet, or none since its restart), the
version the leader last announced (loaded or not), the weight group's generation the
engine is in, and with in-flight weight updates the sync arriving on a side thread and
its staging copy of the weights (one more copy of the weights in ``model.dtype`` on the
rank's device, allocated once). Its counters: engine restarts and their time, from the
death to the weights loaded again.

The messages (``rollout/rollouter.py`` hands them over):

- SYNC (``sync``): the engine loads the leader's next broadcast. Before the weights
  change, ``before_load`` runs (the rank finishes or cuts its groups in flight: they must
  not mix two versions in one forward). With in-flight updates (the hf engine in
  fully_async) the broadcast is received on a side thread while the engine generates on,
  and loaded between two engine steps once complete (``load_pending``); without partial
  rollout the groups in flight finish first under the weights that started them, and no
  new group starts meanwhile (``draining``). A SYNC announced while the engine is out of
  the weight group (it died, the leader did not know yet) is void: its broadcast broke on
  the dead engine, and the weights come again after REGROUP.
- REGROUP (``regroup``): the weight group meets anew (an engine restarted somewhere); the
  engine joins its next generation.
- An engine's death (``died``): counted (past ``rollout.max_engine_restarts`` it fails the
  rank), out of the weight group until REGROUP, without weights until the next SYNC.

After every load, ``loaded`` runs (the rank places its cut groups, records the sync).
What the owner checks itself: every member of the engine loaded the same weights (their
digests, when ``trainer.record_weight_digests`` asks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from hpc_asyncppo.config import Config
from hpc_asyncppo.rollout.engine import EngineDied, RolloutEngine
from hpc_asyncppo.runlog import record_weight_digest
from hpc_asyncppo.runtime import heartbeat
from hpc_asyncppo.transport.weight_group import WeightGroupSpec
from hpc_asyncppo.transport.weights import Background, WeightUpdate

log = logging.getLogger(__name__)


class EngineWeights:
    def __init__(
        self,
        cfg: Config,
        rank: int,
        engine: RolloutEngine,
        spec: WeightGroupSpec,
        first_member: int,
        run_dir: Path,
        before_load: Callable[[], None],
        loaded: Callable[[WeightUpdate, float, float], None],
    ):
        """``spec``: the weight group's generation the engine joins now; ``first_member``:
        the group rank of the engine's first member. ``before_load()`` runs before the
        weights change, ``loaded(update, start, wall_start)`` once they have."""
        self.rank, self.run_dir = rank, run_dir
        self.partial_rollout = cfg.async_training.partial_rollout
        self.max_restarts = cfg.rollout.max_engine_restarts
        self.sync_timeout_s = cfg.timeouts.weight_sync_s
        self.record_digests = cfg.trainer.record_weight_digests
        self.before_load, self.loaded = before_load, loaded
        self.engine = engine
        self.spec, self.first_member = spec, first_member
        self.inflight = (
            cfg.async_training.inflight_weight_update
            and cfg.async_training.mode != "sync"
            and engine.stages_weights
        )
        self.version = -1  # the version the engine holds: none before the first sync
        self.announced = -1  # the version of the leader's last SYNC, loaded or not
        self.pause_s = 0.0  # the engine's pause for the last sync
        # in-flight weight updates: the sync received on a side thread, its version, and
        # the staging copy it is received into
        self.pending: Background | None = None
        self.pending_version = -1
        self.staging: dict[str, torch.Tensor] = {}
        self.out_of_group = False  # the engine died: out of the weight group until REGROUP
        self.died_at: float | None = None  # ... and without weights until the next sync
        self.restarts, self.restart_s = 0, 0.0
        self.engine.join_weights(self.spec, self.first_member)

    @property
    def held(self) -> bool:
        """The engine holds the trainer's weights (not before the first sync, nor after an
        engine restart until the next)."""
        return self.version >= 0 and self.died_at is None

    @property
    def draining(self) -> bool:
        """New weights are in and wait for the groups in flight to finish (without partial
        rollout): no new group starts."""
        return self.pending is not None and self.pending.done() and not self.partial_rollout

    def sync(self, version: int) -> None:
        """SYNC: receive the leader's broadcast of ``version`` and load it (in-flight
        updates: start receiving it on a side thread, loaded by ``load_pending``)."""
        self.announced = version
        if self.out_of_group:
            log.warning(
                "rank %d: the sync of version %d is void (announced before the leader "
                "knew its engine had died): the weights come again after REGROUP",
                self.rank,
                version,
            )
            return
        heartbeat.doing(f"receiving the weights of version {version}")
        if self.inflight and self.held:
            self.load_pending(wait=True)  # one sync at a time
            self.pending = self.engine.receive_staged(self.staging)
            self.pending_version = version
            return
        self.before_load()
        start, wall_start = time.monotonic(), time.time()
        self._loaded(self.engine.update_weights(version, self.record_digests), start, wall_start)

    def load_pending(self, wait: bool = False, groups_in_flight: bool = False) -> None:
        """Load the sync received on the side thread, once it is complete (``wait``: now,
        waiting for it). Without partial rollout, ``groups_in_flight`` finish first. With
        none in flight it waits for the sync: there is no generation to overlap it with,
        and groups started now would be sampled whole under weights already replaced (with
        the hf engine's whole-response steps, a batch of them: a version's weights would
        reach the rank one batch late)."""
        if self.pending is None:
            return
        wait = wait or not groups_in_flight
        if not (wait or self.pending.done()):
            return
        if not wait and not self.partial_rollout:  # (not wait: groups are in flight)
            return  # draining: the groups in flight finish under the weights they started
        start, wall_start = time.monotonic(), time.time()
        received = self.pending.result(self.sync_timeout_s)
        self.pending = None
        self.before_load()
        update = self.engine.load_staged(
            self.pending_version, received, self.staging, self.record_digests
        )
        self._loaded(update, start, wall_start)

    def regroup(self, generation: int) -> None:
        """REGROUP: the engine joins the weight group's ``generation``."""
        heartbeat.doing(f"joining the weight group's generation {generation}")
        self.load_pending(wait=True)  # received from the group before
        self.spec = replace(self.spec, generation=generation)
        self.engine.join_weights(self.spec, self.first_member)
        self.out_of_group = False

    def died(self, death: EngineDied) -> None:
        """The engine died: counted, out of the weight group until REGROUP and without
        weights until the next sync. One death past ``rollout.max_engine_restarts`` fails
        the rank (the job restart takes over)."""
        if self.restarts >= self.max_restarts:
            raise RuntimeError(
                f"{death} (its engine restarted {self.restarts} times already: "
                f"rollout.max_engine_restarts={self.max_restarts})"
            ) from death
        self.died_at = time.monotonic() if self.died_at is None else self.died_at
        self.restarts += 1
        self.out_of_group = True

    def attach(self, engine: RolloutEngine) -> None:
        """The restarted engine, in place of the dead one (it joins at REGROUP)."""
        self.engine = engine

    def finish(self) -> None:
        """The end of the rank: a sync the leader finished broadcasting before STOP is
        received (the group's collective completes), not loaded."""
        if self.pending is not None:
            self.pending.result(self.sync_timeout_s)
            self.pending = None

    def _loaded(self, update: WeightUpdate, start: float, wall_start: float) -> None:
        self.version, self.pause_s = update.version, update.pause_s
        if self.died_at is not None:  # the restarted engine has its weights
            self.restart_s += time.monotonic() - self.died_at
            self.died_at = None
        if self.record_digests:
            if len(set(update.digests)) != 1:
                raise RuntimeError(
                    f"rollout rank {self.rank}: its weight-group members loaded different "
                    f"weights at version {update.version} (digests {update.digests})"
                )
            record_weight_digest(self.run_dir, self.rank, update.version, update.digests[0])
        self.loaded(update, start, wall_start)
