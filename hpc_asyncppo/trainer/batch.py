"""From received sample groups to the padded arrays one trainer rank trains on, and how
those rows are cut into mini-batches (one optimizer step each) and micro-batches (one
forward/backward each)."""

from __future__ import annotations

import numpy as np
import torch

from hpc_asyncppo.transport.samples import SampleGroup


def collate(
    groups: list[SampleGroup],
    advantages: np.ndarray,
    pad_id: int,
    rewards: np.ndarray | None = None,
    multiple: int = 1,
) -> dict[str, np.ndarray]:
    """Flatten groups into B rows: one per response, G * n (an agent's session in several
    sequences has a row for each, every one with its session's reward and advantage).
    advantages: (G, n) one scalar per response; rewards: (G, n) the rewards to train on
    (e.g. with the overlong penalty), None: the groups' own. ``multiple``: B is padded up
    to a multiple of it with empty rows (a copy of the last row that trains nothing:
    response_mask 0, reward and advantage 0), so that it splits into the trainer ranks'
    equal shards; needed only where some session has several sequences.

    Returns prompt_ids/prompt_mask (B, P) left-padded, response_ids/response_mask (B, L),
    rollout_log_probs (B, L), rewards (B,), advantages (B,). With multi-turn groups (a
    ``loss_mask``) or empty rows, ``response_mask`` is 0 on observation tokens (and empty
    rows) too (holes: every loss, estimator and statistic skips them) and
    ``response_attention`` (B, L) marks every token of the response, observations
    included, for the model's attention.
    """
    rewards = np.stack([g.rewards for g in groups]) if rewards is None else rewards
    sessions = [g.sessions() for g in groups]  # each row's response in its group
    prompts = [g.row_prompt(r) for g in groups for r in range(g.rows)]
    width = max(p.shape[0] for p in prompts)
    real = len(prompts)
    rows = -(-real // multiple) * multiple
    last = [real - 1] * (rows - real)  # empty rows: copies of the last
    length = groups[0].response_ids.shape[1]
    prompt_ids = np.full((rows, width), pad_id, dtype=np.int32)
    prompt_mask = np.zeros((rows, width), dtype=np.int8)
    for row, p in enumerate(prompts + [prompts[-1]] * len(last)):
        prompt_ids[row, width - p.shape[0] :] = p
        prompt_mask[row, width - p.shape[0] :] = 1

    def rows_of(arrays: list[np.ndarray]) -> np.ndarray:
        flat = np.concatenate(arrays)
        return np.concatenate([flat, flat[last]]) if last else flat

    lengths = rows_of([g.response_lengths for g in groups])
    response_mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int8)
    trained = np.ones(rows, dtype=np.float32)
    trained[real:] = 0
    holes = {}
    if last or any(g.loss_mask is not None for g in groups):
        loss_mask = rows_of(
            [g.loss_mask if g.loss_mask is not None else np.ones((g.rows, length)) for g in groups]
        ).astype(np.int8)
        loss_mask[real:] = 0
        holes = {"response_attention": response_mask, "response_mask": response_mask * loss_mask}
    per_row = {
        name: rows_of([v[i][sessions[i]] for i in range(len(groups))]) * trained
        for name, v in (("rewards", rewards), ("advantages", advantages))
    }
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": rows_of([g.response_ids for g in groups]),
        "response_mask": response_mask,
        "rollout_log_probs": rows_of([g.rollout_log_probs for g in groups]),
        "rewards": per_row["rewards"].astype(np.float32),
        "advantages": per_row["advantages"].astype(np.float32),
        **holes,
    }


def shard_rows(batch: dict[str, np.ndarray], ranks: int, minis: int) -> list[dict[str, np.ndarray]]:
    """Each trainer rank's rows: the batch is cut into ``minis`` contiguous mini-batches and
    each mini-batch into ``ranks`` equal slices; rank r gets its slice of every mini-batch,
    in order. A rank's k-th of ``minis`` equal chunks is then its part of mini-batch k, so
    the mini-batches (and so the optimizer steps) are the same for any number of ranks."""
    rows = np.arange(batch["rewards"].shape[0])
    if rows.size % (minis * ranks):
        raise ValueError(f"{rows.size} rows do not split into {minis} mini-batches x {ranks} ranks")
    # (minis, ranks, rows per part): rank r takes [:, r] of every mini-batch
    parts = rows.reshape(minis, ranks, -1)
    return [{k: v[parts[:, r].reshape(-1)] for k, v in batch.items()} for r in range(ranks)]


