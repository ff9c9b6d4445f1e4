"""The trained policy (HF causal LM, optional value head, optional frozen reference) and
one PPO update on a trainer rank's shard of the batch.

The loss math lives in ``algos.py``; this file only runs the model and wires the pieces.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM

from hpc_asyncppo.checkpoint.store import CheckpointError, check_compatible
from hpc_asyncppo.config import Config
from hpc_asyncppo.rollout.hf_engine import DTYPES
from hpc_asyncppo.trainer import algos


class Policy:
    def __init__(self, cfg: Config, device: torch.device):
        self.cfg, self.device = cfg, device
        self.model = AutoModelForCausalLM.from_pretrained(
            cfg.model.path, dtype=DTYPES[cfg.model.dtype]
        ).to(device)
        self.model.train()
        params = list(self.model.parameters())
        self.value_head: nn.Linear | None = None
        if cfg.algorithm.adv_estimator == "gae":
            torch.manual_seed(cfg.trainer.seed)  # identical on every trainer rank
            self.value_head = nn.Linear(self.model.config.hidden_size, 1).to(device)
            params += list(self.value_head.parameters())
        self.reference = None
        if cfg.actor.use_kl_loss:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay
        )

    def state_tree(self) -> dict:
        """What a checkpoint keeps of the trained model: weights, value head, optimizer."""
        tree = {
            "model": {n: p.detach() for n, p in self.model.named_parameters()},
            "optimizer": self.optimizer.state_dict(),
        }
        if self.value_head is not None:
            tree["value_head"] = {n: p.detach() for n, p in self.value_head.named_parameters()}
        return tree

    @torch.no_grad()
    def restore(self, tree: dict, source: str) -> None:
        """Load ``state_tree()``'s output; CheckpointError naming the first tensor that differs."""
        parts = [("model", self.model)] + (
            [("value_head", self.value_head)] if self.value_head else []
        )
        for key, module in parts:
            if key not in tree:
                raise CheckpointError(
                    f"checkpoint {source} has no {key!r} (was it written with another algorithm?)"
                )
            check_compatible(tree[key], module.named_parameters(), source)
            for name, param in module.named_parameters():
                param.copy_(tree[key][name])
        self.optimizer.load_state_dict(tree["optimizer"])

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights rollout ranks need (the LM, not the value head)."""
        return [(name, p.detach()) for name, p in self.model.named_parameters()]

    def forward(
        self, model: nn.Module, batch: dict[str, torch.Tensor], with_values: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Response log-probs (B, L), logits (B, L, V) scaled by temperature, values (B, L) or None."""
        prompt_width = batch["prompt_ids"].shape[1]
        input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
        attention = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).long()
        position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
        out = model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=position_ids,
            output_hidden_states=with_values,
        )
        # The logits at position t predict token t + 1: responses start after the last prompt token.
        logits = out.logits[:, prompt_width - 1 : -1].float() / self.cfg.rollout.temperature
        log_probs = (
            torch.log_softmax(logits, dim=-1)
            .gather(-1, batch["response_ids"].unsqueeze(-1))
            .squeeze(-1)
        )
        values = None
        if with_values and self.value_head is not None:
            hidden = out.hidden_states[-1][:, prompt_width - 1 : -1].float()
            values = self.value_head(hidden).squeeze(-1)
        return log_probs, logits, values


def all_reduce_gradients(
    params: list[nn.Parameter], group: dist.ProcessGroup | None, world: int
) -> None:
    """Average gradients over the trainer ranks with one flat all-reduce."""
    if world == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= world
    offset = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def ppo_update(
    policy: Policy, batch: dict[str, torch.Tensor], group: dist.ProcessGroup | None, world: int
) -> dict[str, float]:
    """One trainer step on this rank's shard: require_batches mini-batches x ppo_epochs updates."""
    cfg, actor = policy.cfg, policy.cfg.actor
    mask = batch["response_mask"]
    with torch.no_grad():
        old_log_probs, _, old_values = policy.forward(
            policy.model, batch, with_values=policy.value_head is not None
        )
        if cfg.async_training.use_rollout_log_probs:
            old_log_probs = batch["rollout_log_probs"]
        ref_log_probs = (
            policy.forward(policy.reference, batch)[0] if policy.reference is not None else None
        )
    if cfg.algorithm.adv_estimator == "gae":
        token_rewards = torch.zeros_like(mask)
        last = (mask.sum(dim=1).long() - 1).clamp(min=0)
        token_rewards[torch.arange(mask.shape[0]), last] = batch["rewards"]
        advantages, returns = algos.gae_advantages(
            token_rewards, old_values, mask, cfg.algorithm.gamma, cfg.algorithm.lam
        )
    else:
        advantages, returns = algos.token_advantages(batch["advantages"], mask), None
    is_weights = None
    if cfg.algorithm.rollout_is != "none":
        is_weights = algos.rollout_importance_weights(
            old_log_probs,
            batch["rollout_log_probs"],
            mask,
            cfg.algorithm.rollout_is,
            cfg.algorithm.rollout_is_threshold,
        )

    params = [p for group_ in policy.optimizer.param_groups for p in group_["params"]]
    rows = mask.shape[0]
    chunks = torch.arange(rows).chunk(cfg.async_training.require_batches)
    totals: dict[str, float] = {}
    updates = 0
    for _ in range(actor.ppo_epochs):
        for idx in chunks:
            mb = {k: v[idx] for k, v in batch.items()}
            m = mask[idx]
            log_probs, logits, values = policy.forward(
                policy.model, mb, with_values=policy.value_head is not None
            )
            pg_loss, pg_stats = algos.policy_loss(
                log_probs, old_log_probs[idx], advantages[idx], m,
                actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c, actor.loss_agg_mode,
                is_weights=None if is_weights is None else is_weights[idx],
            )  # fmt: skip
            loss = pg_loss
            stats = {
                "actor/pg_loss": pg_loss.item(),
                **{f"actor/{k}": v.item() for k, v in pg_stats.items()},
            }
            if actor.entropy_coeff > 0:
                entropy = algos.agg_loss(algos.entropy_from_logits(logits), m, actor.loss_agg_mode)
                loss = loss - actor.entropy_coeff * entropy
                stats["actor/entropy"] = entropy.item()
            if ref_log_probs is not None:
                kl = algos.agg_loss(
                    algos.kl_penalty(log_probs, ref_log_probs[idx], actor.kl_loss_type),
                    m,
                    actor.loss_agg_mode,
                )
                loss = loss + actor.kl_loss_coef * kl
                stats["actor/kl_loss"] = kl.item()
            if values is not None:
                vf_loss, vf_clipfrac = algos.value_loss(
                    values,
                    old_values[idx],
                    returns[idx],
                    m,
                    cfg.critic.cliprange_value,
                    actor.loss_agg_mode,
                )
                loss = loss + cfg.critic.value_coef * vf_loss
                stats["critic/vf_loss"], stats["critic/vf_clipfrac"] = (
                    vf_loss.item(),
                    vf_clipfrac.item(),
                )
            policy.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            all_reduce_gradients(params, group, world)
            if actor.grad_clip > 0:
                stats["actor/grad_norm"] = float(
                    torch.nn.utils.clip_grad_norm_(params, actor.grad_clip)
                )
            policy.optimizer.step()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            updates += 1
    return {k: v / updates for k, v in totals.items()}
