"""The trainer ranks' main loop.

The leader (first trainer rank), top to bottom: broadcast the weights (version 0, or the
checkpoint's version on resume); then for each step collect ``required_groups`` fresh groups
(receiving samples and granting credits while it waits; groups older than ``max_staleness``
versions are dropped and recorded, and with dynamic sampling groups whose rewards are all
equal are dropped, recorded and refilled), add the overlong penalty to the rewards, compute
the group advantages (GRPO, RLOO, REINFORCE++ baseline) over whole groups, hand every
trainer rank an equal shard, run the PPO update (gradients all-reduced across trainer
ranks), log, every ``sync_every`` steps broadcast the weights as a new version, and every
``checkpoint.save_every`` steps write a checkpoint; every ``trainer.test_freq`` steps it asks
the rollout ranks to validate the newest weights (``validation.py``). A stop signal
(Slurm's warning signal, SIGTERM, the launcher's forwarded Ctrl-C) ends the loop with a
checkpoint at once: a batch being gathered, or one whose update has not reached its
optimizer step (``ppo_update`` abandons it), goes back to the front of the queue.
Followers only receive shards and update (and send their RNG state for a checkpoint).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from hpc_asyncppo import goodput, runlog
from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.checkpoint.store import (
    CheckpointError,
    CheckpointReader,
    rng_state,
    set_rng_state,
)
from hpc_asyncppo.config import Config
from hpc_asyncppo.launch.rundir import PREEMPTED
from hpc_asyncppo.runtime import startup
from hpc_asyncppo.runtime.signals import stop_requested, stop_requested_at
from hpc_asyncppo.runtime.topology import Topology
from hpc_asyncppo.tasks import load_task
from hpc_asyncppo.tasks.overlong import usable_prompts
from hpc_asyncppo.timeline import Timeline
from hpc_asyncppo.trainer import algos
from hpc_asyncppo.trainer.batch import collate, shard_rows, to_tensors
from hpc_asyncppo.trainer.credits import CreditController
from hpc_asyncppo.trainer.policy import Policy, peak_memory_mb, ppo_update
from hpc_asyncppo.trainer.prompts import PromptOrder
from hpc_asyncppo.trainer.queue import SpillQueue
from hpc_asyncppo.trainer.validation import ValidationLog
from hpc_asyncppo.transport.arrays import pack_arrays, unpack_arrays
from hpc_asyncppo.transport.samples import Control, SampleGroup, SampleReceiver, decode_group
from hpc_asyncppo.transport.waits import PeerTimeout, poll_until
from hpc_asyncppo.transport.weight_group import open_weight_group
from hpc_asyncppo.transport.weights import Background, WeightBroadcaster

log = logging.getLogger(__name__)
TAG_SHARD = 21
TAG_FOLLOWER_STATE = 22


def staleness_of(group: SampleGroup, version: int) -> int:
    """Versions between the weights that started generating the group and the trainer's now."""
    return version - group.param_version_start


