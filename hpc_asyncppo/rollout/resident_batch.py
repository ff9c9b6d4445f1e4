"""The hf engine's batch that stays between steps: the rows in flight with their KV cache.

With ``rollout.hf_step_tokens=k`` the hf engine samples k tokens of every response in
flight per step; finished groups leave and new ones join between steps. A
``ResidentBatch`` keeps the rows that go on, with their keys and values, so a step
continues them by decoding alone: only a row new to the batch (a group just submitted or
resumed, a response whose context grew by an observation, or every row after new weights
were loaded) is prefilled, and it joins the others in the same cache. This is continuous
batching on transformers' model call, the way vLLM's engine does it with paged memory: a
short response leaves as soon as it ends and a new group takes its place, instead of a
batch running to its longest response.

Layout: rows are left-padded to a common length T (``mask`` (B, T): 1 on a row's own
tokens); each row's positions count its own tokens, so a row's keys, values and logits
are what a forward of its context alone gives (up to float error). A row that leaves is
cut out of the cache; columns that no row uses any more are dropped from the left, so T
stays within the longest context held.

Memory: the cache of the rows held (2 x layers x B x KV heads x T x head size, in
``model.dtype``) and their next-token logits (B x vocabulary, fp32), on the engine's
device; nothing once the batch is empty or dropped (``clear``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) ids and attention mask, each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class ResidentBatch:
    """Rows (identified by their owner objects) with their context's KV cache and the
    logits of each row's next token."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.owners: list[object] = []  # one per row, in the cache's row order
        self.lengths: list[int] = []  # the context length each row's cache covers
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # (B, T) long
        self.logits: torch.Tensor | None = None  # (B, V) fp32: each row's next token

    def __len__(self) -> int:
        return len(self.owners)

    def clear(self) -> None:
        """Forget every row (new weights: their keys and values are the old weights')."""
        self.owners, self.lengths = [], []
        self.cache = self.mask = self.logits = None

    def hold(self, rows: Sequence[tuple[object, list[int]]]) -> None:
        """Hold exactly ``rows`` (owner, context): a row already held with a context of the
        same length is kept as it is (its tokens were appended here), any other is
        dropped; the rows not held yet are prefilled and join, after the kept ones."""
        held = {id(owner): i for i, owner in enumerate(self.owners)}
        keep = [held.get(id(owner)) for owner, _ in rows]
        keep = [
            i if i is not None and self.lengths[i] == len(context) else None
            for i, (_, context) in zip(keep, rows, strict=True)
        ]
        self.select(sorted(i for i in keep if i is not None))
        new = [row for row, i in zip(rows, keep, strict=True) if i is None]
        if new:
            self._join(new)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (indices into the current order), in this order."""
        if rows == list(range(len(self.owners))):
            return
        if not rows:
            self.clear()
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.owners = [self.owners[i] for i in rows]
        self.lengths = [self.lengths[i] for i in rows]
        mask = self.mask[index]
        lead = int((mask.sum(0) == 0).long().cumprod(0).sum())  # columns no row uses
        self.mask, self.logits = mask[:, lead:], self.logits[index]
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, lead:]
            layer.values = layer.values[index, :, lead:]

    def advance(self, tokens: torch.Tensor) -> None:
        """Append one token to every row (``tokens`` (B,)): a decoding step of the model over
        the whole batch; the logits become those of each row's next token."""
        ones = torch.ones((len(self.owners), 1), dtype=self.mask.dtype, device=self.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        positions = self.mask.sum(dim=1, keepdim=True) - 1
        out = self.model(
            input_ids=tokens.view(-1, 1).to(self.device),
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.logits = out.logits[:, -1].float()
        self.lengths = [n + 1 for n in self.lengths]

    def _join(self, rows: list[tuple[object, list[int]]]) -> None:
        """Prefill the contexts of ``rows`` (left-padded) and append them to the batch."""
        ids, mask = left_pad([context for _, context in rows], pad_id=0)  # pads are masked
        ids, mask, width = ids.to(self.device), mask.to(self.device), ids.shape[1]
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
        )
        if any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise ValueError(
                f"rollout.hf_step_tokens keeps a full KV cache per row; this model's cache "
                f"has {sorted({type(layer).__name__ for layer in cache.layers})} layers "
                "(sliding-window or recurrent attention): set rollout.hf_step_tokens=0"
            )
        logits = out.logits[:, -1].float()
        self.owners += [owner for owner, _ in rows]
        self.lengths += [len(context) for _, context in rows]
        if self.cache is None:
            self.cache, self.mask, self.logits = cache, mask, logits
            return
        total = max(self.mask.shape[1], width)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat(
                [_pad_left(mine.keys, total, 2), _pad_left(theirs.keys, total, 2)]
            )
            mine.values = torch.cat(
                [_pad_left(mine.values, total, 2), _pad_left(theirs.values, total, 2)]
            )
        self.mask = torch.cat([_pad_left(self.mask, total, 1), _pad_left(mask, total, 1)])
        self.logits = torch.cat([self.logits, logits])


def filtered(scaled: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """``scaled`` logits (B, V) with -inf outside the top ``top_k`` (0: all) and then
    outside the nucleus ``top_p``: the smallest set of the most likely tokens whose mass
    reaches ``top_p`` (the tokens transformers' top-k and top-p warpers keep)."""
    kept = scaled
    if top_k:
        kth = torch.topk(scaled, min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        kept = kept.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(kept, dim=-1), dim=-1, descending=True)
        above = probs.cumsum(dim=-1) - probs  # the mass ranked above each token
        drop = torch.zeros_like(above, dtype=torch.bool).scatter(-1, order, above >= top_p)
        kept = kept.masked_fill(drop, float("-inf"))
    return kept


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``logits`` (B, V) and its log-prob, as the hf engine's
    ``generate`` samples: at ``temperature`` among the tokens ``filtered`` keeps; the
    log-prob is log_softmax(logits / temperature) at the token (the trainer's quantity,
    before any filtering). Temperature 0: the argmax, with its temperature-1 log-prob."""
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        log_probs = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / temperature
        log_probs = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(filtered(scaled, top_p, top_k), dim=-1)
        tokens = torch.multinomial(probs, 1).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
