"""The trainer ranks' main loop.

The leader (first trainer rank), top to bottom: broadcast version-0 weights; then for each
step collect ``required_groups`` fresh groups (receiving samples and granting credits while
it waits; groups older than ``max_staleness`` versions are dropped and recorded), compute
GRPO advantages over whole groups, hand every trainer rank an equal shard, run the PPO
update (gradients all-reduced across trainer ranks), log, and every ``sync_every`` steps
broadcast the weights as a new version. Followers only receive shards and update.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from hpc_asyncppo import runlog
from hpc_asyncppo.config import Config
from hpc_asyncppo.launch.topology import Topology
from hpc_asyncppo.trainer import algos
from hpc_asyncppo.trainer.batch import collate, split_rows, to_tensors
from hpc_asyncppo.trainer.credits import CreditController
from hpc_asyncppo.trainer.policy import Policy, ppo_update
from hpc_asyncppo.transport.arrays import pack_arrays, unpack_arrays
from hpc_asyncppo.transport.samples import Control, SampleGroup, SampleReceiver
from hpc_asyncppo.transport.waits import PeerTimeout, poll_until
from hpc_asyncppo.transport.weights import WeightBroadcaster

log = logging.getLogger(__name__)
TAG_SHARD = 21


def staleness_of(group: SampleGroup, version: int) -> int:
    """Versions between the weights that started generating the group and the trainer's now."""
    return version - group.param_version_start


