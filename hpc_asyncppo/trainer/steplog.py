"""What the trainer leader logs: one line per sample trained or dropped, one metrics row per
step.

``StepLog`` owns the writers (``metrics.jsonl``, TensorBoard and the experiment trackers of
``trainer.logger`` (``trackers.py``), ``trained_samples.jsonl``,
``dropped_samples.jsonl``) and what the rollout ranks last said of themselves: each group
carries its sender's idle time, regenerated tokens, last sync pause and engine restarts, read as it
arrives (``note_rollout``). The sample counts it keeps are the leader's ``Progress``,
which checkpoints them. Each step's row also goes through the run's collapse watch
(``collapse.py``), which names a sign of a run going wrong in it. Memory: a few numbers per
rollout rank, and the watch's window of a few metrics.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpc_asyncppo import runlog
from hpc_asyncppo.config import Config
from hpc_asyncppo.loss_mask import observation_spans
from hpc_asyncppo.paths import DROPPED, METRICS, TRAINED
from hpc_asyncppo.trainer.collapse import CollapseWatch
from hpc_asyncppo.trainer.intake import Batch, staleness_of
from hpc_asyncppo.trainer.progress import Progress
from hpc_asyncppo.trainer.trackers import Trackers
from hpc_asyncppo.transport.samples import SampleGroup


class StepLog:
    def __init__(self, cfg: Config, run_dir: Path, progress: Progress):
        self.cfg, self.progress = cfg, progress
        self.trackers = Trackers(cfg, run_dir, progress.step)  # W&B, MLflow if asked for
        tensorboard = "tensorboard" in cfg.trainer.logger
        self.metrics = runlog.MetricsWriter(run_dir, tensorboard, (self.trackers,))
        self.trained_log = runlog.JsonlWriter(run_dir / TRAINED)
        self.dropped_log = runlog.JsonlWriter(run_dir / DROPPED)
        self.rollout_idle: dict[int, tuple[float, float]] = {}  # (idle, elapsed) per rank
        self.tokens_regenerated: dict[int, int] = {}  # per rank, cumulative
        self.sync_pause: dict[int, float] = {}  # per rank, its engine's last pause
        self.engine_restarts: dict[int, tuple[int, float]] = {}  # per rank: count, seconds
        self.tools: dict[int, dict[str, float]] = {}  # multi-turn, per rank: its tool counts
        self.collapse = CollapseWatch(cfg.trainer)  # goes on from the steps logged before
        if self.collapse.window > 0:
            self.collapse.history(runlog.split_metrics(runlog.read_jsonl(run_dir / METRICS))[0])

    def note_rollout(self, group: SampleGroup) -> None:
        """A group arrived: what its rollout rank says of itself."""
        rank = group.rollout_rank
        self.rollout_idle[rank] = (group.rollout_idle_s, group.rollout_elapsed_s)
        self.tokens_regenerated[rank] = group.tokens_regenerated
        self.sync_pause[rank] = group.rollout_sync_pause_s
        self.engine_restarts[rank] = (group.engine_restarts, group.engine_restart_s)
        if self.cfg.rollout.multi_turn.enable:
            self.tools[rank] = {
                key: getattr(group, key)
                for key in ("tool_calls", "tool_errors", "tool_timeouts", "tool_s")
                + ("tool_wait_s", "trajectory_s")
            }

    def dropped(self, group: SampleGroup, reason: str) -> None:
        """A group dropped while the next step's batch was gathered, recorded under that
        step: a resume from the checkpoint of the step before drops (and records) it once."""
        self.progress.samples_dropped += group.rows
        self.progress.samples_filtered += group.rows if reason == "filtered" else 0
        step = self.progress.step + 1
        self.dropped_log.write(
            [self.sample_row(group, j, step, reason=reason) for j in range(group.rows)]
        )

    def sample_row(self, group: SampleGroup, j: int, step: int, **extra: object) -> dict:
        """The record of row ``j`` (a response; an agent's session in several sequences:
        one of them, with its session's reward)."""
        if group.loss_mask is not None:  # multi-turn: the response's tokens not trained on
            length = int(group.response_lengths[j])
            extra["observation_tokens"] = length - int(group.loss_mask[j, :length].sum())
        return {
            "uid": group.uid(j),
            "step": step,
            "param_version_start": group.param_version_start,
            "param_version_end": group.param_version_end,
            "staleness": staleness_of(group, self.progress.version),
            "reward": float(group.rewards[group.sessions()[j]]),
            "rollout_rank": group.rollout_rank,
            **extra,
        }

    def trained(
        self, batch: Batch, rewards: np.ndarray, stats: dict[str, float], leader: dict[str, float]
    ) -> str | None:
        """The step just trained on ``batch``: its samples, and its metrics row with the
        update's ``stats`` and the ``leader``'s own numbers (queue, sync, memory).
        ``rewards``: (G, n) what was trained on (the task's reward is in each group).
        The line of a collapse sign this step first showed, else None."""
        progress = self.progress
        rows = [self.sample_row(g, j, progress.step) for g in batch.groups for j in range(g.rows)]
        self.trained_log.write(rows)
        progress.samples_trained += len(rows)
        elapsed = progress.elapsed_s()
        staleness = [r["staleness"] for r in rows]
        rollout_idle = [idle / max(total, 1e-9) for idle, total in self.rollout_idle.values()]
        row = {
            "step": progress.step,
            "param_version": progress.version,
            "reward/mean": float(np.mean([r["reward"] for r in rows])),
            "staleness/mean": float(np.mean(staleness)),
            "staleness/max": int(max(staleness)),
            "samples/total": progress.samples_trained,
            "samples/dropped": progress.samples_dropped,
            "time/elapsed_s": elapsed,
            "throughput/samples_per_s": progress.samples_trained / max(elapsed, 1e-9),
            "trainer/idle_ratio": progress.idle_s / max(elapsed, 1e-9),
            "rollouter/idle_ratio": float(np.mean(rollout_idle)) if rollout_idle else 0.0,
            "sync/pause_s": max(self.sync_pause.values(), default=0.0),
            # engines restarted inside their rollout ranks in this attempt, and the time
            # each rank's restarts took (from the death to the weights loaded again)
            "rollout/engine_restarts": sum(n for n, _ in self.engine_restarts.values()),
            "rollout/engine_restart_s": sum(t for _, t in self.engine_restarts.values()),
            **leader,
            **self.recipe_metrics(batch, rewards),
            **self.tool_metrics(batch),
            **batch_metrics(batch.groups, rewards, self.cfg.rollout.response_length),
            **stats,
        }
        line = self.collapse.observe(row)
        self.metrics.write([row])
        return line

    def recipe_metrics(self, batch: Batch, rewards: np.ndarray) -> dict:
        """Dynamic sampling's and the overlong penalty's numbers for this step, when on."""
        out: dict[str, float] = {}
        if self.cfg.algorithm.filter_groups.enable:
            out["filter_groups/filtered_groups"] = batch.filtered
            out["filter_groups/zero_variance_kept"] = batch.flat_kept
            out["samples/filtered"] = self.progress.samples_filtered
        if self.cfg.reward.overlong_buffer.enable:
            task = np.stack([g.rewards for g in batch.groups])
            out["reward/overlong_penalty_mean"] = float(np.mean(rewards - task))
            out["reward/overlong_fraction"] = float(np.mean(rewards < task))
            out["reward/trained_mean"] = float(np.mean(rewards))
        return out

    def tool_metrics(self, batch: Batch) -> dict:
        """Multi-turn and agents: the step's trajectories (model turns, observation tokens,
        the share that called a tool at all); multi-turn: the rollout ranks' tool calls so
        far in this attempt (calls, failures, timeouts, seconds, and the share of
        trajectory time spent waiting for tools); agents: the means of the numbers they
        returned beside their rewards (``agent/NAME``, over the groups that have it), and
        the gateway's counts over the step's groups (``gateway/overridden/FIELD``: calls whose
        sampling field was replaced by the run's; ``gateway/failed_sessions``)."""
        agent = bool(self.cfg.data.agent)
        if not (self.cfg.rollout.multi_turn.enable or agent):
            return {}
        turns, observed = [], []
        for g in batch.groups:
            for j in range(g.rows):
                length = int(g.response_lengths[j])
                mask = g.loss_mask[j, :length] if g.loss_mask is not None else np.ones(length)
                turns.append(
                    len(observation_spans(mask)) + 1
                )  # observations, and a model turn after each
                observed.append(length - int(mask.sum()))
        out = {
            "multi_turn/turns_mean": float(np.mean(turns)),
            "multi_turn/tool_call_rate": float(np.mean(np.asarray(turns) > 1)),
            "multi_turn/observation_tokens_mean": float(np.mean(observed)),
        }
        if agent:
            for name in sorted({k for g in batch.groups for k in g.agent_extra}):
                values = [g.agent_extra[name] for g in batch.groups if name in g.agent_extra]
                if name.startswith("gateway/"):  # the gateway's counts of the step's calls
                    out[name] = float(np.sum(values))
                else:
                    out[f"agent/{name}"] = float(np.mean(values))
            return out
        total = {k: sum(t[k] for t in self.tools.values()) for k in ("tool_calls", "tool_errors",
                 "tool_timeouts", "tool_s", "tool_wait_s", "trajectory_s")}  # fmt: skip
        return {
            **out,
            "tools/calls": total["tool_calls"],
            "tools/errors": total["tool_errors"],
            "tools/timeouts": total["tool_timeouts"],
            "tools/seconds": total["tool_s"],
            "tools/wait_share": total["tool_wait_s"] / max(total["trajectory_s"], 1e-9),
        }

    def close(self) -> None:
        for writer in (self.metrics, self.trained_log, self.dropped_log):
            writer.close()
        self.trackers.close(finished=self.progress.step >= self.cfg.trainer.total_steps)


def batch_metrics(groups: list[SampleGroup], rewards: np.ndarray, max_length: int) -> dict:
    """What the step trained on: the share of groups whose trained rewards (G, n) are all
    equal (no GRPO signal), the best group's mean reward, and the responses' mean length
    and share cut at max_length."""
    lengths = np.concatenate([g.response_lengths for g in groups]).astype(np.float64)
    return {
        "batch/zero_variance_groups": float(np.mean(np.ptp(rewards, axis=1) == 0)),
        "reward/best_group": float(rewards.mean(axis=1).max()),
        "response_length/mean": float(lengths.mean()),
        "response_length/clip_ratio": float(np.mean(lengths >= max_length)),
    }
