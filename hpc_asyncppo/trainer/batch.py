"""From received sample groups to the padded arrays one trainer rank trains on."""

from __future__ import annotations

import numpy as np
import torch

from hpc_asyncppo.transport.samples import SampleGroup


def collate(
    groups: list[SampleGroup], advantages: np.ndarray, pad_id: int
) -> dict[str, np.ndarray]:
    """Flatten groups into B = G * n rows. advantages: (G, n) one scalar per response.

    Returns prompt_ids/prompt_mask (B, P) left-padded, response_ids/response_mask (B, L),
    rollout_log_probs (B, L), rewards (B,), advantages (B,).
    """
    width = max(g.prompt_ids.shape[0] for g in groups)
    rows = sum(g.n for g in groups)
    length = groups[0].response_ids.shape[1]
    prompt_ids = np.full((rows, width), pad_id, dtype=np.int32)
    prompt_mask = np.zeros((rows, width), dtype=np.int8)
    row = 0
    for g in groups:
        p = g.prompt_ids.shape[0]
        prompt_ids[row : row + g.n, width - p :] = g.prompt_ids
        prompt_mask[row : row + g.n, width - p :] = 1
        row += g.n
    lengths = np.concatenate([g.response_lengths for g in groups])
    response_mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int8)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": np.concatenate([g.response_ids for g in groups]),
        "response_mask": response_mask,
        "rollout_log_probs": np.concatenate([g.rollout_log_probs for g in groups]),
        "rewards": np.concatenate([g.rewards for g in groups]),
        "advantages": advantages.reshape(-1).astype(np.float32),
    }


def split_rows(batch: dict[str, np.ndarray], parts: int) -> list[dict[str, np.ndarray]]:
    """``parts`` equal contiguous slices of every array (rows must divide evenly)."""
    rows = batch["rewards"].shape[0]
    if rows % parts:
        raise ValueError(f"{rows} rows do not split into {parts} equal parts")
    size = rows // parts
    return [{k: v[i * size : (i + 1) * size] for k, v in batch.items()} for i in range(parts)]


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
