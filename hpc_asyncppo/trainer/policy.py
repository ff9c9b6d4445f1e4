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


def micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Row indices in chunks of ``size`` (0: one chunk)."""
    return list(rows.split(size)) if size > 0 else [rows]


@torch.no_grad()
def reference_quantities(policy: Policy, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Before any update of the step: old log-probs, ref log-probs, values, advantages,
    returns and importance weights, each (B, L), computed micro-batch by micro-batch."""
    cfg = policy.cfg
    mask = batch["response_mask"]
    parts: dict[str, list[torch.Tensor]] = {"old_log_probs": [], "values": [], "ref_log_probs": []}
    for idx in micro_batches(torch.arange(mask.shape[0]), cfg.actor.ppo_micro_batch_size_per_gpu):
        mb = {k: v[idx] for k, v in batch.items()}
        log_probs, _, values = policy.forward(
            policy.model, mb, with_values=policy.value_head is not None
        )
        parts["old_log_probs"].append(log_probs)
        if values is not None:
            parts["values"].append(values)
        if policy.reference is not None:
            parts["ref_log_probs"].append(policy.forward(policy.reference, mb)[0])
    out = {k: torch.cat(v) for k, v in parts.items() if v}
    if cfg.async_training.use_rollout_log_probs:
        out["old_log_probs"] = batch["rollout_log_probs"]
    if cfg.algorithm.adv_estimator == "gae":
        token_rewards = torch.zeros_like(mask)
        last = (mask.sum(dim=1).long() - 1).clamp(min=0)
        token_rewards[torch.arange(mask.shape[0]), last] = batch["rewards"]
        out["advantages"], out["returns"] = algos.gae_advantages(
            token_rewards, out["values"], mask, cfg.algorithm.gamma, cfg.algorithm.lam
        )
    else:
        out["advantages"] = algos.token_advantages(batch["advantages"], mask)
    if cfg.algorithm.rollout_is != "none":
        out["is_weights"] = algos.rollout_importance_weights(
            out["old_log_probs"], batch["rollout_log_probs"], mask,
            cfg.algorithm.rollout_is, cfg.algorithm.rollout_is_threshold,
        )  # fmt: skip
    return out


def micro_batch_loss(
    policy: Policy, mb: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO loss of one micro-batch (``ref``: its rows of ``reference_quantities``)."""
    cfg, actor = policy.cfg, policy.cfg.actor
    m = mb["response_mask"]
    log_probs, logits, values = policy.forward(
        policy.model, mb, with_values=policy.value_head is not None
    )
    loss, pg_stats = algos.policy_loss(
        log_probs, ref["old_log_probs"], ref["advantages"], m,
        actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c, actor.loss_agg_mode,
        is_weights=ref.get("is_weights"),
    )  # fmt: skip
    stats = {"actor/pg_loss": loss.item(), **{f"actor/{k}": v.item() for k, v in pg_stats.items()}}
    if actor.entropy_coeff > 0:
        entropy = algos.agg_loss(algos.entropy_from_logits(logits), m, actor.loss_agg_mode)
        loss = loss - actor.entropy_coeff * entropy
        stats["actor/entropy"] = entropy.item()
    if "ref_log_probs" in ref:
        kl_tokens = algos.kl_penalty(log_probs, ref["ref_log_probs"], actor.kl_loss_type)
        kl = algos.agg_loss(kl_tokens, m, actor.loss_agg_mode)
        loss = loss + actor.kl_loss_coef * kl
        stats["actor/kl_loss"] = kl.item()
    if values is not None:
        vf_loss, vf_clipfrac = algos.value_loss(
            values,
            ref["values"],
            ref["returns"],
            m,
            cfg.critic.cliprange_value,
            actor.loss_agg_mode,
        )
        loss = loss + cfg.critic.value_coef * vf_loss
        stats["critic/vf_loss"], stats["critic/vf_clipfrac"] = vf_loss.item(), vf_clipfrac.item()
    return loss, stats


def ppo_update(
    policy: Policy, batch: dict[str, torch.Tensor], group: dist.ProcessGroup | None, world: int
) -> dict[str, float]:
    """One trainer step on this rank's shard: require_batches mini-batches x ppo_epochs
    optimizer steps, each accumulating gradients over micro-batches, then all-reduced."""
    cfg, actor = policy.cfg, policy.cfg.actor
    ref = reference_quantities(policy, batch)
    params = [p for group_ in policy.optimizer.param_groups for p in group_["params"]]
    rows = torch.arange(batch["response_mask"].shape[0])
    totals: dict[str, float] = {}
    updates = 0
    for _ in range(actor.ppo_epochs):
        for mini in rows.chunk(cfg.async_training.require_batches):
            policy.optimizer.zero_grad(set_to_none=True)
            for idx in micro_batches(mini, actor.ppo_micro_batch_size_per_gpu):
                mb = {k: v[idx] for k, v in batch.items()}
                loss, stats = micro_batch_loss(policy, mb, {k: v[idx] for k, v in ref.items()})
                # each micro-batch's share of the mini-batch (verl's scaling)
                (loss * (len(idx) / len(mini))).backward()
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v * len(idx) / len(mini)
            all_reduce_gradients(params, group, world)
            if actor.grad_clip > 0:
                norm = float(torch.nn.utils.clip_grad_norm_(params, actor.grad_clip))
                totals["actor/grad_norm"] = totals.get("actor/grad_norm", 0.0) + norm
            policy.optimizer.step()
            updates += 1
    return {k: v / updates for k, v in totals.items()}
