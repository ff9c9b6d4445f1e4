"""The trainer leader's loop (the first trainer rank; the others: ``followers.py``).

Top to bottom: broadcast the weights (version 0, or the checkpoint's version on resume);
then for each step take a batch from the intake (``intake.py``: fresh groups within the
staleness bound, dynamic sampling's drops refilled, credits granted while it waits), run
the PPO update with every trainer rank on its shard (advantages over whole groups from
``advantages.py``), log it (``steplog.py``), every ``sync_every`` steps broadcast the
weights as a new version, every ``trainer.test_freq`` steps ask the rollout ranks to
validate them, and every ``checkpoint.save_every`` steps checkpoint
(``checkpoint/protocol.py``). A stop signal (Slurm's warning signal, SIGTERM, the
launcher's forwarded Ctrl-C) ends the loop with a checkpoint at once: a batch being
gathered, or one whose update has not reached its optimizer step (``ppo_update`` abandons
it), goes back to the front of the queue.

The leader's state is in objects that checkpoint themselves: the intake, the counters
(``progress.py``), the policy's shards; the checkpoint collects them (``checkpoint``).
The weight group and its broadcasts are the sender's (``sync.py``): a rollout rank whose
engine restarted gets the weights again there, the same version when they have not moved
since (``send_lost_weights``).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from hpc_asyncppo import goodput, runlog
from hpc_asyncppo.checkpoint import protocol
from hpc_asyncppo.checkpoint.state import Stateful
from hpc_asyncppo.checkpoint.store import (
    CheckpointError,
)
from hpc_asyncppo.config import Config
from hpc_asyncppo.paths import HF_FINAL, OVERFLOW, PREEMPTED
from hpc_asyncppo.runtime import faults, heartbeat, startup
from hpc_asyncppo.runtime.signals import stop_requested, stop_requested_at
from hpc_asyncppo.runtime.topology import Topology
from hpc_asyncppo.tasks import load_task
from hpc_asyncppo.tasks.overlong import usable_prompts
from hpc_asyncppo.timeline import Timeline
from hpc_asyncppo.trainer import advantages
from hpc_asyncppo.trainer.batch import collate, shard_rows, to_tensors
from hpc_asyncppo.trainer.collapse import CollapseError
from hpc_asyncppo.trainer.followers import Followers, Order, run_follower
from hpc_asyncppo.trainer.intake import Batch, Intake
from hpc_asyncppo.trainer.policy import Policy, peak_memory_mb, ppo_update, trainer_states
from hpc_asyncppo.trainer.progress import Progress
from hpc_asyncppo.trainer.queue import SpillQueue
from hpc_asyncppo.trainer.steplog import StepLog
from hpc_asyncppo.trainer.sync import WeightSender
from hpc_asyncppo.trainer.validation import ValidationLog
from hpc_asyncppo.transport.samples import Control, SampleReceiver
from hpc_asyncppo.transport.waits import poll_until

log = logging.getLogger(__name__)


class TrainerLeader:
    """The first trainer rank: the loop, and the objects that own its state.

    ``intake`` (the queue, credits, data order: ``trainer/intake.py``), ``progress`` (the
    counters: ``trainer/progress.py``), the policy (its shard of the model and optimizer),
    the followers' channel (``trainer/followers.py``) and the weight group's sender
    (``trainer/sync.py``). Memory beyond the policy's shard: the queue's in-memory part
    (``buffer.memory_limit_mb``), one batch, and during a sync one bucket (a full copy of
    the weights in ``model.dtype`` with in-flight weight updates, until its broadcast
    completes)."""

    def __init__(
        self, cfg: Config, topo: Topology, run_dir: Path, policy: Policy, checkpoint: Path | None
    ):
        self.cfg, self.topo, self.run_dir, self.policy = cfg, topo, run_dir, policy
        self.receiver = SampleReceiver(topo.inter)
        self.followers = Followers(topo.local, cfg.timeouts.rank_wait_s)
        # joins the weight group at once, on a side thread (its first sync waits for it)
        self.sender = WeightSender(
            cfg, topo, run_dir, policy, self.receiver, self.followers,
            receive=lambda: self.intake.receive(),
        )  # fmt: skip
        self.progress = Progress()
        num_prompts = len(usable_prompts(load_task(cfg.data).prompts(), run_dir))
        self.intake = Intake(
            cfg,
            self.receiver,
            # encoded groups, oldest first; past buffer.memory_limit_mb they wait on disk
            SpillQueue(run_dir / OVERFLOW, cfg.buffer.memory_limit_mb),
            num_prompts,
            topo.rollout_ranks,
            on_group=lambda group: self.steplog.note_rollout(group),
        )
        self.checkpoint_time: float | None = None  # when the resumed checkpoint was committed
        if checkpoint is not None:
            self.restore(checkpoint)
        else:
            runlog.truncate_to_step(run_dir, 0)  # a --resume with no checkpoint starts over
        self.attempt = goodput.Attempt(run_dir, self.progress.step, self.checkpoint_time)
        # the logs open once a resume has cut them back to the checkpoint's step
        self.steplog = StepLog(cfg, run_dir, self.progress)
        self.validation = ValidationLog(cfg, self.receiver, self.steplog.metrics)
        self.timeline = Timeline(run_dir, topo.world_rank, "trainer")
        self.pad_id = policy.model.config.pad_token_id or 0

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def version(self) -> int:
        return self.progress.version

    # --- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        # A version names one weight set: weights restored from a checkpoint taken between
        # two syncs are not those broadcast as the checkpoint's version, so they go out anew.
        self.sync_weights(self.version + 1 if self.progress.unsynced else self.version)
        startup.mark("first weights sent")
        if self.validation.due(self.step, before_train=True):
            self.validation.request(self.step, self.version)
        self.progress.start()
        stopped_by = None
        while self.step < self.cfg.trainer.total_steps:
            stopped_by = stop_requested()
            if stopped_by:
                break
            self.send_lost_weights()
            batch = self.take_batch()
            if batch is None:  # a stop signal came while the batch was being gathered
                stopped_by = stop_requested()
                break
            stats = self.train(batch)
            if stats is None:  # a stop signal abandoned the update: its groups go back
                self.intake.put_back()
                stopped_by = stop_requested()
                break
            if self.step % self.cfg.sync_every == 0:
                self.sync_weights(self.version + 1)
            if self.validation.due(self.step):
                self.validation.request(self.step, self.version)
            if self.cfg.checkpoint.save_every and self.step % self.cfg.checkpoint.save_every == 0:
                self.checkpoint("periodic")
        latency = self.stop_with_checkpoint(stopped_by) if stopped_by else None
        if not stopped_by and self.cfg.checkpoint.save_final:
            self.checkpoint("final")
        self.shutdown()
        if self.cfg.checkpoint.save_hf_final and not stopped_by:
            self.export_final()
        restarts = self.steplog.engine_restarts.values()
        self.attempt.end(
            self.step,
            f"signal {stopped_by}" if stopped_by else "finished",
            tokens_regenerated=sum(self.steplog.tokens_regenerated.values()),
            stop_latency_s=latency,
            engine_restarts=sum(n for n, _ in restarts),
            engine_restart_s=sum(t for _, t in restarts),
        )

    # --- the steps ----------------------------------------------------------------------
    def take_batch(self) -> Batch | None:
        """The next step's groups (``Intake.take``), its drops recorded; None on a stop."""
        waited_since, wall_start = self.progress.clock(), time.time()
        heartbeat.doing(f"waiting for samples for step {self.step + 1}")
        batch = self.intake.take(
            lambda: self.version,  # a tick may send weights (send_lost_weights)
            stop_requested,
            self.cfg.timeouts.sample_wait_s,
            self.step + 1,
            tick=self.between_polls,
        )
        self.progress.add_wait(waited_since)
        self.timeline.record("wait", wall_start, time.time(), step=self.step + 1)
        if batch is not None:
            for group, reason in batch.dropped:
                self.steplog.dropped(group, reason)
        return batch

    def train(self, batch: Batch) -> dict[str, float] | None:
        """One PPO update on ``batch``, every trainer rank on its shard; logged. None if a
        stop signal abandoned it before its optimizer step."""
        faults.at("step", self.step + 1)  # a drill's named moment (none in a real run)
        train_start = time.time()
        heartbeat.doing(f"training step {self.step + 1} (with the other trainer ranks)")
        groups = batch.groups
        rewards = np.stack([advantages.trained_rewards(self.cfg, g) for g in groups])
        minis = self.cfg.async_training.require_batches
        data = collate(groups, advantages.group_advantages(self.cfg, groups, rewards),
                       self.pad_id, rewards, multiple=minis * self.topo.train_ranks)  # fmt: skip
        shards = shard_rows(data, self.topo.train_ranks, minis)
        self.followers.train(shards[1:], self.step + 1)
        stats = ppo_update(self.policy, to_tensors(shards[0], self.topo.device))
        if stats is None:
            return None
        self.progress.step += 1
        tokens = (
            data["prompt_mask"].sum() + data.get("response_attention", data["response_mask"]).sum()
        )
        leader = {
            # the update's wall time (collate to optimizer step, every rank) and the real
            # tokens it trained on (prompts and responses, padding not counted)
            "time/train_s": time.time() - train_start,
            "tokens/trained": int(tokens),
            # the update's phases on the leader (policy.PhaseClock)
            **{f"time/{phase}_s": s for phase, s in self.policy.phase_seconds.items()},
            "queue/groups": len(self.intake),
            "queue/spilled_groups": self.intake.queue.spilled_count,
            "sync/time_s": self.sender.last_sync_s,
            "sync/bytes": self.sender.sync_bytes,
            "memory/trainer_state_mb": self.policy.state_bytes() / 2**20,
            "memory/trainer_peak_mb": peak_memory_mb(self.topo.device),
        }
        collapsed = self.steplog.trained(batch, rewards, stats, leader)
        if collapsed:
            log.warning("%s", collapsed)
            if self.cfg.trainer.stop_on_collapse:  # not restarted: launch/job_restarts.py
                raise CollapseError(f"{collapsed} (trainer.stop_on_collapse=true)")
        self.timeline.record(
            "train", train_start, time.time(), step=self.step, phases=self.policy.phase_seconds
        )
        return stats

    def between_polls(self) -> None:
        """While the leader waits for samples: validation results, and weights for a rank
        whose engine restarted (with one rollout rank, no sample comes before them)."""
        self.validation.poll()
        if self.sender.lost:
            self.send_lost_weights()
            heartbeat.doing(f"waiting for samples for step {self.step + 1}")

    def sync_weights(self, version: int, again: bool = False) -> None:
        """Broadcast the weights as ``version`` (``WeightSender.send``) and count it as the
        synced version; ``again``: the weights of ``version`` once more (a rank's engine
        restarted), the counters untouched."""
        heartbeat.doing(f"sending the weights as version {version}")
        start = time.time()
        self.sender.send(version, self.step)
        if not again:
            self.progress.version, self.progress.synced_step = version, self.step
            self.intake.synced()
        self.timeline.record("sync", start, time.time(), version=version)

    def send_lost_weights(self) -> None:
        """A rank's engine restarted (REJOIN) or a regroup followed a broken broadcast: the
        weights go out again, the same version unless they moved since."""
        if not self.sender.lost:
            return
        if self.progress.unsynced:
            self.sync_weights(self.version + 1)
        else:
            self.sync_weights(self.version, again=True)

    # --- checkpoints (the protocol: checkpoint/protocol.py) -------------------------------
    def checkpoint(self, reason: str) -> None:
        """Every rank writes its own part of the checkpoint in parallel; the leader drains the
        groups the rollout ranks sent before theirs, writes its own state and commits.

        Rollout ranks cut the groups they are generating and write them with their tokens so
        far (they continue afterwards, or after a resume). A step already saved is not saved
        again (a stop right after a periodic checkpoint): what was generated since is
        generated again after a resume, its prompts being handed out anew."""
        heartbeat.doing(f"checkpointing step {self.step} ({reason})")
        folder = protocol.step_dir(self.run_dir, self.step)
        if (folder / protocol.MANIFEST).exists():
            return
        start = time.time()
        # The counters as the step left them: a resume carries on its elapsed and waiting
        # time from here, as the timeline's "checkpoint" span (from ``start``) says, not
        # from the end of the parts' writing, which a resume does not keep.
        counters = protocol.tree_of(self.manifest_states())
        shutil.rmtree(folder, ignore_errors=True)  # parts of an attempt killed before its commit
        self.receiver.broadcast_control(Control.CHECKPOINT, self.step)
        self.followers.order(Order.CHECKPOINT, self.step)
        try:
            # every rank's report first, so that none waits on a leader that gave up
            reports = self.intake.collect_parts(self.cfg.timeouts.rank_wait_s, self.validation.poll)
            own = protocol.write_own_part(
                folder, protocol.trainer_part(0), protocol.tree_of(trainer_states(self.policy))
            )
            reports.append(("trainer rank 0", own))
            reports += self.followers.collect_parts()
            parts = [protocol.part_of_report(report, who) for who, report in reports]
            leader = protocol.write_part(
                folder, protocol.LEADER_PART, protocol.tree_of(self.leader_states())
            )
            parts.append(leader)
            meta = {
                **counters,
                "rollout_ranks": self.topo.rollout_ranks,
                "train_ranks": self.topo.train_ranks,
                "states": protocol.states_held(self.topo.train_ranks, self.topo.rollout_ranks),
                "reason": reason,
                "time": time.time(),
            }
            protocol.commit(folder, parts, meta)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # never half a checkpoint on disk
            raise
        protocol.prune(self.run_dir, self.cfg.checkpoint.keep)
        log.info("checkpoint at step %d (%s) in %.2fs", self.step, reason, time.time() - start)
        self.timeline.record("checkpoint", start, time.time(), step=self.step)

    def stop_with_checkpoint(self, stopped_by: str) -> float:
        """A stop signal: checkpoint now and mark the run preempted; the signal's latency to
        a durable checkpoint."""
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
        return latency

    def manifest_states(self) -> dict[str, Stateful]:
        """The leader's states the manifest holds: the counters, the groups trained."""
        return {"progress": self.progress, "credits": self.intake.credits}

    def leader_states(self) -> dict[str, Stateful]:
        """The leader's states ``leader.h5`` holds: the intake (queue, data order, cut
        groups per rank)."""
        return {"intake": self.intake}

    def restore(self, folder: Path) -> None:
        states = trainer_states(self.policy)
        meta = protocol.restore_trainer_part(folder, states, 0, self.topo.train_ranks)
        protocol.load_part(folder / protocol.LEADER_PART, self.leader_states())
        protocol.load_states(meta, self.manifest_states(), str(folder / protocol.MANIFEST))
        self.checkpoint_time = meta.get("time", (folder / protocol.MANIFEST).stat().st_mtime)
        # Steps after the checkpoint are trained again: forget what the killed run logged of them.
        runlog.truncate_to_step(self.run_dir, self.step)
        (self.run_dir / PREEMPTED).unlink(missing_ok=True)
        log.info(
            "resumed from %s: step %d, version %d, %d queued groups",
            folder,
            self.step,
            self.version,
            len(self.intake),
        )

    # --- the end ------------------------------------------------------------------------
    def export_final(self) -> None:
        """checkpoint.save_hf_final: the final checkpoint as a Hugging Face folder, in place
        of an earlier attempt's; after shutdown, so that no other rank waits for it."""
        from hpc_asyncppo.export import export_checkpoint

        start = time.time()
        out = self.run_dir / HF_FINAL
        shutil.rmtree(out, ignore_errors=True)
        export_checkpoint(self.run_dir, out, step=self.step)
        log.info("exported step %d to %s in %.2fs", self.step, out, time.time() - start)

    def shutdown(self) -> None:
        """Stop the rollout ranks, drain what they still send (recorded as dropped), stop
        followers. A rank whose engine restarted during the last sync gets those weights
        again first: a validation of the last step waits for them (none would for weights
        trained past them, and the checkpoint has the version they would be sent as)."""
        self.sender.finish()
        if stop_requested() is None and not self.progress.unsynced:
            self.intake.receive()  # a REJOIN of that sync
            self.send_lost_weights()
            self.sender.finish()
        self.receiver.broadcast_control(Control.STOP)
        self.followers.order(Order.STOP, self.step)

        def drained() -> bool:
            self.intake.receive()
            self.validation.poll()
            # after a stop signal the rollout ranks abandon their validations
            validated = self.validation.settled() or stop_requested() is not None
            return self.receiver.all_done() and validated

        poll_until(drained, self.cfg.timeouts.rank_wait_s, "rollout ranks to finish after STOP")
        if not self.validation.settled():
            log.warning(
                "stopped: the validations of steps %s are not logged",
                sorted(self.validation.waiting),
            )
        for group in self.intake.drain():
            self.steplog.dropped(group, "run_ended")
        self.intake.queue.close()
        self.receiver.flush(self.cfg.timeouts.rank_wait_s)
        self.steplog.close()
        self.timeline.close()


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
        states = trainer_states(policy)
        protocol.restore_trainer_part(checkpoint, states, topo.local_rank, topo.train_ranks)
    run_follower(cfg, topo, run_dir, policy, Timeline(run_dir, topo.world_rank, "trainer"))