class TrainerLeader:
    def __init__(
        self, cfg: Config, topo: Topology, run_dir: Path, policy: Policy, checkpoint: Path | None
    ):
        self.cfg, self.topo, self.run_dir, self.policy = cfg, topo, run_dir, policy
        self.receiver = SampleReceiver(topo.inter)
        # The weight group meets once every member has joined (vLLM workers once their
        # engine has started): the leader joins on a side thread and waits at its first sync.
        self.joining = Background(
            lambda: open_weight_group(topo.weights, 0), "the weight group's rendezvous"
        )
        self.broadcaster: WeightBroadcaster | None = None
        self.credits = CreditController(
            topo.rollout_ranks,
            cfg.max_required_groups,
            cfg.trainer.total_steps * cfg.required_groups,
        )
        # Encoded groups, oldest first; past buffer.memory_limit_mb they wait on disk.
        self.queue = SpillQueue(run_dir / "overflow.h5", cfg.buffer.memory_limit_mb)
        # The data order: every credit goes out with the prompt it is for.
        num_prompts = len(usable_prompts(load_task(cfg.data).prompts(), run_dir))
        self.order = PromptOrder(num_prompts, cfg.trainer.seed)
        self.version = 0
        self.step = 0
        self.synced_step = 0  # the step after which the current version's weights were sent
        self.unsynced_steps = False  # restored weights trained past their version's broadcast
        self.samples_trained = 0
        self.samples_dropped = 0
        self.samples_filtered = 0  # of samples_dropped: by dynamic sampling
        self.step_filtered = 0  # groups dynamic sampling dropped while collecting this step
        self.step_flat_kept = 0  # zero-variance groups kept: the step's refills were spent
        self.idle_s = 0.0
        self.elapsed_before_s = 0.0  # training time of earlier runs of this job (resume)
        self.last_sync_s = 0.0
        # in-flight weight updates: the broadcast on its side thread, once a first went out
        self.inflight_updates = (
            cfg.async_training.inflight_weight_update and cfg.async_training.mode != "sync"
        )
        self.sending: Background | None = None
        self.version_sent = False
        self.batch_encoded: list[np.ndarray] = []  # the last batch taken, to put back
        self.rollout_idle: dict[int, tuple[float, float]] = {}
        self.partial_groups = [0] * topo.rollout_ranks  # cut groups each rank holds
        self.tokens_regenerated: dict[int, int] = {}  # per rollout rank, cumulative
        self.sync_pause: dict[int, float] = {}  # per rollout rank, its engine's last pause
        self.checkpoint_time: float | None = None  # when the resumed checkpoint was committed
        if checkpoint is not None:
            self.restore(checkpoint)
        else:
            runlog.truncate_to_step(run_dir, 0)  # a --resume with no checkpoint starts over
        self.attempt = goodput.Attempt(run_dir, self.step, self.checkpoint_time)
        self.metrics = runlog.MetricsWriter(run_dir)
        self.validation = ValidationLog(cfg, self.receiver, self.metrics)
        self.timeline = Timeline(run_dir, topo.world_rank, "trainer")
        self.trained_log = runlog.JsonlWriter(run_dir / runlog.TRAINED)
        self.dropped_log = runlog.JsonlWriter(run_dir / runlog.DROPPED)
        self.pad_id = policy.model.config.pad_token_id or 0
        self.started_at = time.monotonic()

    # --- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        # A version names one weight set: weights restored from a checkpoint taken between
        # two syncs are not those broadcast as the checkpoint's version, so they go out anew.
        self.sync_weights(self.version + 1 if self.unsynced_steps else self.version)
        startup.mark("first weights sent")
        if self.validation.due(self.step, before_train=True):
            self.validation.request(self.step, self.version)
        self.started_at = time.monotonic()
        stopped_by = None
        while self.step < self.cfg.trainer.total_steps:
            stopped_by = stop_requested()
            if stopped_by:
                break
            groups = self.collect_batch()
            if groups is None:  # a stop signal came while the batch was being gathered
                stopped_by = stop_requested()
                break
            train_start = time.time()
            rewards = np.stack([self.trained_rewards(g) for g in groups])
            batch = collate(groups, self.advantages(groups, rewards), self.pad_id, rewards)
            shards = shard_rows(
                batch, self.topo.train_ranks, self.cfg.async_training.require_batches
            )
            self.send_shards(shards[1:], {"step": self.step + 1})
            stats = ppo_update(self.policy, to_tensors(shards[0], self.topo.device))
            if stats is None:  # a stop signal abandoned the update: its groups go back
                self.put_back()
                stopped_by = stop_requested()
                break
            self.step += 1
            self.record(groups, rewards, stats)
            self.timeline.record("train", train_start, time.time(), step=self.step)
            if self.step % self.cfg.sync_every == 0:
                self.sync_weights(self.version + 1)
            if self.validation.due(self.step):
                self.validation.request(self.step, self.version)
            if self.cfg.checkpoint.save_every and self.step % self.cfg.checkpoint.save_every == 0:
                self.checkpoint("periodic")
        latency = None
        if stopped_by:
            log.warning("%s received: checkpointing at step %d and stopping", stopped_by, self.step)
            try:
                self.checkpoint(f"signal {stopped_by}")
            except (CheckpointError, OSError) as exc:
                # The job still stops as preempted, so that it requeues and resumes from the
                # checkpoint before this one; the reason, in one line, in the job's log.
                protocol.warn(
                    f"the checkpoint at step {self.step} on {stopped_by} failed "
                    f"({' '.join(str(exc).split())}): the job resumes from the previous one"
                )
            latency = time.time() - (stop_requested_at() or time.time())
            log.warning("checkpoint/stop_latency_s %.2f (signal to durable checkpoint)", latency)
            marker = {"step": self.step, "signal": stopped_by, "time": time.time(),
                      "checkpoint/stop_latency_s": round(latency, 3)}  # fmt: skip
            (self.run_dir / PREEMPTED).write_text(json.dumps(marker) + "\n")
        elif self.cfg.checkpoint.save_final:
            self.checkpoint("final")
        self.shutdown()
        if self.cfg.checkpoint.save_hf_final and not stopped_by:
            self.export_final()
        self.attempt.end(
            self.step,
            f"signal {stopped_by}" if stopped_by else "finished",
            tokens_regenerated=sum(self.tokens_regenerated.values()),
            stop_latency_s=latency,
        )

    # --- the steps ----------------------------------------------------------------------
    def receive(self) -> None:
        """Take every group that has arrived into the queue."""
        for buf in self.receiver.poll():
            group = decode_group(buf)
            self.credits.received(group.rollout_rank)
            self.rollout_idle[group.rollout_rank] = (group.rollout_idle_s, group.rollout_elapsed_s)
            self.tokens_regenerated[group.rollout_rank] = group.tokens_regenerated
            self.sync_pause[group.rollout_rank] = group.rollout_sync_pause_s
            self.queue.push(buf)
        self.validation.poll()

    def grant(self) -> None:
        """New credits, each with the next prompt of the data order."""
        for rank, count in enumerate(self.credits.grant()):
            if count:
                draws = [self.order.take() for _ in range(count)]
                self.receiver.send_control(rank, Control.CREDIT, count, draws)

    def collect_batch(self) -> list[SampleGroup] | None:
        """The next ``required_groups`` groups within the staleness bound (and, with dynamic
        sampling, with a learning signal), oldest first; or None if a stop signal came
        first: every group taken goes back to the front of the queue (those it would have
        dropped included, to be judged again after a resume), so that the checkpoint holds
        them and nothing of the step is kept."""
        batch: list[SampleGroup] = []
        popped: list[np.ndarray] = []  # every group taken, encoded: put back on a stop
        kept: list[np.ndarray] = []  # the batch's groups, encoded
        rejected: list[tuple[SampleGroup, str]] = []  # dropped, recorded once the batch is whole
        waited_since, wall_start = time.monotonic(), time.time()
        self.step_filtered = self.step_flat_kept = 0
        refills = self.refills_per_step()

        def ready() -> bool:
            if stop_requested():
                return True
            self.receive()
            self.grant()
            while len(self.queue) and len(batch) < self.cfg.required_groups:
                buf = self.queue.pop()
                popped.append(buf)
                group = decode_group(buf)
                flat = not self.has_signal(group)
                # A drop leaves the credit count at once (it is no longer queued), so that
                # its refill can be granted; it is recorded once the batch is whole.
                if staleness_of(group, self.version) > self.cfg.async_training.max_staleness:
                    self.credits.consumed(trained=0, dropped=1)
                    rejected.append((group, "stale"))
                    # its budget comes back, so the batch refills: with in-flight weight
                    # updates groups granted after a sync may start under the old weights,
                    # and at max_staleness 0 their drops would otherwise use up the window
                    self.credits.refund(1)
                elif flat and self.step_filtered < refills:
                    self.credits.consumed(trained=0, dropped=1)
                    rejected.append((group, "filtered"))
                    self.credits.refund(1)  # granted again at once: the batch is refilled
                    self.step_filtered += 1
                else:
                    self.step_flat_kept += flat
                    batch.append(group)
                    kept.append(buf)
            return len(batch) == self.cfg.required_groups

        try:
            poll_until(ready, self.cfg.timeouts.sample_wait_s, "samples from the rollout ranks")
        except PeerTimeout as exc:
            filtered = (
                f"; {self.step_filtered} groups with equal rewards dropped by dynamic sampling "
                "(algorithm.filter_groups; max_num_gen_batches bounds them)"
                if self.step_filtered
                else ""
            )
            raise PeerTimeout(
                f"{exc} (step {self.step + 1}; have {len(batch)}/{self.cfg.required_groups} groups; "
                f"groups received per rollout rank: {self.receiver.received_from}{filtered})"
            ) from None
        if self.step_flat_kept:
            log.warning(
                "step %d: %d groups with equal rewards trained on, the step's %d refills "
                "(algorithm.filter_groups.max_num_gen_batches) being spent",
                self.step + 1,
                self.step_flat_kept,
                refills,
            )
        self.idle_s += time.monotonic() - waited_since
        self.timeline.record("wait", wall_start, time.time(), step=self.step + 1)
        if stop_requested():
            self.credits.queued += len(rejected)  # back in the queue, with the rest
            self.queue.push_front(popped)
            return None
        for group, reason in rejected:
            self.drop(group, reason, counted=True)
        self.credits.consumed(trained=len(batch), dropped=0)
        self.batch_encoded = kept
        return batch

    def put_back(self) -> None:
        """The last batch taken, whose update was abandoned, returns to the front of the
        queue as if never taken (its drops stay recorded: they were decided)."""
        self.queue.push_front(self.batch_encoded)
        # queued again, not trained
        self.credits.consumed(trained=-len(self.batch_encoded), dropped=0)

    def refills_per_step(self) -> float:
        """Groups dynamic sampling may drop (and have refilled) while collecting one step:
        0 when it is off; with max_num_gen_batches = m > 0, (m - 1) * required_groups, so
        that a step takes at most m batches' worth of generated groups (verl's count of
        generation batches). Differs from verl: past the bound verl raises; here the step
        trains on the zero-variance groups it gets (their GRPO advantage is 0) and warns."""
        fg = self.cfg.algorithm.filter_groups
        if not fg.enable:
            return 0
        if fg.max_num_gen_batches == 0:
            return math.inf
        return (fg.max_num_gen_batches - 1) * self.cfg.required_groups

    def trained_rewards(self, group: SampleGroup) -> np.ndarray:
        """(n,) the rewards trained on: the task's plus the overlong penalty, if enabled."""
        overlong = self.cfg.reward.overlong_buffer
        if not overlong.enable:
            return group.rewards
        penalty = algos.overlong_penalty(
            torch.from_numpy(np.asarray(group.response_lengths)),
            self.cfg.rollout.response_length,
            overlong.len,
            overlong.penalty_factor,
        )
        return (group.rewards + penalty.numpy()).astype(group.rewards.dtype)

    def has_signal(self, group: SampleGroup) -> bool:
        """False for a group dynamic sampling would drop: its metric is equal for all n
        (acc, score: the task's reward; seq_reward, seq_final_reward: with the overlong
        penalty, as verl's DAPO reward manager adds it to the sequence reward only)."""
        fg = self.cfg.algorithm.filter_groups
        if not fg.enable:
            return True
        metric = group.rewards if fg.metric in ("acc", "score") else self.trained_rewards(group)
        return bool(algos.has_reward_variance(torch.from_numpy(np.asarray(metric))[None])[0])

    def advantages(self, groups: list[SampleGroup], rewards: np.ndarray) -> np.ndarray:
        """(G, n) advantages over whole groups of ``rewards`` (G, n); zeros for GAE and
        REINFORCE++ (computed per token on each trainer rank)."""
        estimator = self.cfg.algorithm.adv_estimator
        scores = torch.from_numpy(rewards)
        if estimator in ("gae", "reinforce_plus_plus"):
            return np.zeros(scores.shape, dtype=np.float32)
        if estimator == "rloo":
            return algos.rloo_advantages(scores).numpy()
        if estimator == "reinforce_plus_plus_baseline":
            lengths = torch.from_numpy(np.stack([g.response_lengths for g in groups]))
            return algos.reinforce_pp_baseline_advantages(scores, lengths).numpy()
        norm = estimator == "grpo" and self.cfg.algorithm.norm_adv_by_std_in_grpo
        return algos.grpo_advantages(scores, norm_by_std=norm).numpy()

    def send_shards(self, shards: list[dict[str, np.ndarray]], meta: dict) -> None:
        """One message to each follower: its shard, or (empty) an order to stop, to checkpoint
        or to sync (the followers then take part in gathering the weights)."""
        requests = []
        for follower, shard in enumerate(shards, start=1):
            buf = pack_arrays(shard, {"stop": False, "checkpoint": False, "sync": False, **meta})
            requests.append(
                (self.topo.local.Isend([buf, MPI.BYTE], dest=follower, tag=TAG_SHARD), buf)
            )
        poll_until(
            lambda: all(r.Test() for r, _ in requests),
            self.cfg.timeouts.rank_wait_s,
            "trainer ranks to take their shards",
        )

    def sync_weights(self, version: int) -> None:
        """Broadcast the weights as ``version``, gathered from the shards one tensor at a time
        (the followers gather in step).

        With in-flight weight updates (after the first sync) the gathered tensors are handed
        to a side thread that broadcasts them while this rank trains on: it is blocked only
        for the gathering. Memory: one full copy of the weights in ``model.dtype`` on the
        sync device, until the broadcast completes (the next sync, a checkpoint or the end
        waits for it). Otherwise each tensor is packed into the next bucket while the last
        is on the wire. ``last_sync_s`` is the last completed broadcast's time, to its last
        bucket's completion."""
        start = time.time()
        self.finish_sync()  # one broadcast on the wire at a time
        broadcaster = self.weight_broadcaster()
        self.order_followers({"sync": True, "step": self.step})
        digest = runlog.WeightDigest() if self.cfg.trainer.record_weight_digests else None
        if self.inflight_updates and self.version_sent:
            named = list(self.policy.named_weights(owned=True))
            if digest is not None:
                for name, tensor in named:
                    digest.add(name, tensor)
            # announced only now that it is ready to go: a rollout rank pauses its engine
            # (vLLM) for the broadcast itself, not for the gathering
            self.receiver.broadcast_control(Control.SYNC, version)
            self.sending = broadcaster.broadcast_in_background(version, named)
        else:
            self.receiver.broadcast_control(Control.SYNC, version)
            self.last_sync_s = broadcaster.broadcast(
                version,
                self.policy.named_weights(),
                specs=self.policy.weight_specs(),
                on_tensor=digest.add if digest else None,
            )
        self.version_sent = True
        self.version, self.synced_step = version, self.step
        self.credits.synced()
        if digest is not None:
            runlog.record_weight_digest(
                self.run_dir, self.topo.world_rank, version, digest.hexdigest()
            )
        self.timeline.record("sync", start, time.time(), version=version)

    def weight_broadcaster(self) -> WeightBroadcaster:
        """The sender of the weight group, once the group has met (the first sync waits)."""
        if self.broadcaster is None:
            group = self.joining.result(self.cfg.timeouts.weight_sync_s + 30)
            device = self.topo.weights.bucket_device(self.topo.device)
            bucket_mb = self.cfg.trainer.weight_sync_bucket_mb
            self.broadcaster = WeightBroadcaster(group, 0, bucket_mb, device)
        return self.broadcaster

    def finish_sync(self) -> None:
        """Wait for a broadcast still on the wire (in-flight weight updates)."""
        if self.sending is not None:
            self.last_sync_s = float(self.sending.result(self.cfg.timeouts.weight_sync_s))
            self.sending = None

    def order_followers(self, meta: dict) -> None:
        self.send_shards([{}] * (self.topo.train_ranks - 1), meta)

    def drop(self, group: SampleGroup, reason: str, counted: bool = False) -> None:
        """Record a group as dropped (``counted``: its credit count already says so)."""
        if not counted:
            self.credits.consumed(trained=0, dropped=1)
        self.samples_dropped += group.n
        self.samples_filtered += group.n if reason == "filtered" else 0
        # Recorded under the step whose batch was being gathered, so that a resume from the
        # checkpoint of the step before drops (and records) it exactly once.
        rows = [self.sample_row(group, j, self.step + 1, reason=reason) for j in range(group.n)]
        self.dropped_log.write(rows)

    def sample_row(self, group: SampleGroup, j: int, step: int, **extra: object) -> dict:
        return {
            "uid": group.uid(j),
            "step": step,
            "param_version_start": group.param_version_start,
            "param_version_end": group.param_version_end,
            "staleness": staleness_of(group, self.version),
            "reward": float(group.rewards[j]),
            "rollout_rank": group.rollout_rank,
            **extra,
        }

    def elapsed_s(self) -> float:
        return self.elapsed_before_s + time.monotonic() - self.started_at

    def record(
        self, groups: list[SampleGroup], rewards: np.ndarray, stats: dict[str, float]
    ) -> None:
        """``rewards``: (G, n) what was trained on (the task's reward is in each row)."""
        rows = [self.sample_row(g, j, self.step) for g in groups for j in range(g.n)]
        self.trained_log.write(rows)
        self.samples_trained += len(rows)
        elapsed = self.elapsed_s()
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
                    "queue/spilled_groups": self.queue.spilled_count,
                    "time/elapsed_s": elapsed,
                    "throughput/samples_per_s": self.samples_trained / max(elapsed, 1e-9),
                    "trainer/idle_ratio": self.idle_s / max(elapsed, 1e-9),
                    "rollouter/idle_ratio": float(np.mean(rollout_idle)) if rollout_idle else 0.0,
                    "sync/time_s": self.last_sync_s,
                    "sync/pause_s": max(self.sync_pause.values(), default=0.0),
                    "memory/trainer_state_mb": self.policy.state_bytes() / 2**20,
                    "memory/trainer_peak_mb": peak_memory_mb(self.topo.device),
                    **self.recipe_metrics(groups, rewards),
                    **batch_metrics(groups, rewards, self.cfg.rollout.response_length),
                    **stats,
                }
            ]
        )

    def recipe_metrics(self, groups: list[SampleGroup], rewards: np.ndarray) -> dict:
        """Dynamic sampling's and the overlong penalty's numbers for this step, when on."""
        out: dict[str, float] = {}
        if self.cfg.algorithm.filter_groups.enable:
            out["filter_groups/filtered_groups"] = self.step_filtered
            out["filter_groups/zero_variance_kept"] = self.step_flat_kept
            out["samples/filtered"] = self.samples_filtered
        if self.cfg.reward.overlong_buffer.enable:
            task = np.stack([g.rewards for g in groups])
            out["reward/overlong_penalty_mean"] = float(np.mean(rewards - task))
            out["reward/overlong_fraction"] = float(np.mean(rewards < task))
            out["reward/trained_mean"] = float(np.mean(rewards))
        return out

    # --- checkpoints (the protocol: checkpoint/protocol.py) -------------------------------
    def saved_at_this_step(self) -> bool:
        return (protocol.step_dir(self.run_dir, self.step) / protocol.MANIFEST).exists()

    def checkpoint(self, reason: str) -> None:
        """Every rank writes its own part of the checkpoint in parallel; the leader drains the
        groups the rollout ranks sent before theirs, writes the queue and commits.

        Rollout ranks cut the groups they are generating and write them with their tokens so
        far (they continue afterwards, or after a resume). A step already saved is not saved
        again (a stop right after a periodic checkpoint): what was generated since is
        generated again after a resume, its prompts being handed out anew."""
        if self.saved_at_this_step():
            return
        start = time.time()
        folder = protocol.step_dir(self.run_dir, self.step)
        shutil.rmtree(folder, ignore_errors=True)  # parts of an attempt killed before its commit
        self.receiver.broadcast_control(Control.CHECKPOINT, self.step)
        self.order_followers({"checkpoint": True, "step": self.step})
        try:
            # every rank's report first, so that none waits on a leader that gave up
            reports = self.gather_rollout_parts()
            own = protocol.write_own_part(
                folder, protocol.trainer_part(0), trainer_tree(self.policy)
            )
            reports.append(("trainer rank 0", own))
            reports += self.gather_follower_parts()
            parts = [protocol.part_of_report(report, who) for who, report in reports]
            leader = {
                "queue": self.queue.snapshot(),
                "order": self.order.state_dict(),
                # per rollout rank: groups cut and kept in its part, continued after resume
                "partial_groups": np.asarray(self.partial_groups, dtype=np.int64),
            }
            parts.append(protocol.write_part(folder, protocol.LEADER_PART, leader))
            protocol.commit(folder, parts, self.checkpoint_meta(reason))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # never half a checkpoint on disk
            raise
        protocol.prune(self.run_dir, self.cfg.checkpoint.keep)
        log.info("checkpoint at step %d (%s) in %.2fs", self.step, reason, time.time() - start)
        self.timeline.record("checkpoint", start, time.time(), step=self.step)

    def checkpoint_meta(self, reason: str) -> dict:
        return {
            "step": self.step,
            "param_version": self.version,
            "synced_step": self.synced_step,
            "samples_trained": self.samples_trained,
            "samples_dropped": self.samples_dropped,
            "samples_filtered": self.samples_filtered,
            "groups_trained": self.credits.trained,
            "elapsed_s": self.elapsed_s(),
            "idle_s": self.idle_s,
            "rollout_ranks": self.topo.rollout_ranks,
            "train_ranks": self.topo.train_ranks,
            "reason": reason,
            "time": time.time(),
        }

    def gather_rollout_parts(self) -> list[tuple[str, dict]]:
        """Every rollout rank's part record, once every group it sent before it is in the
        queue. Their unused credits are void afterwards (granted anew by the next collect),
        and the prompts they were for go back to the data order, to go out first."""
        reports: dict[int, dict] = {}
        unused: list[int] = []

        def ready() -> bool:
            self.receive()
            for rank, buf in self.receiver.poll_states().items():
                arrays, reports[rank] = unpack_arrays(buf)
                unused.extend(int(d) for d in arrays["unused"])
                self.partial_groups[rank] = int(reports[rank]["partial_groups"])
            return len(reports) == self.topo.rollout_ranks and all(
                self.receiver.received_from[r] == report["groups_sent"]
                for r, report in reports.items()
            )

        poll_until(ready, self.cfg.timeouts.rank_wait_s, "rollout ranks' checkpoint parts")
        self.credits.revoke_unused(kept=self.partial_groups)
        self.order.give_back(unused)
        return [(f"rollout rank {r}", reports[r]) for r in sorted(reports)]

    def gather_follower_parts(self) -> list[tuple[str, dict]]:
        parts = []
        for follower in range(1, self.topo.train_ranks):
            status = MPI.Status()
            poll_until(
                lambda f=follower, st=status: self.topo.local.Iprobe(
                    source=f, tag=TAG_FOLLOWER_STATE, status=st
                ),
                self.cfg.timeouts.rank_wait_s,
                f"trainer rank {follower}'s checkpoint part",
            )
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            self.topo.local.Recv([buf, MPI.BYTE], source=follower, tag=TAG_FOLLOWER_STATE)
            parts.append((f"trainer rank {follower}", unpack_arrays(buf)[1]))
        return parts

    def restore(self, folder: Path) -> None:
        meta = restore_trainer_part(folder, self.policy, 0, self.topo.train_ranks)
        with CheckpointReader(folder / protocol.LEADER_PART) as reader:
            self.queue.extend(reader.get("queue") or [])
            if "order" not in reader.keys():
                raise CheckpointError(
                    f"checkpoint {folder} has no data order (written before the trainer leader "
                    "owned it): start a new run"
                )
            self.order.load_state_dict(reader.get("order"))
            # The cut groups of old rank o are continued by rank o % R (run_rollouter).
            kept = [0] * self.topo.rollout_ranks
            for old, count in enumerate(reader.get("partial_groups").tolist()):
                kept[old % self.topo.rollout_ranks] += count
        self.step, self.version = meta["step"], meta["param_version"]
        self.checkpoint_time = meta.get("time", (folder / protocol.MANIFEST).stat().st_mtime)
        self.unsynced_steps = meta.get("synced_step", -1) != self.step
        self.samples_trained, self.samples_dropped = (
            meta["samples_trained"],
            meta["samples_dropped"],
        )
        self.samples_filtered = meta.get("samples_filtered", 0)  # absent before the recipes
        self.elapsed_before_s, self.idle_s = meta["elapsed_s"], meta["idle_s"]
        self.credits.resume(trained=meta["groups_trained"], queued=len(self.queue), in_flight=kept)
        self.partial_groups = kept
        # Steps after the checkpoint are trained again: forget what the killed run logged of them.
        runlog.truncate_to_step(self.run_dir, self.step)
        (self.run_dir / PREEMPTED).unlink(missing_ok=True)
        log.info(
            "resumed from %s: step %d, version %d, %d queued groups",
            folder,
            self.step,
            self.version,
            len(self.queue),
        )

    def export_final(self) -> None:
        """checkpoint.save_hf_final: the final checkpoint as a Hugging Face folder, in place
        of an earlier attempt's; after shutdown, so that no other rank waits for it."""
        from hpc_asyncppo.export import HF_FINAL, export_checkpoint

        start = time.time()
        out = self.run_dir / HF_FINAL
        shutil.rmtree(out, ignore_errors=True)
        export_checkpoint(self.run_dir, out, step=self.step)
        log.info("exported step %d to %s in %.2fs", self.step, out, time.time() - start)

    def shutdown(self) -> None:
        """Stop the rollout ranks, drain what they still send (recorded as dropped), stop followers."""
        self.finish_sync()
        self.receiver.broadcast_control(Control.STOP)
        self.send_shards([{}] * (self.topo.train_ranks - 1), {"stop": True, "step": self.step})

        def drained() -> bool:
            self.receive()
            # after a stop signal the rollout ranks abandon their validations
            validated = self.validation.settled() or stop_requested() is not None
            return self.receiver.all_done() and validated

        poll_until(drained, self.cfg.timeouts.rank_wait_s, "rollout ranks to finish after STOP")
        if not self.validation.settled():
            log.warning(
                "stopped: the validations of steps %s are not logged",
                sorted(self.validation.waiting),
            )
        while len(self.queue):
            self.drop(decode_group(self.queue.pop()), "run_ended")
        self.queue.close()
        self.receiver.flush(self.cfg.timeouts.rank_wait_s)
        for writer in (self.metrics, self.trained_log, self.dropped_log, self.timeline):
            writer.close()


