"""From the task's rewards to the advantages trained on: the one place for both.

Two halves, by where they run:

- On the trainer leader, per whole group (``group_advantages``): GRPO, Dr. GRPO, RLOO and
  REINFORCE++'s baseline need every response of a group, and only the leader holds whole
  groups. The rewards they read are ``trained_rewards``: the task's plus the overlong
  penalty (DAPO) when it is on. ``has_signal`` is dynamic sampling's test of a group.
- On every trainer rank, per token (``token_advantages``): GAE needs the value head's
  values and REINFORCE++ whitens over the whole batch, so each rank computes its own rows
  and the whitening moments are all-reduced (the same result as on one rank).

The formulas themselves are in ``algos`` (tested against verl's there); this module only
chooses among them by ``algorithm.adv_estimator``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hpc_asyncppo.config import AlgorithmConfig, Config
from hpc_asyncppo.trainer import algos
from hpc_asyncppo.transport.samples import SampleGroup

PER_TOKEN = ("gae", "reinforce_plus_plus")  # computed on every trainer rank, per token


def trained_rewards(cfg: Config, group: SampleGroup) -> np.ndarray:
    """(n,) the rewards trained on: the task's plus the overlong penalty, if enabled (an
    agent's session in several sequences: by the length of its last)."""
    overlong = cfg.reward.overlong_buffer
    if not overlong.enable:
        return group.rewards
    penalty = algos.overlong_penalty(
        torch.from_numpy(session_lengths(group)),
        cfg.rollout.response_length,
        overlong.len,
        overlong.penalty_factor,
    )
    return (group.rewards + penalty.numpy()).astype(group.rewards.dtype)


def session_lengths(group: SampleGroup) -> np.ndarray:
    """(n,) each response's length; for a session in several sequences, its last's (the
    one that ran out of room, if any did)."""
    return np.asarray(group.response_lengths)[group.last_rows()]


def has_signal(cfg: Config, group: SampleGroup) -> bool:
    """False for a group dynamic sampling would drop: its metric is equal for all n
    (acc, score: the task's reward; seq_reward, seq_final_reward: with the overlong
    penalty, as verl's DAPO reward manager adds it to the sequence reward only)."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return True
    metric = group.rewards if fg.metric in ("acc", "score") else trained_rewards(cfg, group)
    return bool(algos.has_reward_variance(torch.from_numpy(np.asarray(metric))[None])[0])


def group_advantages(cfg: Config, groups: list[SampleGroup], rewards: np.ndarray) -> np.ndarray:
    """(G, n) advantages over whole groups of ``rewards`` (G, n); zeros for the per-token
    estimators (``token_advantages`` computes those on each trainer rank)."""
    estimator = cfg.algorithm.adv_estimator
    scores = torch.from_numpy(rewards)
    if estimator in PER_TOKEN:
        return np.zeros(scores.shape, dtype=np.float32)
    if estimator == "rloo":
        return algos.rloo_advantages(scores).numpy()
    if estimator == "reinforce_plus_plus_baseline":
        # the tokens each response's advantage goes to: all of a session's sequences'
        tokens = [np.bincount(g.sessions(), g.response_lengths, g.n) for g in groups]
        lengths = torch.from_numpy(np.stack(tokens).astype(np.int64))
        return algos.reinforce_pp_baseline_advantages(scores, lengths).numpy()
    norm = estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo
    return algos.grpo_advantages(scores, norm_by_std=norm).numpy()


def token_advantages(
    algo: AlgorithmConfig,
    batch: dict[str, torch.Tensor],
    values: torch.Tensor | None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """(B, L) ``advantages`` of this rank's rows (and GAE's ``returns``). Per-token
    estimators whiten over every trainer rank's rows (``all_reduce`` sums their moments);
    the group estimators' (B,) advantages, from the leader, are spread over each response's
    tokens."""
    mask = batch["response_mask"]
    if algo.adv_estimator not in PER_TOKEN:
        return {"advantages": algos.token_advantages(batch["advantages"], mask)}
    out = {}
    token_rewards = torch.zeros_like(mask)
    # the reward sits on each response's last trained token (observation tokens are holes)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, 0).max(dim=1).values
    token_rewards[torch.arange(mask.shape[0]), last] = batch["rewards"]
    if algo.adv_estimator == "gae":
        raw, out["returns"] = algos.gae_advantages(
            token_rewards, values, mask, algo.gamma, algo.lam, whiten=False
        )
    else:
        raw, _ = algos.reinforce_pp_advantages(token_rewards, mask, algo.gamma, whiten=False)
    # whitened over the whole batch of every trainer rank, as on one rank
    moments = all_reduce(algos.masked_moments(raw, mask))
    out["advantages"] = algos.whiten_with(raw, moments)
    if algo.adv_estimator == "reinforce_plus_plus":
        out["advantages"] = out["advantages"] * mask  # as verl: 0 on padding
    return out
