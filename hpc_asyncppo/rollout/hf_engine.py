"""Rollout engine on transformers: batched sampling with the sampled tokens' log-probs.

Prompts are left-padded (decoder-only batching), responses right-padded after EOS. The
log-prob of each sampled token is log_softmax(logits / temperature) at that position: the
same quantity the trainer recomputes, so the two agree up to float error for equal weights.

Two ways to run a step: by default one ``generate`` call samples every response in flight
to its end (a batch waits for its longest response; the call's KV cache is freed at its
end); with ``rollout.hf_step_tokens=k`` the engine batches continuously
(``resident_batch.py``): a step decodes k tokens of every row, a response leaves the batch
at its end and new groups join between steps, and the rows that go on keep their KV cache
from one step to the next (memory: that cache for the rows in flight, and with in-flight
weight updates the staging copy of the weights, ``engine_weights.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from hpc_asyncppo.config import ModelConfig, RolloutConfig
from hpc_asyncppo.models import lora
from hpc_asyncppo.models.dtypes import DTYPES
from hpc_asyncppo.rollout.generation import (
    Generation,
    PartialGroup,
    Response,
    ResponseGroup,
)
from hpc_asyncppo.rollout.resident_batch import ResidentBatch, left_pad, sample_tokens
from hpc_asyncppo.runlog import weights_digest
from hpc_asyncppo.transport.weight_group import WeightGroupSpec, open_weight_group
from hpc_asyncppo.transport.weights import (
    Background,
    WeightReceiver,
    WeightUpdate,
    check_version,
)


class _Flag(StoppingCriteria):
    """Ends a ``generate`` call at the next token once ``flag()`` is true."""

    def __init__(self, flag: Callable[[], bool]):
        self.flag = flag

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), bool(self.flag()), device=input_ids.device)


def alternatives(log_probs: torch.Tensor, top: int) -> list[list[list[tuple[int, float]]]]:
    """The ``top`` most likely tokens at every place of ``log_probs`` (B, L, V), each with
    its log-prob, most likely first: per row, per place."""
    values, ids = torch.topk(log_probs, min(top, log_probs.shape[-1]), dim=-1)
    return [[list(zip(i, v, strict=True)) for i, v in zip(row_ids, row_values, strict=True)]
            for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)]  # fmt: skip


class HFEngine:
    def __init__(self, model: ModelConfig, rollout: RolloutConfig, device: torch.device):
        self.cfg, self.device = rollout, device
        self.tokenizer = AutoTokenizer.from_pretrained(model.path)
        self.model = AutoModelForCausalLM.from_pretrained(model.path, dtype=DTYPES[model.dtype]).to(
            device
        )
        self.model.eval()
        self._params = dict(self.model.named_parameters())
        self.model_path = model.path
        # LoRA (models/lora.py): the base of the targeted weights (read from the files at
        # the first sync, then held: their bytes again in host memory), and the adapters
        # of the last sync
        self.base: lora.BaseWeights | None = None
        self.adapters: dict[str, torch.Tensor] | None = None
        self.merged: list[str] = []  # the weights that differ from the base's files
        self.receiver: WeightReceiver | None = None  # the weight group's, once joined
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        )
        self.version = -1
        self.groups: dict[Hashable, ResponseGroup] = {}
        # rollout.hf_step_tokens > 0: the rows in flight with their KV cache, per sampling
        # temperature, kept from one step to the next (resident_batch.py)
        self.resident: dict[float | None, ResidentBatch] = {}
        # While true, a step ends at once with the tokens so far (the rank's stop flag).
        self.should_stop: Callable[[], bool] | None = None
        # multi-turn (rollout/turns.py): the tokens that end the model's turn (EOS and the
        # end of a tool call); empty: single-turn, EOS ends the response
        self.turn_ends: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    @torch.no_grad()
    def sample(
        self, contexts: list[list[int]], max_new: int, temperature: float | None = None,
        top: int = 0,
    ) -> tuple[list[list[int]], list[list[float]], list[list[list[tuple[int, float]]]] | None]:  # fmt: skip
        """Sample up to ``max_new`` tokens after each context (one row each) at
        ``temperature`` (None: rollout.temperature; 0: greedy, with the log-probs of
        temperature 1), stopping early, with the tokens so far, when ``should_stop()`` turns
        true; the new tokens of each row and their log-probs, EOS and whatever follows it
        included; with ``top``, each token's ``top`` most likely rivals (``alternatives``)."""
        ids, mask = left_pad(contexts, self.pad_id)
        cfg = self.cfg
        temperature = cfg.temperature if temperature is None else temperature
        sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if temperature > 0:
            sampling = {
                "do_sample": True,
                "temperature": temperature,
                "top_p": cfg.top_p,
                "top_k": cfg.top_k or None,
            }
        stop = StoppingCriteriaList([_Flag(self.should_stop)]) if self.should_stop else None
        stops = sorted(self.stops)
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            **sampling,
            max_new_tokens=max_new,
            min_new_tokens=0,
            pad_token_id=self.pad_id,
            # one id as before multi-turn (single-turn runs stay bitwise as they were)
            eos_token_id=stops[0] if len(stops) == 1 else (stops or None),
            output_logits=True,
            return_dict_in_generate=True,
            stopping_criteria=stop,
        )
        responses = out.sequences[:, ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float() / (temperature or 1.0)  # (B, L', V)
        every = torch.log_softmax(logits, dim=-1)
        log_probs = every.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        rivals = alternatives(every, top) if top else None
        return responses.cpu().tolist(), log_probs.cpu().tolist(), rivals

    def generate(
        self, prompts: list[list[int]], n: int, temperature: float | None = None
    ) -> list[Generation]:
        """Sample n responses for every prompt (token ids), to completion."""
        keys = [("generate", i) for i in range(len(prompts))]
        for key, prompt in zip(keys, prompts, strict=True):
            self.submit(key, prompt, n, temperature)
        results: dict[Hashable, Generation] = {}
        while len(results) < len(keys):
            results.update(self.step())
        return [results[key] for key in keys]

    # The step interface of the rollout loop: one step generates every response in flight, all
    # in one batch, to its end (or to the stop flag), or ``rollout.hf_step_tokens`` tokens
    # further: then groups finish (and new ones join) between steps, and the next step
    # continues the others on the batch it holds (their keys and values kept: only rows
    # new to it are prefilled; after new weights, every row is, so each token is the
    # loaded weights' and records their version).
    @property
    def in_flight(self) -> int:
        return len(self.groups)

    def submit(
        self, key: Hashable, prompt: list[int], n: int, temperature: float | None = None
    ) -> None:
        if key in self.groups:
            raise ValueError(f"a prompt group with key {key!r} is already in flight")
        self.groups[key] = ResponseGroup(list(prompt), [Response() for _ in range(n)], temperature)

    def resume(self, key: Hashable, partial: PartialGroup) -> None:
        """Continue a group cut earlier (e.g. by a checkpoint before a stop) from its tokens."""
        if key in self.groups:
            raise ValueError(f"a prompt group with key {key!r} is already in flight")
        self.groups[key] = ResponseGroup.of(partial, self.turn_ends)

    def step(self) -> list[tuple[Hashable, Generation]]:
        rows = [
            (key, r) for key, group in self.groups.items() for r in group.responses if r.runnable
        ]
        by_temperature: dict[float | None, list[tuple[Hashable, Response]]] = {}
        for key, r in rows:  # one batch per sampling temperature (validation's is its own)
            by_temperature.setdefault(self.groups[key].temperature, []).append((key, r))
        for temperature in list(self.resident):
            if temperature not in by_temperature:  # none of its rows runs now
                self.resident.pop(temperature).clear()
        for temperature, batch in by_temperature.items():
            if self.cfg.hf_step_tokens > 0:
                self.continue_batch(temperature, batch)
            else:
                self.sample_batch(temperature, batch)
        done = [key for key, group in self.groups.items() if group.complete]
        width, pad = self.cfg.response_length, self.pad_id
        return [(key, self.groups.pop(key).generation(width, pad)) for key in done]

    def ends(self, r: Response) -> int:
        """Where ``r``'s current turn stops: the room's end, or the gateway's limit."""
        width = self.cfg.response_length
        return min(width, r.limit or width)

    def take(self, r: Response, ids: list[int], lps: list[float],
             rivals: list[list[tuple[int, float]]] | None = None) -> None:  # fmt: skip
        """Append sampled tokens to ``r`` up to its first stop token or its end (both
        included), and end its turn there; a gateway call's own stop tokens and strings
        (``Response.stop_ids``, ``stop_texts``) end it too. ``rivals``: each token's most
        likely tokens, kept where ``r.top`` asks."""
        end = self.ends(r)
        take = ids[: end - len(r.tokens)]
        stops = self.stops if r.stop_ids is None else r.stop_ids
        stop = next((i for i, t in enumerate(take) if t in stops), None)
        if stop is not None:
            take = take[: stop + 1]
        if r.top and rivals is not None:
            r.alternatives.update((len(r.tokens) + i, rivals[i][: r.top]) for i in range(len(take)))
        r.tokens += take
        r.log_probs += lps[: len(take)]
        r.versions += [self.version] * len(take)
        if r.stop_texts and r.stop_at_text(self._decode_list):
            stop = len(r.tokens)  # a gateway call's stop string ended the turn
        if stop is not None or len(r.tokens) >= end:
            r.end_turn(self.cfg.response_length, bool(self.turn_ends))

    def _decode_list(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def sample_batch(self, temperature: float | None, batch: list[tuple[Hashable, Response]]):
        """One ``generate`` call over the batch, to its longest response's end."""
        contexts = [self.groups[key].context(r) for key, r in batch]
        budget = max(self.ends(r) - len(r.tokens) for _, r in batch)
        top = max(r.top for _, r in batch)
        new_ids, new_lps, rivals = self.sample(contexts, budget, temperature, top)
        for i, ((_, r), ids, lps) in enumerate(zip(batch, new_ids, new_lps, strict=True)):
            self.take(r, ids, lps, rivals[i] if rivals else None)

    @torch.no_grad()
    def continue_batch(self, temperature: float | None, batch: list[tuple[Hashable, Response]]):
        """``rollout.hf_step_tokens`` tokens of every row, on the batch held from the last
        step (``ResidentBatch``: only rows new to it are prefilled). A row leaves the batch
        as soon as its turn ends; the step ends early when none is left or when
        ``should_stop()`` turns true."""
        held = self.resident.get(temperature)
        if held is None:
            held = self.resident[temperature] = ResidentBatch(self.model, self.device)
        held.hold([(r, self.groups[key].context(r)) for key, r in batch])
        cfg = self.cfg
        temperature = cfg.temperature if temperature is None else temperature
        for _ in range(cfg.hf_step_tokens):
            if self.should_stop is not None and self.should_stop():
                break
            tokens, lps = sample_tokens(held.logits, temperature, cfg.top_p, cfg.top_k)
            top = max(r.top for r in held.owners)
            rivals = None
            if top:
                scaled = held.logits / (temperature or 1.0)
                rivals = alternatives(torch.log_softmax(scaled, dim=-1).unsqueeze(1), top)
            going = []
            for i, (r, token, lp) in enumerate(
                zip(held.owners, tokens.tolist(), lps.tolist(), strict=True)
            ):
                self.take(r, [token], [lp], rivals[i] if rivals else None)
                if r.runnable:
                    going.append(i)
            if not going:
                held.clear()
                break
            held.select(going)
            held.advance(tokens[going])

    @property
    def stops(self) -> set[int]:
        """The tokens a response stops at: EOS (unless ignore_eos) and those ending a turn."""
        return set(self.turn_ends) | (set() if self.cfg.ignore_eos else {self.eos_id})

    def interrupt(self) -> None:
        """Nothing runs between steps; a step cut by ``should_stop`` keeps its tokens."""

    def unfinished(self) -> list[tuple[Hashable, PartialGroup]]:
        """Every group in flight with its tokens so far (for a checkpoint)."""
        width, pad = self.cfg.response_length, self.pad_id
        return [(key, group.partial(width, pad)) for key, group in self.groups.items()]

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
        receiver reuses their memory), so nothing beyond the model is held here.

        A sync of LoRA adapters (``models/lora.py``: every name an adapter's) is merged
        into the base instead (``load_adapters``)."""
        if specs and all(lora.is_wire_adapter(name) for name, _, _ in specs):
            self.load_adapters(specs, buckets, version)
            return
        self.check_weights(specs)
        self.drop_resident()
        self.adapters = None
        self.merged = list(self._params)  # a later LoRA sync starts from the base again
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

    @torch.no_grad()
    def load_adapters(
        self,
        specs: list[tuple[str, tuple[int, ...], torch.dtype]],
        buckets: Iterable[dict[str, torch.Tensor]],
        version: int,
    ) -> None:
        """A LoRA sync: the adapters (kept: a few megabytes, and what the digest covers),
        then each targeted weight set to base + B @ A, the base read from the model's files
        at the first sync and held (``lora.BaseWeights``). Whole or not at all: nothing is
        loaded before every adapter has come."""
        names = {name for name, _, _ in specs}
        adapters = {n: t.clone() for bucket in buckets for n, t in bucket.items()}
        if set(adapters) != names:
            raise RuntimeError(f"a LoRA sync ended without {sorted(names - set(adapters))[:5]}")
        if self.base is None:
            self.base = lora.BaseWeights(self.model_path)
        targets = lora.base_targets(adapters)
        missing = [n for n in targets if n not in self._params]
        if missing:
            raise ValueError(f"LoRA sync: the rollout model has no weight {missing[0]!r}")
        dtype = next(iter(self._params.values())).dtype
        # a weight that an earlier sync changed (adapters this one's do not target, or a
        # full sync) gets its base back
        targeted = set(targets)
        weights = targets + [n for n in self.merged if n not in targeted]
        merged = lora.merged_weights(adapters, self.base.read(weights), dtype, everything=True)
        self.drop_resident()
        for name, tensor in merged:
            self._params[name].copy_(tensor)
        self.merged = targets
        self.adapters = adapters
        self.version = version

    def drop_resident(self) -> None:
        """New weights: the keys and values held are the old weights'; every row in flight
        is prefilled again at the next step."""
        for held in self.resident.values():
            held.clear()
        self.resident = {}

    def weight_destination(self, name: str) -> torch.Tensor | None:
        """The parameter's own storage: a sync receives large tensors straight into it."""
        param = self._params.get(name)
        return None if param is None else param.detach()

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int = -1) -> None:
        """Load a whole set of weights at once (one bucket of everything)."""
        specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        self.load_buckets(specs, [tensors], version)

    # --- the weight group: this rank is its own (only) member ---------------------------
    stages_weights = True  # a sync can be received while generating, into a staging copy

    def join_weights(self, spec: WeightGroupSpec, first_rank: int) -> None:
        """Join the weight group as rank ``first_rank``; blocks until the group has met.
        The generation it replaces, if any, is aborted first (``WeightGroup.close``)."""
        if self.receiver is not None:
            self.receiver.group.close()
        group = open_weight_group(spec, first_rank)
        self.receiver = WeightReceiver(group, 0, spec.bucket_device(self.device), self.device)

    def update_weights(self, expected: int, digest: bool = False) -> WeightUpdate:
        """Receive the next sync now and load it as it arrives: large tensors straight into
        the parameters, the rest bucket by bucket (nothing beyond two buckets is held)."""
        start = time.monotonic()
        incoming = self.receiver.receive()
        check_version(expected, incoming.version, "rollout rank")
        buckets = incoming.buckets(into=self.weight_destination)
        self.load_buckets(incoming.specs(), buckets, incoming.version)
        return self._loaded(start, digest)

    def receive_staged(self, staging: dict[str, torch.Tensor]) -> Background:
        """Receive the next sync on a side thread into ``staging`` while generation goes
        on (``WeightReceiver.receive_staged``); ``load_staged`` loads it."""
        return self.receiver.receive_staged(staging)

    def load_staged(
        self, expected: int, received: tuple, staging: dict[str, torch.Tensor], digest: bool
    ) -> WeightUpdate:
        """Load a sync received by ``receive_staged`` (``received``: its result)."""
        start = time.monotonic()
        version, specs = received
        check_version(expected, version, "rollout rank")
        self.load_buckets(specs, [staging], version)
        return self._loaded(start, digest)

    def _loaded(self, start: float, digest: bool) -> WeightUpdate:
        """The digest covers what the leader sent: the weights, or the LoRA adapters."""
        held = self.named_parameters() if self.adapters is None else list(self.adapters.items())
        digests = [weights_digest(held) if digest else ""]
        return WeightUpdate(self.version, digests, time.monotonic() - start)

    def close(self) -> None:
        pass