class TrainerLeader:
    def __init__(self, cfg: Config, topo: Topology, run_dir: Path, policy: Policy):
        self.cfg, self.topo, self.run_dir, self.policy = cfg, topo, run_dir, policy
        self.receiver = SampleReceiver(topo.inter)
        self.broadcaster = WeightBroadcaster(
            topo.sync_group, topo.leader, cfg.trainer.weight_sync_bucket_mb, topo.device
        )
        self.credits = CreditController(
            topo.rollout_ranks,
            cfg.max_required_groups,
            cfg.trainer.total_steps * cfg.required_groups,
        )
        self.queue: deque[SampleGroup] = deque()
        self.version = -1
        self.step = 0
        self.samples_trained = 0
        self.samples_dropped = 0
        self.idle_s = 0.0
        self.last_sync_s = 0.0
        self.rollout_idle: dict[int, tuple[float, float]] = {}
        self.metrics = runlog.JsonlWriter(run_dir / runlog.METRICS)
        self.trained_log = runlog.JsonlWriter(run_dir / runlog.TRAINED)
        self.dropped_log = runlog.JsonlWriter(run_dir / runlog.DROPPED)
        self.pad_id = policy.model.config.pad_token_id or 0
        self.started_at = time.monotonic()

    # --- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        self.sync_weights(0)
        self.started_at = time.monotonic()
        while self.step < self.cfg.trainer.total_steps:
            groups = self.collect_batch()
            batch = collate(groups, self.advantages(groups), self.pad_id)
            shards = split_rows(batch, self.topo.train_ranks)
            self.send_shards(shards[1:], stop=False)
            stats = ppo_update(
                self.policy,
                to_tensors(shards[0], self.topo.device),
                self.topo.trainer_group,
                self.topo.train_ranks,
            )
            self.step += 1
            self.record(groups, stats)
            if self.step % self.cfg.sync_every == 0:
                self.sync_weights(self.version + 1)
        self.shutdown()

    # --- the steps ----------------------------------------------------------------------
    def pump(self) -> None:
        """Take every arrived group into the queue, then hand out the credits now allowed."""
        for group in self.receiver.poll():
            self.credits.received(group.rollout_rank)
            self.rollout_idle[group.rollout_rank] = (group.rollout_idle_s, group.rollout_elapsed_s)
            self.queue.append(group)
        for rank, count in enumerate(self.credits.grant()):
            if count:
                self.receiver.send_control(rank, Control.CREDIT, count)

    def collect_batch(self) -> list[SampleGroup]:
        """The next ``required_groups`` groups within the staleness bound, oldest first."""
        batch: list[SampleGroup] = []
        waited_since = time.monotonic()

        def ready() -> bool:
            self.pump()
            while self.queue and len(batch) < self.cfg.required_groups:
                group = self.queue.popleft()
                if staleness_of(group, self.version) > self.cfg.async_training.max_staleness:
                    self.drop(group, "stale")
                else:
                    batch.append(group)
            return len(batch) == self.cfg.required_groups

        try:
            poll_until(ready, self.cfg.timeouts.sample_wait_s, "samples from the rollout ranks")
        except PeerTimeout as exc:
            raise PeerTimeout(
                f"{exc} (step {self.step + 1}; have {len(batch)}/{self.cfg.required_groups} groups; "
                f"groups received per rollout rank: {self.receiver.received_from})"
            ) from None
        self.idle_s += time.monotonic() - waited_since
        self.credits.consumed(trained=len(batch), dropped=0)
        return batch

    def advantages(self, groups: list[SampleGroup]) -> np.ndarray:
        """(G, n) GRPO advantages over whole groups; zeros for GAE (computed on each rank)."""
        scores = torch.from_numpy(np.stack([g.rewards for g in groups]))
        if self.cfg.algorithm.adv_estimator == "gae":
            return np.zeros(scores.shape, dtype=np.float32)
        norm = (
            self.cfg.algorithm.adv_estimator == "grpo"
            and self.cfg.algorithm.norm_adv_by_std_in_grpo
        )
        return algos.grpo_advantages(scores, norm_by_std=norm).numpy()

    def send_shards(self, shards: list[dict[str, np.ndarray]], stop: bool) -> None:
        requests = []
        for follower, shard in enumerate(shards, start=1):
            buf = pack_arrays(shard, {"stop": stop, "step": self.step + 1})
            requests.append(
                (self.topo.local.Isend([buf, MPI.BYTE], dest=follower, tag=TAG_SHARD), buf)
            )
        poll_until(
            lambda: all(r.Test() for r, _ in requests),
            self.cfg.timeouts.rank_wait_s,
            "trainer ranks to take their shards",
        )

    def sync_weights(self, version: int) -> None:
        self.receiver.broadcast_control(Control.SYNC, version)
        self.last_sync_s = self.broadcaster.broadcast(version, self.policy.named_weights())
        self.version = version
        self.credits.synced()
        if self.cfg.trainer.record_weight_digests:
            runlog.record_weight_digest(
                self.run_dir, self.topo.world_rank, version, self.policy.named_weights()
            )
        self.pump()

    def drop(self, group: SampleGroup, reason: str) -> None:
        self.credits.consumed(trained=0, dropped=1)
        self.samples_dropped += group.n
        self.dropped_log.write([self.sample_row(group, j, reason=reason) for j in range(group.n)])

    def sample_row(self, group: SampleGroup, j: int, **extra: object) -> dict:
        return {
            "uid": group.uid(j),
            "step": self.step,
            "param_version_start": group.param_version_start,
            "param_version_end": group.param_version_end,
            "staleness": staleness_of(group, self.version),
            "reward": float(group.rewards[j]),
            "rollout_rank": group.rollout_rank,
            **extra,
        }

    def record(self, groups: list[SampleGroup], stats: dict[str, float]) -> None:
        rows = [self.sample_row(g, j) for g in groups for j in range(g.n)]
        self.trained_log.write(rows)
        self.samples_trained += len(rows)
        elapsed = time.monotonic() - self.started_at
        staleness = [r["staleness"] for r in rows]
        rollout_idle = [idle / max(total, 1e-9) for idle, total in self.rollout_idle.values()]
        self.metrics.write(
            [
                {
                    "step": self.step,
                    "param_version": self.version,
                    "reward/mean": float(np.mean([r["reward"] for r in rows])),
                    "staleness/mean": float(np.mean(staleness)),
                    "staleness/max": int(max(staleness)),
                    "samples/total": self.samples_trained,
                    "samples/dropped": self.samples_dropped,
                    "queue/groups": len(self.queue),
                    "time/elapsed_s": elapsed,
                    "throughput/samples_per_s": self.samples_trained / max(elapsed, 1e-9),
                    "trainer/idle_ratio": self.idle_s / max(elapsed, 1e-9),
                    "rollouter/idle_ratio": float(np.mean(rollout_idle)) if rollout_idle else 0.0,
                    "sync/time_s": self.last_sync_s,
                    **stats,
                }
            ]
        )

    def shutdown(self) -> None:
        """Stop the rollout ranks, drain what they still send (recorded as dropped), stop followers."""
        self.receiver.broadcast_control(Control.STOP)
        self.send_shards([{}] * (self.topo.train_ranks - 1), stop=True)

        def drained() -> bool:
            self.queue.extend(self.receiver.poll())
            return self.receiver.all_done()

        poll_until(drained, self.cfg.timeouts.rank_wait_s, "rollout ranks to finish after STOP")
        for group in self.queue:
            self.drop(group, "run_ended")
        self.queue.clear()
        self.receiver.flush(self.cfg.timeouts.rank_wait_s)
        for writer in (self.metrics, self.trained_log, self.dropped_log):
            writer.close()


def run_follower(cfg: Config, topo: Topology, policy: Policy) -> None:
    """A non-leader trainer rank: train on each shard the leader sends until told to stop."""
    # The leader may wait for samples and a sync between two shards: allow for both.
    timeout = cfg.timeouts.sample_wait_s + cfg.timeouts.weight_sync_s + cfg.timeouts.rank_wait_s
    status = MPI.Status()
    while True:
        poll_until(
            lambda: topo.local.Iprobe(source=0, tag=TAG_SHARD, status=status),
            timeout,
            "a shard from the trainer leader",
        )
        buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        topo.local.Recv([buf, MPI.BYTE], source=0, tag=TAG_SHARD)
        shard, meta = unpack_arrays(buf)
        if meta["stop"]:
            return
        ppo_update(policy, to_tensors(shard, topo.device), topo.trainer_group, topo.train_ranks)


def run_trainer(cfg: Config, topo: Topology, run_dir: Path) -> None:
    torch.set_num_threads(cfg.actor.torch_threads)
    torch.manual_seed(cfg.trainer.seed)
    policy = Policy(cfg, topo.device)
    if topo.is_leader:
        TrainerLeader(cfg, topo, run_dir, policy).run()
    else:
        run_follower(cfg, topo, policy)