def batch_metrics(groups: list[SampleGroup], rewards: np.ndarray, max_length: int) -> dict:
    """What the step trained on: the share of groups whose trained rewards (G, n) are all
    equal (no GRPO signal), and the responses' mean length and share cut at max_length."""
    lengths = np.concatenate([g.response_lengths for g in groups]).astype(np.float64)
    return {
        "batch/zero_variance_groups": float(np.mean(np.ptp(rewards, axis=1) == 0)),
        "response_length/mean": float(lengths.mean()),
        "response_length/clip_ratio": float(np.mean(lengths >= max_length)),
    }


def run_follower(
    cfg: Config, topo: Topology, run_dir: Path, policy: Policy, timeline: Timeline
) -> None:
    """A non-leader trainer rank: train on each shard the leader sends until told to stop."""
    # The leader may wait for samples, a sync and a checkpoint between two shards.
    timeout = cfg.timeouts.sample_wait_s + cfg.timeouts.weight_sync_s + 2 * cfg.timeouts.rank_wait_s
    status = MPI.Status()
    while True:
        wait_start = time.time()
        poll_until(
            lambda: topo.local.Iprobe(source=0, tag=TAG_SHARD, status=status),
            timeout,
            "a shard from the trainer leader",
        )
        buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        topo.local.Recv([buf, MPI.BYTE], source=0, tag=TAG_SHARD)
        shard, meta = unpack_arrays(buf)
        timeline.record("wait", wait_start, time.time(), step=meta["step"])
        if meta["stop"]:
            timeline.close()
            return
        if meta["sync"]:  # the leader broadcasts; this rank gives its shards of each tensor
            for _ in policy.named_weights():
                pass
            continue
        if meta["checkpoint"]:
            folder = protocol.step_dir(run_dir, meta["step"])
            name = protocol.trainer_part(topo.local_rank)
            written = protocol.write_own_part(folder, name, trainer_tree(policy))
            report = pack_arrays({}, written)
            req = topo.local.Isend([report, MPI.BYTE], dest=0, tag=TAG_FOLLOWER_STATE)
            poll_until(req.Test, cfg.timeouts.rank_wait_s, "the trainer leader to take the part")
            continue
        train_start = time.time()
        if ppo_update(policy, to_tensors(shard, topo.device)) is None:
            continue  # abandoned by a stop signal, as on the leader: a checkpoint order follows
        timeline.record("train", train_start, time.time(), step=meta["step"])


