"""The rollout rank's side of the gateway: each session is one of the engine's responses.

A prompt row the leader granted becomes a group of n sessions (``rollout.n``, a GRPO
group), named like the samples they become (``s{seed}-e{epoch}-p{index}-r{j}``). Nothing
is generated for a session until its agent calls: the first call's messages, rendered
by ``chat.py``, are the group's prompt (every session of a group must start from the same
prompt tokens: the group is one prompt and n responses). The engine then generates the
model's turn, as it generates a multi-turn trajectory's (``rollout/turns.py``): it stops
at EOS or at a tool call's end and the response *waits*; the call is answered with that
turn. The agent's next call appends tool or user messages: their tokens are an
observation (loss mask 0) and the response runs again. The agent ends its session with
a reward; once all n have ended, the engine returns the group and the rank sends it.

A call that does not extend the conversation (its history rewritten, summarised or
branched: ``chat.py``) does not end the session: the session goes on in a new sequence,
the call's messages rendered whole as its prompt, generated as a further response of
the group (``Response.prompt``) with its own ``rollout.response_length`` of room. The
sequence before it ends where it stands. Each sequence is trained as a sample with its
session's reward; the group's advantages are taken over its n sessions (one reward each)
and every sequence of a session gets its session's (``trainer/batch.py``). A session
starts at most ``gateway.max_sequences``.

A session's calls need not come one at a time: a call made while its turn runs (a
sub-agent, a side call on the same base URL) goes on a *line* beside the session's own
(``Sessions.sides``): a further sequence of the session, with its own conversation; each
later call goes on the first line free whose conversation it extends, else starts a new
sequence (on the session's own line if it is free). The same call again, while its turn
runs or after it (a client's retry), is answered with the same turn.

A streamed call (``stream: true``) is told its turn's new tokens after every engine step
(``post``'s ``progress``, called on the rank's loop with a ``streaming.Progress``): its
door sends them as they come (``streaming.py``).

Calls come from the HTTP server's thread (``post``, ``end``: thread-safe, each answered
through a ``Future``); everything that touches the engine happens on the rank's loop, in
``advance``, between two engine steps, so neither engine is ever entered from another
thread. A session that fails (its agent raised, timed out, returned no number, never
called, or its first call rendered another prompt than its group's) ends its response
as it stands; its group is sent with a reason to drop it (``SampleGroup.dropped``): the
leader records its samples as dropped and trains none of them, and the rank goes on.

A stop signal fails the calls in flight with 503 and refuses new ones: the groups in
flight are cut into the checkpoint as any are (each session's tokens so far: its calls'
prompts, observations and the model's turns), and after the resume their prompts run
again from the start, agents included, so every session is trained once or not at all.
Where the cut tokens may continue (partial rollout, or the same weights version) they
are the session's *recording*: a re-run agent's call that renders what the recording
holds at that point (the same prompt, then the same observation tokens) is answered
with the recorded turn (its tokens, log-probs and versions), not generated again, until
the first call that differs; from there the engine generates, and the recording's rest
is thrown away (``tokens_regenerated`` counts it). A session cut in a later sequence is
recorded with all of them: a re-run call that starts a new sequence with the prompt the
next recorded one had goes on replaying it. A deterministic agent thus resumes where it
stopped. A checkpoint without a stop keeps the sessions going.

Memory: per session in flight, its conversation (the messages, ``chat.py``) and a few
numbers; the tokens are the engine's (``gateway.max_sequences`` x
``rollout.response_length`` at most), and a resumed session's recording until it is
replayed or thrown away (as many).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpc_asyncppo.config import MultiTurnConfig
from hpc_asyncppo.rollout.gateway.chat import Answer, Conversation, NotExtending, opened_thinking
from hpc_asyncppo.rollout.gateway.requests import Call, RequestError
from hpc_asyncppo.rollout.gateway.streaming import Progress
from hpc_asyncppo.rollout.generation import Generation, PartialGroup, Response, ResponseGroup
from hpc_asyncppo.rollout.turns import call_end_ids
from hpc_asyncppo.tasks import Prompt
from hpc_asyncppo.tools.tool_parsers import PARSERS, ToolParser

log = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """The agent fails every session (``Sessions.broken``): the run stops, naming its error;
    the job does not restart for it (``launch/job_restarts.py``: the input is wrong)."""


@dataclass
class Result:
    """A call's answer and its exact tokens: the context the model saw (the sequence's
    prompt and every token after it), the turn's tokens (what the model sampled, after any
    opening the gateway put at its start: log-prob 0, version -1), their log-probs and the
    weights version of each; the call it answers."""

    session: str
    answer: Answer
    prompt_ids: list[int]
    token_ids: list[int]
    log_probs: list[float]
    versions: list[int]
    call: Call | None = None
    retried: bool = False  # the answer to the same call before, given again
    # the call's top_logprobs: each turn token's most likely tokens and their log-probs
    # (none for an opening, or a turn replayed from a recording)
    alternatives: list[list[tuple[int, float]]] | None = None

    def notes(self) -> dict[str, Any]:
        """The answer's ``hpc_asyncppo`` extension: what was not done as asked, and whether
        this is the answer a call before got (a retry: its tokens are trained once)."""
        notes = self.call.notes() if self.call is not None else {}
        return {**notes, "retried": True} if self.retried else notes


@dataclass
class Session:
    id: str
    key: Hashable  # its group's
    j: int  # its response in the group
    prompt: Prompt
    conversation: Conversation
    started: float | None = None  # when its agent took it (gateway.agent_timeout_s from then)
    opened: bool = False  # its first call reached the engine
    call: tuple[Call, Future] | None = None  # the call the engine is answering
    retries: list[Future] = field(default_factory=list)  # the same call again, meanwhile
    # a streamed call: told the turn's new tokens after each engine step; how many it has
    progress: Callable[[list[int]], None] | None = None
    reported: int = 0
    last: tuple[Call, Result] | None = None  # the call answered last (a retry gets it again)
    turn_start: int = 0  # where the model's current turn starts in the response
    answered: float | None = None  # when its last call was answered (its agent's turn now)
    calls: int = 0
    reward: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    overridden: dict[str, int] = field(default_factory=dict)  # its calls' sampling fields
    failure: str | None = None
    # resumed from a checkpoint: its response as it was cut; the agent's calls that render
    # the same tokens are answered from it, until the first that differs
    recorded: Response | None = None
    replayed_to: int = 0  # its response's tokens so far that the recording gave
    later: list[Response] = field(default_factory=list)  # its later sequences' recordings
    # its current sequence: the group's row, and its prompt (None: the group's)
    row: int = -1
    sequence_prompt: list[int] | None = None
    sequences: int = 1

    def __post_init__(self) -> None:
        self.row = self.j if self.row == -1 else self.row  # -2: a side line, no sequence yet

    @property
    def ended(self) -> bool:
        return self.reward is not None or self.failure is not None


class Sessions:
    """The sessions of one rollout rank (``advance`` between every two engine steps)."""

    def __init__(
        self,
        tokenizer: Any,
        eos_id: int,
        width: int,
        max_prompt_length: int,
        timeout_s: float,
        start_agent: Callable[[Session], None] | None = None,
        gather_s: float = 0.0,
        max_sequences: int = 32,
        parser: ToolParser = PARSERS["hermes"],
        on_failure: str = "drop",
        failure_reward: float = 0.0,
    ):
        """``width``: rollout.response_length (the model's and the observations' tokens
        together). ``start_agent``: runs ``data.agent`` for a new session (``agents.py``);
        None: external agents drive the sessions. ``gather_s``: how long the engine waits
        for the next calls of sessions just answered before it generates for those that
        came (the hf engine generates a whole turn per step: a turn started alone is a
        batch of one; vLLM adds requests at every decoding step: 0). ``max_sequences``,
        ``parser``, ``on_failure``, ``failure_reward``: gateway.max_sequences,
        gateway.tool_parser's, gateway.on_session_failure, gateway.failure_reward."""
        self.gather_s, self.max_sequences, self.parser = gather_s, max_sequences, parser
        self.on_failure, self.failure_reward = on_failure, failure_reward
        self.tokenizer, self.eos_id, self.width = tokenizer, eos_id, width
        self.max_prompt_length, self.timeout_s = max_prompt_length, timeout_s
        self.start_agent = start_agent
        self.call_ends = frozenset(call_end_ids(tokenizer, MultiTurnConfig()))
        self.turn_ends = frozenset({eos_id, *self.call_ends})
        self.lock = threading.Lock()
        self.inbox: deque[tuple[str, str, Any, Future]] = deque()  # from other threads
        self.by_id: dict[str, Session] = {}
        self.groups: dict[Hashable, list[Session]] = {}
        self.prompts: dict[Hashable, list[int]] = {}  # each group's prompt, once it has one
        # groups the engine finished (no room left, or every session ended) whose sessions
        # have not all ended: sent once their agents give the rewards
        self.held: dict[Hashable, Generation] = {}
        self.stopping: str | None = None
        self.reopened: dict[Hashable, int] = {}  # groups in flight opened more than once
        self.temperatures: dict[Hashable, float] = {}  # groups not at the run's temperature
        self.recorded_prompts: dict[Hashable, list[int]] = {}  # resumed groups' prompts
        # groups submitted with a stand-in prompt (a session failed before any called)
        self.placeholders: set[Hashable] = set()
        self.sides: dict[str, list[Session]] = {}  # the lines beside a session's own
        self.replayed_calls = 0  # answered from a cut session's recording
        self.replayed_tokens = 0  # the model's tokens those answers kept
        self.discarded_tokens = 0  # recorded tokens after the first call that differed
        self.retried_calls = 0  # a call the same as the one before: answered with its turn
        self.overridden: dict[str, int] = {}  # calls whose sampling field was replaced
        # the agents' failures (``broken``): in a row, and the last sessions' outcomes
        self.failed_in_row, self.last_failure = 0, ""
        self.outcomes: deque[bool] = deque(maxlen=256)  # True: failed

    # --- other threads: the server and the agents -----------------------------------------
    def post(self, session_id: str, call: Call,
             progress: Callable[[Progress], None] | None = None) -> Future:  # fmt: skip
        """A call for the rank's loop; its Future gets a ``Result`` or a ``RequestError``.
        ``progress`` (a streamed call): called on the rank's loop with the turn's new
        tokens after each engine step that made some, before the Future's result; it must
        not block (the server's: a put on its event loop)."""
        return self._put("call", session_id, (call, progress))

    def conversation(self, session_id: str) -> Conversation:
        return Conversation(self.tokenizer, session_id, self.parser)

    def end(self, session_id: str, reward: Any) -> Future:
        """The agent's end of a session: a reward (a number, or a dict with ``reward``
        and extra numbers to log), or an exception (the agent failed)."""
        return self._put("end", session_id, reward)

    def _put(self, what: str, session_id: str, payload: Any) -> Future:
        future: Future = Future()
        with self.lock:
            session = self.by_id.get(session_id)
            if self.stopping and what == "call":
                future.set_exception(RequestError(503, self.stopping, kind="run_stopping"))
            elif session is None or session.ended:
                future.set_exception(
                    RequestError(
                        404,
                        f"no session {session_id!r} in flight on this rank",
                        kind="not_found_error",
                    )
                )
            else:
                self.inbox.append((what, session_id, payload, future))
        return future

    # --- the rank's loop ------------------------------------------------------------------
    def open_group(
        self, key: Hashable, uid_prefix: str, prompt: Prompt, n: int,
        recorded: PartialGroup | None = None, temperature: float | None = None,
    ) -> None:  # fmt: skip
        """A granted prompt row: n sessions, each with its agent started (if any).
        ``recorded``: the group as a checkpoint cut it (its sessions' calls so far): an
        agent that calls as it did before is answered from it (``_replay``).
        ``temperature``: the group's, if not the run's (validation's)."""
        # a group opened again on this rank (its engine restarted under new weights) gets
        # new session ids: the old agents' late calls find no session
        again = self.reopened[key] = self.reopened.get(key, -1) + 1
        group = [
            Session(f"{uid_prefix}-r{j}" + (f".{again}" if again else ""), key, j, prompt,
                    self.conversation(f"{uid_prefix}-r{j}"))
            for j in range(n)
        ]  # fmt: skip
        if recorded is not None and recorded.sofar.response_lengths.any():
            self.recorded_prompts[key] = list(recorded.prompt)
            responses = ResponseGroup.of(recorded).responses
            for s, r in zip(group, responses[:n], strict=True):
                s.recorded = r if r.tokens else None
            for r in responses[n:]:  # later sequences, in the order they started
                group[r.session].later.append(r)
        if temperature is not None:
            self.temperatures[key] = temperature
        with self.lock:
            self.groups[key] = group
            self.by_id.update((s.id, s) for s in group)
        if self.start_agent is not None:
            for s in group:
                s.started = time.monotonic()
                self.start_agent(s)

    def claim(self) -> Session | None:
        """External agents (``data.agent=external``): a session no agent has taken yet, now
        taken (its time starts), or None when every session in flight is taken."""
        with self.lock:
            if self.start_agent is not None:
                raise RequestError(400, "this run's sessions are run by its data.agent "
                                   "function: there are none to claim")  # fmt: skip
            if self.stopping:
                raise RequestError(503, self.stopping, kind="run_stopping")
            for group in self.groups.values():
                for s in group:
                    if s.started is None and not s.ended:
                        s.started = time.monotonic()
                        return s
        return None

    @property
    def in_flight(self) -> int:
        with self.lock:
            return len(self.by_id)

    def live(self, key: Hashable) -> bool:
        return key in self.groups

    def reattach(self, key: Hashable, engine: Any) -> None:
        """A group continued on a restarted engine from its tokens: the responses of
        sessions that have not called yet wait again, those ended stay ended."""
        for s in self.groups[key]:
            r = self._response(engine, s)
            if s.ended:
                r.waiting, r.finished = False, True
            elif not s.opened:
                r.waiting = True

    def advance(self, engine: Any) -> bool:
        """Answer the calls whose turns ended, take in what came, end the sessions out of
        time. True when the engine should step now: a group is complete, or a response
        may run and no session answered within ``gather_s`` is still to call."""
        for group in self.groups.values():
            for line in (x for s in group for x in self._lines(s)):
                if line.call is not None:
                    r = self._response(engine, line)
                    if r is not None and (
                        r.finished or (r.waiting and len(r.tokens) > line.turn_start)
                    ):
                        self._answer(engine, line, r)
                    elif r is not None and line.progress is not None:
                        self._report(line, r)
        while True:
            with self.lock:
                if not self.inbox:
                    break
                what, session_id, payload, future = self.inbox.popleft()
            s = self.by_id.get(session_id)
            if s is None or s.ended:
                future.set_exception(RequestError(404, f"session {session_id!r} has ended",
                                                  kind="not_found_error"))  # fmt: skip
                continue
            try:
                if what == "call":
                    self._call(engine, s, *payload, future)
                else:
                    self._end(engine, s, payload)
                    future.set_result(None)
            except RequestError as exc:
                future.set_exception(exc)
        now = time.monotonic()
        for group in self.groups.values():
            for s in group:
                if not s.ended and s.started is not None and now - s.started > self.timeout_s:
                    self._fail(engine, s, f"its agent did not end it within "
                               f"gateway.agent_timeout_s={self.timeout_s:g} s")  # fmt: skip
        if any(g.complete for g in engine.groups.values()):
            return True
        if not any(r.runnable for g in engine.groups.values() for r in g.responses):
            return False
        return not any(
            s.call is None and not s.ended and s.answered is not None
            and now - s.answered < self.gather_s
            for group in self.groups.values() for s in group
        )  # fmt: skip

    def step(
        self, engine: Any, generate: Callable[[], list[tuple[Hashable, Generation]]]
    ) -> list[tuple[Hashable, Generation]]:
        """One pass of the rank's loop: ``advance``, then ``generate`` (the engine's step)
        if it is time; the groups whose sessions have all ended, to send."""
        if self.advance(engine):
            for key, gen in generate():
                self.hold(key, gen)
        else:
            time.sleep(0.002)  # the agents have the turn
        ready = [key for key in self.held if all(s.ended for s in self.groups[key])]
        return [(key, self.held.pop(key)) for key in ready]

    def hold(self, key: Hashable, gen: Generation) -> None:
        """A group the engine finished: a call whose turn ended it (no room left) is
        answered from ``gen``; the group waits for its sessions' rewards."""
        for s in (x for session in self.groups[key] for x in self._lines(session)):
            if s.call is not None:
                length, row = int(gen.response_lengths[s.row]), s.row
                self._answer_with(
                    s, gen.response_ids[row, :length].tolist(),
                    gen.log_probs[row, :length].tolist(), gen.versions[row, :length].tolist(),
                    finished=True,
                )  # fmt: skip
        self.held[key] = gen

    def _response(self, engine: Any, s: Session) -> Response | None:
        """The session's current sequence, as the engine keeps it; None once its group is
        held."""
        if s.key in self.held or s.row < 0:
            return None
        return engine.groups[s.key].responses[s.row]

    def _report(self, line: Session, r: Response) -> None:
        """A streamed call's turn grew: its new tokens, to its door."""
        if len(r.tokens) > line.reported:
            line.progress(r.tokens[line.reported :])
            line.reported = len(r.tokens)

    def _context(self, s: Session) -> list[int]:
        """The prompt of the line's current sequence."""
        return s.sequence_prompt or self.prompts.get(s.key, [])

    def _call(self, engine: Any, s: Session, call: Call,
              progress: Callable[[Progress], None] | None, future: Future) -> None:  # fmt: skip
        lines = self._lines(s)
        for line in lines:
            if line.call is not None and line.call[0].same_request(call):
                line.retries.append(future)  # the client retried while the turn runs
                self.retried_calls += 1
                return
            if line.call is None and line.last is not None and line.last[0].same_request(call):
                self.retried_calls += 1  # a retry after the answer
                future.set_result(dataclasses.replace(line.last[1], retried=True))
                return
        for name in call.overridden:
            s.overridden[name] = s.overridden.get(name, 0) + 1
        if not s.opened:
            line, r = s, self._open(engine, s, call)
        else:
            line, r = self._extend(engine, [x for x in lines if x.call is None], call)
            if line is None:  # it extends no line free now: a new sequence, on the session's
                line = s if s.call is None else self._side(s)  # own line, or beside it
                r = self._new_sequence(engine, line, call)
                if r is None and line is not s:  # no sequence left for it: no side either
                    self.sides[s.id].remove(line)
        if r is None:  # out of room, or of sequences: the turn ends before it starts
            self._answer_empty(engine, line, call, future)
            return
        line.call = (call, future)
        line.turn_start = line.reported = len(r.tokens)
        line.progress = None
        if progress is not None:  # what the turn follows is fixed for the whole turn
            context = self._context(line) + r.tokens
            size, thinking = len(context), opened_thinking(self.tokenizer, context)
            line.progress = lambda tokens: progress(Progress(tokens, size, thinking))
        opening = self._opening(call)
        if opening and not r.finished:
            self._observe(r, opening)
        s.calls += 1
        r.limit = None if call.max_tokens is None else len(r.tokens) + call.max_tokens
        r.stop_ids = frozenset({self.eos_id, *call.stop_token_ids,
                                *(self.call_ends if not call.parallel_tool_calls else ())})  # fmt: skip
        r.stop_texts, r.turn_start = call.stop, len(r.tokens)
        r.top, r.alternatives = (call.top_logprobs if call.logprobs else 0), {}
        span = r.observations[-1] if r.observations and r.observations[-1][1] == len(r.tokens) \
            else None  # fmt: skip
        if r.finished:  # no room for the model's turn
            self._answer(engine, line, r)
        elif line.recorded is not None and self._replay(line, r, span):
            self._answer(engine, line, r)

    def _lines(self, s: Session) -> list[Session]:
        """A session's lines: its own, and those its concurrent calls opened beside it."""
        return [s, *self.sides.get(s.id, ())]

    def _side(self, s: Session) -> Session:
        """A line beside the session's own, for a call made while every line has one
        running (sub-agents, side calls on one base URL): its own sequences, the session's
        reward, its room counted with the session's sequences."""
        side = Session(s.id, s.key, s.j, s.prompt, self.conversation(s.conversation.session),
                       started=s.started, opened=True, row=-2)  # fmt: skip
        self.sides.setdefault(s.id, []).append(side)
        return side

    def _extend(self, engine: Any, lines: list[Session], call: Call
                ) -> tuple[Session | None, Response | None]:  # fmt: skip
        """The first of ``lines`` whose conversation the call extends, and its response
        with the call's messages observed (None: no room left for them); (None, None)
        when it extends none of them."""
        for line in lines:
            if line.row < 0:
                continue
            r = self._response(engine, line)
            full = r is None or r.finished
            after_eos = not full and bool(r.tokens) and r.tokens[-1] == self.eos_id
            # a sequence with no room left takes no observation: tried on a copy
            conversation = copy.copy(line.conversation) if full else line.conversation
            try:
                if call.kind == "chat":
                    ids = conversation.extend(call.messages, call.tools, after_eos,
                                              call.chat_template_kwargs)  # fmt: skip
                else:
                    ids = conversation.extend_text(call.prompt)
            except NotExtending:
                continue
            if full:  # no room for an observation, nor for the model's turn
                return line, None
            self._observe(r, ids)
            return line, r
        return None, None

    def _observe(self, r: Response, ids: list[int]) -> None:
        """Context before the model's turn (the call's messages, then any opening), as
        one observation, cut to the room; a response with no room left after it ends."""
        room = self.width - len(r.tokens)
        taken = ids[:room]
        if r.observations and r.observations[-1][1] == len(r.tokens):  # goes on the last
            start = r.observations.pop()[0]
            r.observe(taken)
            r.observations[-1] = (start, len(r.tokens))
        else:
            r.observe(taken)
        r.waiting = False
        if len(ids) >= room:
            r.finished = True

    def _opening(self, call: Call) -> list[int]:
        """What the turn starts with when the call requires a tool call (``tool_choice``
        required, or a function's name): the parser's opening, with the name where the
        tokenizer writes that text back exactly; context, never trained."""
        if call.tool_choice in ("auto", "none") or not call.tools:
            return []
        if call.named:
            named = self.parser.named(call.tool_choice)
            ids = self.tokenizer(named, add_special_tokens=False)["input_ids"]
            if self.tokenizer.decode(ids) == named:
                return list(ids)
        return list(self.tokenizer(self.parser.opening, add_special_tokens=False)["input_ids"])

    def _replay(self, s: Session, r: Response, span: tuple[int, int] | None) -> bool:
        """A resumed session's call: if it brought what its recording holds at this point
        (the first call: the group's recorded prompt; a later one: the same observation
        tokens, ``span``), the model's turn that followed is taken from the recording, not
        generated: True when that turn ended (answer it now); a turn the stop cut is
        taken as far as it went and the engine goes on from there. At the first call that
        differs the recording's rest is thrown away (``discarded_tokens``)."""
        rec = s.recorded
        if s.sequence_prompt is None:  # the session's first sequence: the group's prompt
            prompt = self.prompts[s.key] == self.recorded_prompts.get(s.key)
        else:
            prompt = rec.prompt == s.sequence_prompt
        same = (
            prompt
            and rec.tokens[: len(r.tokens)] == r.tokens
            and (span is None or span in rec.observations)
        )
        if not same:
            self._discard(s)
            return False
        end = next((a for a, _ in rec.observations if a >= len(r.tokens)), len(rec.tokens))
        here = len(r.tokens)
        if r.limit is not None and end > r.limit:  # the call asks for fewer tokens
            self._discard(s)
            return False
        r.tokens += rec.tokens[here:end]
        r.log_probs += rec.log_probs[here:end]
        r.versions += rec.versions[here:end]
        ended = (end < len(rec.tokens) or (end > here and rec.tokens[end - 1] in self.turn_ends)
                 or (r.limit is not None and end >= r.limit))  # fmt: skip
        if len(r.tokens) >= self.width:
            r.finished = True
        elif ended:
            r.waiting = True
        s.replayed_to = len(r.tokens)
        if end == len(rec.tokens):
            s.recorded = None  # nothing recorded after this turn
        if not (ended or r.finished):
            return False  # cut mid-turn: the engine continues it
        self.replayed_calls += 1
        self.replayed_tokens += end - here
        return True

    def _discard(self, s: Session) -> None:
        """What is left of a session's recording (its later sequences' too) is not used:
        counted, let go."""
        if s.recorded is not None:
            self.discarded_tokens += len(s.recorded.tokens) - s.replayed_to
            s.recorded = None
        self.discarded_tokens += sum(len(r.tokens) for r in s.later)
        s.later = []

    def _new_sequence(self, engine: Any, s: Session, call: Call) -> Response | None:
        """A call that does not extend the session's conversation: the session goes on in
        a new sequence, a further response of its group whose prompt is the call rendered
        whole. The sequence before it ends where it stands. None when the session has
        ``max_sequences`` already (the call is answered with no turn, "length"); nothing
        changes when the prompt is too long (400)."""
        owner = self.by_id.get(s.id, s)  # a side line's sequences count as its session's
        if owner.sequences >= self.max_sequences:
            log.info("session %s: a call that does not extend its conversation, and "
                     "gateway.max_sequences=%d used: answered with finish_reason length",
                     s.id, self.max_sequences)  # fmt: skip
            return None
        conversation = self.conversation(s.conversation.session)
        ids = self._render(conversation, call)
        if s.key in self.held:  # the engine had finished the group: it takes it back
            gen = self.held.pop(s.key)
            rows = gen.response_ids.shape[0]
            engine.resume(s.key, PartialGroup(list(self.prompts[s.key]), gen,
                                              np.ones(rows, dtype=bool)))  # fmt: skip
        group = engine.groups[s.key]
        if s.row >= 0:  # the line's sequence before this one ends where it stands
            before = group.responses[s.row]
            before.waiting, before.finished = False, True
        group.responses.append(Response(prompt=list(ids), session=s.j))
        s.row, s.sequence_prompt = len(group.responses) - 1, list(ids)
        s.conversation, owner.sequences = conversation, owner.sequences + 1
        if s.recorded is None and s.later and s.later[0].prompt == ids:
            s.recorded, s.replayed_to = s.later.pop(0), 0  # as before the stop: replayed
        else:
            self._discard(s)
        return group.responses[s.row]

    def _render(self, conversation: Conversation, call: Call) -> list[int]:
        """A sequence's prompt: the call's messages (or text) rendered whole."""
        if call.kind == "chat":
            ids = conversation.first(call.messages, call.tools, call.chat_template_kwargs)
        else:
            ids = conversation.first_text(call.prompt)
        if len(ids) > self.max_prompt_length:
            raise RequestError(400, f"the prompt has {len(ids)} tokens, more than "
                               f"data.max_prompt_length={self.max_prompt_length}",
                               "messages", code="context_length_exceeded")  # fmt: skip
        return ids

    def _open(self, engine: Any, s: Session, call: Call) -> Response:
        """A session's first call: the group's prompt, or the same tokens as it."""
        ids = self._render(s.conversation, call)
        if s.key not in engine.groups and s.key not in self.held:
            group = self.groups[s.key]
            engine.submit(s.key, ids, len(group), self.temperatures.get(s.key))
            self.prompts[s.key] = list(ids)
            for other in engine.groups[s.key].responses:
                other.waiting = True  # until its own session calls
        elif s.key in self.placeholders:  # only failed sessions before: this is the prompt
            self.placeholders.discard(s.key)
            engine.groups[s.key].prompt = self.prompts[s.key] = list(ids)
        elif self.prompts[s.key] != ids:
            first = next(o.id for o in self.groups[s.key] if o.opened)
            self._fail(
                engine,
                s,
                "its first call rendered other prompt tokens than session "
                f"{first}'s: the sessions of a group start from the same prompt",
            )
            raise RequestError(400, f"session {s.id}: {s.failure}", "messages")
        r = self._response(engine, s)
        r.waiting = False
        s.opened = True
        return r

    def _answer(self, engine: Any, s: Session, r: Response) -> None:
        turn = r.tokens[s.turn_start :]
        limited = r.limit is not None and len(r.tokens) >= r.limit
        r.limit = None
        rivals = None
        if r.top:
            rivals = [r.alternatives.get(i, []) for i in range(s.turn_start, len(r.tokens))]
        r.top, r.alternatives = 0, {}
        self._answer_with(s, r.tokens, r.log_probs, r.versions, r.finished,
                          limited and not (turn and turn[-1] in self.turn_ends), rivals)  # fmt: skip

    def _answer_with(
        self, s: Session, tokens: list[int], log_probs: list[float], versions: list[int],
        finished: bool, limited: bool = False,
        rivals: list[list[tuple[int, float]]] | None = None,
    ) -> None:  # fmt: skip
        """Answer the session's call with the model's turn: the response's tokens from
        where the turn started. A turn that leaves no room (``finished``) and did not end
        with EOS (a call cut, or a call with no room for its answer), or that the call's
        ``max_tokens`` stopped (``limited``), ends with "length"."""
        call, future = s.call
        s.call = None
        s.answered = time.monotonic()
        turn = tokens[s.turn_start :]
        cut = (finished and not (turn and turn[-1] == self.eos_id)) or limited
        prompt = self._context(s) + tokens[: s.turn_start]
        answer = s.conversation.answer(turn, cut, room_left=not finished, call=call,
                                       thinking=opened_thinking(self.tokenizer, prompt))  # fmt: skip
        result = Result(s.id, answer, prompt, turn, log_probs[s.turn_start :],
                        versions[s.turn_start :], call, alternatives=rivals)  # fmt: skip
        self._resolve(s, call, result, future)

    def _answer_empty(self, engine: Any, s: Session, call: Call, future: Future) -> None:
        """A call with no room left for its turn (the sequence is full, or the session has
        no sequence left): answered with no tokens and "length"; the conversation stays
        as it was."""
        r = self._response(engine, s)
        if r is not None:
            tokens = r.tokens
        elif s.key in self.held and s.row >= 0:  # the engine finished the group
            gen = self.held[s.key]
            tokens = gen.response_ids[s.row, : int(gen.response_lengths[s.row])].tolist()
        else:  # a side line that got no sequence
            tokens = []
        answer = Answer({"role": "assistant", "content": ""}, "", "length")
        prompt = self._context(s) + list(tokens)
        s.answered = time.monotonic()
        self._resolve(s, call, Result(s.id, answer, prompt, [], [], [], call), future)

    def _resolve(self, s: Session, call: Call, result: Result, future: Future) -> None:
        s.last, s.progress = (call, result), None
        future.set_result(result)
        for f in s.retries:
            f.set_result(dataclasses.replace(result, retried=True))
        s.retries = []

    def _end(self, engine: Any, s: Session, outcome: Any) -> None:
        if isinstance(outcome, BaseException):
            self._fail(engine, s, f"its agent raised {type(outcome).__name__}: {outcome}",
                       agent=True)  # fmt: skip
            return
        if isinstance(outcome, dict) and outcome.get("error") is not None:
            self._fail(engine, s, f"its agent failed: {outcome['error']}", agent=True)
            return
        if any(line.call is not None for line in self._lines(s)):
            raise RequestError(409, f"session {s.id} has a call running: end it after the answer")
        reward, extra = outcome, {}
        if isinstance(outcome, dict):
            reward, extra = outcome.get("reward"), {k: v for k, v in outcome.items()
                                                    if k != "reward"}  # fmt: skip
        try:
            value = float(reward)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            self._fail(engine, s, f"its agent returned {outcome!r}, not a finite reward",
                       agent=True)  # fmt: skip
            return
        if not s.opened:
            self._fail(engine, s, "its agent ended it without a call", agent=True)
            return
        s.reward, s.extra = value, extra
        self.failed_in_row = 0
        self.outcomes.append(False)
        for line in self._lines(s):
            r = self._response(engine, line)
            if r is not None and line.row >= 0:
                r.waiting, r.finished = False, True

    def _fail(self, engine: Any, s: Session, why: str, agent: bool = False) -> None:
        """The session fails: its response ends as it stands. Its group's other sessions
        go on to their own end (``finish`` then drops the group, or trains it with this
        session scored: gateway.on_session_failure). ``agent``: the agent's own failure
        (it raised, returned no number, ...), which ``broken`` counts."""
        s.failure = why
        log.warning("session %s failed: %s", s.id, why)
        if agent:
            self.failed_in_row += 1
            self.last_failure = why
            self.outcomes.append(True)
        for line in self._lines(s):
            self._refuse(line, RequestError(500, f"session {s.id} failed: {why}"))
        if s.key not in engine.groups and s.key not in self.held:  # no session of the group
            group = self.groups[s.key]  # called yet: a placeholder prompt, until one does
            engine.submit(s.key, [self.eos_id], len(group))
            self.prompts[s.key] = [self.eos_id]
            self.placeholders.add(s.key)
            for other in engine.groups[s.key].responses:
                other.waiting = True
        for line in self._lines(s):
            r = self._response(engine, line)
            if r is not None and line.row >= 0:
                r.waiting, r.finished = False, True

    def broken(self, in_row: int, share: float) -> str | None:
        """The agent fails every session: the last ``in_row`` sessions all failed, or more
        than ``share`` of the last 256 (once 256 have ended). The one line that says so."""
        window = len(self.outcomes)
        failed = sum(self.outcomes)
        if (in_row and self.failed_in_row >= in_row) or (
                window == self.outcomes.maxlen and failed > share * window):  # fmt: skip
            return (f"data.agent failed {failed} of the last {window} sessions on this rank "
                    f"({self.failed_in_row} in a row); the last: {self.last_failure}. Fix the "
                    "agent (gateway.max_failed_in_row and gateway.max_failed_share set when "
                    "the run stops for it)")  # fmt: skip
        return None

    def finish(self, key: Hashable) -> tuple[list[float], str, list[int], dict[str, float]]:
        """A group ``step`` gave back: its rewards, why it is dropped ("" to train it), its
        prompt tokens, and the agents' extra numbers (means over the group) with the
        gateway's counts for the group's calls (``gateway/...``: sums)."""
        with self.lock:
            group = self.groups.pop(key)
            for s in group:
                self.by_id.pop(s.id, None)
        for s in group:
            self._discard(s)
            self.sides.pop(s.id, None)
        self.recorded_prompts.pop(key, None)
        self.reopened.pop(key, None)  # sent: never opened again
        self.temperatures.pop(key, None)
        self.placeholders.discard(key)
        prompt = self.prompts.pop(key)
        failed = [s for s in group if s.failure is not None]
        scored = self.on_failure == "score" and len(failed) < len(group)
        dropped = "" if not failed or scored else (
            f"agent failed: session {failed[0].id}: {failed[0].failure}")  # fmt: skip
        rewards = [s.reward if s.reward is not None
                   else self.failure_reward if s.failure is not None else 0.0
                   for s in group]  # fmt: skip
        extra: dict[str, float] = {}
        for name in sorted({k for s in group for k in s.extra}):
            values = [s.extra.get(name) for s in group]
            if all(isinstance(v, int | float) for v in values):
                extra[name] = float(np.mean(values))
        for name in sorted({k for s in group for k in s.overridden}):
            extra[f"gateway/overridden/{name}"] = float(sum(s.overridden.get(name, 0)
                                                            for s in group))  # fmt: skip
        if failed:
            extra["gateway/failed_sessions"] = float(len(failed))
        return rewards, dropped, prompt, extra

    def unsubmitted(
        self, width: int, pad_id: int, engine: Any
    ) -> list[tuple[Hashable, PartialGroup]]:
        """The groups in flight the engine does not hold, cut for a checkpoint: those whose
        sessions have not called yet, as empty groups (their prompts run again after a
        resume), or, resumed from a recording not yet called for, as that recording again;
        and those the engine finished whose agents have not all given their rewards
        (``held``), with their tokens: the recording their sessions are answered from
        after a resume."""
        cut = []
        for key, group in self.groups.items():
            if key in engine.groups:
                continue
            if key in self.held:
                gen = self.held[key]
                finished = np.ones(gen.response_ids.shape[0], dtype=bool)
                cut.append((key, PartialGroup(list(self.prompts[key]), gen, finished)))
            elif key in self.recorded_prompts:
                responses = [s.recorded or Response() for s in group]
                responses += [r for s in group for r in s.later]
                partial = ResponseGroup(self.recorded_prompts[key], responses)
                cut.append((key, partial.partial(width, pad_id)))
            else:
                empty = ResponseGroup([self.eos_id], [Response() for _ in group])
                cut.append((key, empty.partial(width, pad_id)))
        return cut

    def forget(self, key: Hashable, why: str) -> None:
        """A group given up on this rank (it runs again from its prompt): its calls fail."""
        with self.lock:
            group = self.groups.pop(key, [])
            for s in group:
                self.by_id.pop(s.id, None)
        self.prompts.pop(key, None)
        self.held.pop(key, None)
        self.recorded_prompts.pop(key, None)
        self.temperatures.pop(key, None)
        for s in group:
            for line in self._lines(s):
                self._refuse(line, RequestError(503, why, kind="run_stopping"))
            self.sides.pop(s.id, None)
            s.failure = s.failure or why
            self._discard(s)

    def stop(self, why: str) -> None:
        """A stop signal: the calls in flight fail with 503, and every new one."""
        with self.lock:
            self.stopping = why
            pending = list(self.inbox)
            self.inbox.clear()
        for _, _, _, future in pending:
            future.set_exception(RequestError(503, why, kind="run_stopping"))
        for group in self.groups.values():
            for s in group:
                for line in self._lines(s):
                    self._refuse(line, RequestError(503, why, kind="run_stopping"))

    def carry_on(self) -> None:
        """The stop was withdrawn (no checkpoint came): calls are taken again."""
        with self.lock:
            self.stopping = None

    @staticmethod
    def _refuse(s: Session, error: RequestError) -> None:
        """The session's call in flight, if any, gets ``error`` (its agent is told)."""
        if s.call is not None:
            for f in [s.call[1], *s.retries]:
                f.set_exception(error)
            s.call, s.retries, s.progress = None, [], None
