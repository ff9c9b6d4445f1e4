"""Rollout engine on transformers: batched sampling with the sampled tokens' log-probs.

Prompts are left-padded (decoder-only batching), responses right-padded after EOS. The
log-prob of each sampled token is log_softmax(logits / temperature) at that position: the
same quantity the trainer recomputes, so the two agree up to float error for equal weights.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpc_asyncppo.config import ModelConfig, RolloutConfig
from hpc_asyncppo.rollout.generation import DTYPES, Generation, response_lengths


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) ids and attention mask, each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


class HFEngine:
    def __init__(self, model: ModelConfig, rollout: RolloutConfig, device: torch.device):
        self.cfg, self.device = rollout, device
        self.tokenizer = AutoTokenizer.from_pretrained(model.path)
        self.model = AutoModelForCausalLM.from_pretrained(model.path, dtype=DTYPES[model.dtype]).to(
            device
        )
        self.model.eval()
        self._params = dict(self.model.named_parameters())
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        )
        self.version = -1
        self.queued: dict[Hashable, tuple[list[int], int]] = {}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int) -> list[Generation]:
        """Sample n responses for every prompt (token ids)."""
        ids, mask = left_pad([p for p in prompts for _ in range(n)], self.pad_id)
        cfg = self.cfg
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=True,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k or None,
            max_new_tokens=cfg.response_length,
            min_new_tokens=0,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        responses = out.sequences[:, ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float() / cfg.temperature  # (B, L', V)
        log_probs = (
            torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        )
        lengths = response_lengths(responses, self.eos_id)
        width = cfg.response_length
        valid = (
            torch.arange(responses.shape[1], device=responses.device)[None, :] < lengths[:, None]
        )
        padded_ids = torch.full((responses.shape[0], width), self.pad_id, dtype=torch.int32)
        padded_lp = torch.zeros((responses.shape[0], width), dtype=torch.float32)
        padded_ids[:, : responses.shape[1]] = torch.where(valid, responses, self.pad_id).int().cpu()
        padded_lp[:, : responses.shape[1]] = torch.where(valid, log_probs, 0.0).cpu()
        versions = torch.where(valid, self.version, -1).int().cpu()
        padded_versions = torch.full((responses.shape[0], width), -1, dtype=torch.int32)
        padded_versions[:, : responses.shape[1]] = versions
        return [
            Generation(
                response_ids=padded_ids[i * n : (i + 1) * n].numpy(),
                response_lengths=lengths[i * n : (i + 1) * n].int().cpu().numpy(),
                log_probs=padded_lp[i * n : (i + 1) * n].numpy(),
                versions=padded_versions[i * n : (i + 1) * n].numpy(),
            )
            for i in range(len(prompts))
        ]

    # The step interface of the rollout loop: one step generates every queued group to the end.
    @property
    def in_flight(self) -> int:
        return len(self.queued)

    def submit(self, key: Hashable, prompt: list[int], n: int) -> None:
        if key in self.queued:
            raise ValueError(f"a prompt group with key {key!r} is already in flight")
        self.queued[key] = (list(prompt), n)

    def step(self) -> list[tuple[Hashable, Generation]]:
        by_n: dict[int, list[Hashable]] = {}
        for key, (_, n) in self.queued.items():
            by_n.setdefault(n, []).append(key)
        done = []
        for n, keys in by_n.items():
            gens = self.generate([self.queued[key][0] for key in keys], n)
            done += list(zip(keys, gens, strict=True))
        self.queued.clear()
        return done

    def interrupt(self) -> None:
        """Nothing runs between steps: a transformers generation cannot be cut."""

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.named_parameters())

    def check_weights(self, specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Refuse a sync whose names, shapes or dtypes (from its header) differ from the model's."""
        params = dict(self.model.named_parameters())
        names = [name for name, _, _ in specs]
        if set(params) != set(names) or len(names) != len(set(names)):
            missing, extra = sorted(set(params) - set(names)), sorted(set(names) - set(params))
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(
                f"weight sync does not match the rollout model: missing {missing[:5]}, "
                f"unexpected {extra[:5]}, sent twice {twice[:5]}"
            )
        for name, shape, dtype in specs:
            param = params[name]
            if tuple(shape) != tuple(param.shape) or dtype != param.dtype:
                raise ValueError(
                    f"weight {name}: got {tuple(shape)} {dtype}, model has {tuple(param.shape)} {param.dtype}"
                )

    @torch.no_grad()
    def load_buckets(
        self,
        specs: list[tuple[str, tuple[int, ...], torch.dtype]],
        buckets: Iterable[dict[str, torch.Tensor]],
        version: int = -1,
    ) -> None:
        """Load a sync bucket by bucket, each tensor copied into its parameter as it comes
        (or already there: a receiver writes large ones straight into ``weight_destination``).

        ``specs`` (the header) are checked against the model before any bucket is taken,
        so a mismatched sync is refused whole; the buckets' tensors are not kept (the
        receiver reuses their memory), so nothing beyond the model is held here."""
        self.check_weights(specs)
        params = dict(self.model.named_parameters())
        loaded: set[str] = set()
        for bucket in buckets:
            for name, src in bucket.items():
                if name in loaded or name not in params:
                    raise RuntimeError(f"weight sync carried {name!r} twice or unannounced")
                if src.data_ptr() != params[name].data_ptr():  # not received in place
                    params[name].copy_(src)
                loaded.add(name)
        if loaded != set(params):
            raise RuntimeError(
                f"weight sync ended without {sorted(set(params) - loaded)[:5]}: the model is half-loaded"
            )
        self.version = version

    def weight_destination(self, name: str) -> torch.Tensor | None:
        """The parameter's own storage: a sync receives large tensors straight into it."""
        param = self._params.get(name)
        return None if param is None else param.detach()

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int = -1) -> None:
        """Load a whole set of weights at once (one bucket of everything)."""
        specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        self.load_buckets(specs, [tensors], version)

    def close(self) -> None:
        pass