def trainer_tree(policy: Policy) -> dict:
    """A trainer rank's part: its shards of the model and optimizer, and its RNGs."""
    return {**policy.shard_tree(), "rng": rng_state()}


def write_trainer_part(folder: Path, policy: Policy, rank: int) -> protocol.PartInfo:
    """Trainer rank ``rank``'s part, written (a CheckpointError or OSError if it cannot be)."""
    return protocol.write_part(folder, protocol.trainer_part(rank), trainer_tree(policy))


def restore_trainer_part(folder: Path, policy: Policy, rank: int, ranks: int) -> dict:
    """Load this rank's rows from the parts that hold them, and its RNGs when the
    checkpoint had a part of its number; returns the checkpoint's manifest."""
    manifest = protocol.read_manifest(folder)
    old = protocol.overlapping_parts(rank, ranks, manifest["train_ranks"])
    with protocol.ShardedReader(folder, manifest, old) as reader:
        policy.load_state(reader, str(folder))
    if rank < manifest["train_ranks"]:  # absent when resuming with more trainer ranks
        with CheckpointReader(folder / protocol.trainer_part(rank)) as reader:
            set_rng_state(reader.get("rng"))
    return manifest


def run_trainer(cfg: Config, topo: Topology, run_dir: Path, checkpoint: Path | None = None) -> None:
    """``checkpoint``: the checkpoint folder to resume from, or None for a fresh start."""
    torch.set_num_threads(cfg.actor.torch_threads)
    torch.manual_seed(cfg.trainer.seed)
    policy = Policy(cfg, topo.device, topo.trainer_group)
    startup.mark("policy built")
    if topo.is_leader:
        leader = TrainerLeader(cfg, topo, run_dir, policy, checkpoint)
        startup.mark("ready for the first sync")
        try:
            leader.run()
        except BaseException:
            leader.attempt.end(leader.step, "failed")
            raise
        return
    if checkpoint is not None:
        restore_trainer_part(checkpoint, policy, topo.local_rank, topo.train_ranks)
    run_follower(cfg, topo, run_dir, policy, Timeline(run_dir, topo.world_rank, "trainer"))
