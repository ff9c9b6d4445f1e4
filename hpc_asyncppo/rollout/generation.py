"""What both rollout engines produce and the trainer consumes: ``Generation`` (a prompt's n
responses, their log-probs and per-token weight versions), ``PartialGroup`` (a group cut
before its end: what a checkpoint keeps of it), and where a response ends.

An agent's session whose call did not extend its conversation goes on in a new sequence
(``rollout/gateway/``): a further response of its group, with its own prompt. Such a group
has more rows than sessions: its first n rows are the sessions' first sequences, each
later row names its session (``row_sessions``) and carries its prompt (``row_prompts``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from hpc_asyncppo.loss_mask import observation_spans


@dataclass
class Generation:
    """The n responses to one prompt. Shapes: (n, L) for ids, log-probs and versions, (n,) for
    lengths. ``versions``: the weights version that sampled each token (-1 past the length).
    ``loss_mask`` (n, L) int8, multi-turn only: 0 on observation tokens (a tool's or an
    environment's answer: log-prob 0, version -1, never trained); None when every token
    is the model's. Agents' groups with several sequences in a session (m rows for n
    sessions): ``row_sessions`` (m,) the session of each row, ``row_prompts`` (m, P) each
    row's prompt, -1 past its end; None when row j is session j's only sequence."""

    response_ids: np.ndarray
    response_lengths: np.ndarray
    log_probs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray | None = None
    row_sessions: np.ndarray | None = None
    row_prompts: np.ndarray | None = None


@dataclass
class PartialGroup:
    """A group whose n responses have not all finished: ``sofar`` holds each response's
    tokens, log-probs and versions so far (``response_lengths``: how many; the EOS
    included once ``finished``). An engine continues it from there (``resume``)."""

    prompt: list[int]
    sofar: Generation
    finished: np.ndarray  # (n,) bool
    # multi-turn, from a checkpoint: what the tools keep of its trajectories (turns.py)
    tools: dict | None = None

    @property
    def tokens(self) -> int:
        """Response tokens sampled so far, over the n responses."""
        return int(self.sofar.response_lengths.sum())


@dataclass
class Response:
    """One of a group's n responses as an engine samples it: its tokens so far, their
    log-probs, and the weights version that sampled each. Multi-turn: ``observe`` appends
    an observation (context the engines continue from, as they continue from any tokens
    so far; never trained), and ``observations`` keeps where each one lies."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    request_id: str | None = None  # vllm: the request generating it now; None: not running
    observations: list[tuple[int, int]] = field(default_factory=list)  # [start, end) spans
    # multi-turn: the model's turn ended (EOS, or a call's end) with room left; the rank decides
    # (``turns.py``) whether an observation follows or the response is finished. The
    # engines generate nothing for it meanwhile.
    waiting: bool = False
    # the gateway: the model's current turn stops at this many tokens (a call's max_tokens;
    # None: at the room's end); the engines generate up to it, the response then waits
    limit: int | None = None
    # the gateway: a later sequence of session ``session`` (its call did not extend the
    # conversation), generated after ``prompt``; None: the group's prompt, its own session
    prompt: list[int] | None = None
    session: int | None = None
    # the gateway: the current turn's own stop tokens (None: the engine's) and stop
    # strings, looked for in the turn's text from ``turn_start`` on
    stop_ids: frozenset[int] | None = None
    stop_texts: tuple[str, ...] = ()
    turn_start: int = 0
    # the gateway: a call's top_logprobs (0: none): each token the engine samples gets the
    # ``top`` most likely tokens at its place with their log-probs (the sampled token's
    # quantity), by position in ``tokens`` (not kept in checkpoints)
    top: int = 0
    alternatives: dict[int, list[tuple[int, float]]] = field(default_factory=dict)

    def observe(self, tokens: list[int]) -> None:
        """Append a tool's or an environment's answer (log-prob 0, version -1)."""
        start = len(self.tokens)
        self.tokens += tokens
        self.log_probs += [0.0] * len(tokens)
        self.versions += [-1] * len(tokens)
        self.observations.append((start, len(self.tokens)))

    def end_turn(self, width: int, multi_turn: bool) -> None:
        """The engine stopped this response at a stop token (EOS; multi-turn: a token that
        ends a turn) or at ``width`` tokens: finished, unless multi-turn and room is left:
        then its turn ended, and it waits."""
        if multi_turn and len(self.tokens) < width:
            self.waiting = True
        else:
            self.finished = True

    def stop_at_text(self, decode: Callable[[list[int]], str]) -> bool:
        """The turn's text holds one of ``stop_texts``: its tokens are cut after the token
        that completed the first (those after it as if never sampled: the sample stops
        where its stopping rule says), and True; the engine then ends the turn."""
        turn = self.tokens[self.turn_start :]
        if not self.stop_texts or not any(s in decode(turn) for s in self.stop_texts):
            return False
        k = next(k for k in range(1, len(turn) + 1)
                 if any(s in decode(turn[:k]) for s in self.stop_texts))  # fmt: skip
        end = self.turn_start + k
        del self.tokens[end:], self.log_probs[end:], self.versions[end:]
        return True

    @property
    def runnable(self) -> bool:
        """An engine may generate for it now."""
        return not self.finished and not self.waiting


@dataclass
class ResponseGroup:
    """A prompt and its n responses in the making: what both engines keep per group."""

    prompt: list[int]
    responses: list[Response]
    temperature: float | None = None  # None: rollout.temperature; 0: greedy

    @property
    def complete(self) -> bool:
        return all(r.finished for r in self.responses)

    def context(self, r: Response) -> list[int]:
        """What the engine continues ``r`` from: its prompt and its tokens so far."""
        return (self.prompt if r.prompt is None else r.prompt) + r.tokens

    @classmethod
    def of(cls, partial: PartialGroup, turn_ends: frozenset[int] = frozenset()) -> ResponseGroup:
        """A cut group, to continue from its tokens. ``turn_ends`` (multi-turn: the tokens
        that end a turn): a response cut right after the model's turn ended waits (its
        tool calls run again, ``turns.py``)."""
        g = partial.sofar
        responses = []
        for j, length in enumerate(g.response_lengths.tolist()):
            r = Response(
                g.response_ids[j, :length].tolist(),
                g.log_probs[j, :length].tolist(),
                g.versions[j, :length].tolist(),
                bool(partial.finished[j]),
                observations=observation_spans(g.loss_mask[j, :length])
                if g.loss_mask is not None
                else [],
            )
            if g.row_sessions is not None and int(g.row_sessions[j]) != j:  # a later sequence
                r.session = int(g.row_sessions[j])
                r.prompt = [int(t) for t in g.row_prompts[j] if t >= 0]
            last_is_model = not r.observations or r.observations[-1][1] < length
            r.waiting = (
                not r.finished and length > 0 and r.tokens[-1] in turn_ends and last_is_model
            )
            responses.append(r)
        return cls(list(partial.prompt), responses)

    def generation(self, width: int, pad_id: int) -> Generation:
        """Right-padded arrays, lengths including the EOS, log-probs 0 and versions -1 past it."""
        n = len(self.responses)
        ids = np.full((n, width), pad_id, dtype=np.int32)
        log_probs = np.zeros((n, width), dtype=np.float32)
        versions = np.full((n, width), -1, dtype=np.int32)
        lengths = np.zeros(n, dtype=np.int32)
        loss_mask = None
        if any(r.observations for r in self.responses):
            loss_mask = np.ones((n, width), dtype=np.int8)
        for j, r in enumerate(self.responses):
            length = lengths[j] = len(r.tokens)
            ids[j, :length], log_probs[j, :length], versions[j, :length] = (
                r.tokens,
                r.log_probs,
                r.versions,
            )
            for start, end in r.observations:
                loss_mask[j, start:end] = 0
        sessions = prompts = None
        if any(r.session is not None for r in self.responses):
            sessions = np.array([j if r.session is None else r.session
                                 for j, r in enumerate(self.responses)], dtype=np.int32)  # fmt: skip
            rows = [self.prompt if r.prompt is None else r.prompt for r in self.responses]
            prompts = np.full((n, max(map(len, rows))), -1, dtype=np.int32)
            for j, prompt in enumerate(rows):
                prompts[j, : len(prompt)] = prompt
        return Generation(ids, lengths, log_probs, versions, loss_mask, sessions, prompts)

    def partial(self, width: int, pad_id: int) -> PartialGroup:
        """This group cut where it stands (for a checkpoint)."""
        finished = np.array([r.finished for r in self.responses], dtype=bool)
        return PartialGroup(list(self.prompt), self.generation(width, pad_id), finished)


def response_lengths(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Tokens up to and including the first EOS, or the full width if there is none. (B, L) -> (B,)"""
    is_eos = responses == eos_id
    first = torch.where(is_eos.any(dim=1), is_eos.float().argmax(dim=1), responses.shape[1] - 1)
    return first + 1