def plan_micro_batches(
    row_tokens: np.ndarray, rows_per_micro: int, token_budget: int | None
) -> list[np.ndarray]:
    """Row indices of each micro-batch of one mini-batch, in order.

    ``token_budget`` None: chunks of ``rows_per_micro`` rows (0: one chunk). Otherwise
    consecutive rows are packed while their tokens (``row_tokens``: prompt + response of
    each row) fit the budget; a row longer than the budget goes alone.
    """
    rows = np.arange(row_tokens.shape[0])
    if token_budget is None:
        size = rows_per_micro or max(1, rows.size)
        return [rows[i : i + size] for i in range(0, rows.size, size)]
    plan, current, used = [], [], 0
    for row, tokens in zip(rows.tolist(), row_tokens.tolist(), strict=True):
        if current and used + tokens > token_budget:
            plan.append(np.asarray(current))
            current, used = [], 0
        current.append(row)
        used += tokens
    if current:
        plan.append(np.asarray(current))
    return plan


def split_to_count(plan: list[np.ndarray], row_tokens: np.ndarray, count: int) -> list[np.ndarray]:
    """``plan`` with exactly ``count`` micro-batches: the one with the most tokens is halved
    until there are enough; empty ones fill up when no micro-batch has two rows left.

    Every trainer rank must run the same number of forward/backward passes (each is a
    collective under FSDP), so ranks whose token-budget plan came out shorter split theirs.
    """
    plan = list(plan)
    while len(plan) < count:
        splittable = [i for i, mb in enumerate(plan) if mb.size > 1]
        if not splittable:
            plan += [np.zeros(0, dtype=np.int64)] * (count - len(plan))
            break
        i = max(splittable, key=lambda j: int(row_tokens[plan[j]].sum()))
        half = plan[i].size // 2
        plan[i : i + 1] = [plan[i][:half], plan[i][half:]]
    return plan


def attention(batch: dict) -> torch.Tensor:
    """(B, L) every token of each response (observations included): what the model sees."""
    return batch.get("response_attention", batch["response_mask"])


def row_tokens(batch: dict[str, torch.Tensor]) -> np.ndarray:
    """(B,) prompt + response tokens of each row (what a micro-batch's token budget counts)."""
    lengths = batch["prompt_mask"].sum(dim=1) + attention(batch).sum(dim=1)
    return lengths.long().cpu().numpy()


def trim(batch: dict[str, torch.Tensor], rows: np.ndarray) -> dict[str, torch.Tensor]:
    """The tensors of ``rows``, cut to their longest prompt (left-padded) and longest
    response (right-padded): no micro-batch is padded to ``rollout.response_length``."""
    index = torch.as_tensor(rows, dtype=torch.long, device=batch["prompt_mask"].device)
    out = {key: value[index] for key, value in batch.items()}
    widths = {
        "prompt_": int(out["prompt_mask"].sum(dim=1).max()) if rows.size else 1,
        "response_": int(attention(out).sum(dim=1).max()) if rows.size else 1,
    }
    for key, value in out.items():
        if value.ndim != 2:
            continue
        if key.startswith("prompt_"):
            out[key] = value[:, value.shape[1] - max(1, widths["prompt_"]) :]
        else:  # response-shaped (B, L): ids, mask, log-probs, and the per-token references
            out[key] = value[:, : max(1, widths["response_"])]
    return out


def to_tensors(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in batch.items():
        t = torch.from_numpy(np.ascontiguousarray(v))
        out[k] = (
            t.long()
            if k.endswith("_ids")
            else t.float()
            if v.dtype.kind == "f" or k.endswith("_mask")
            else t
        ).to(device)
    return out
