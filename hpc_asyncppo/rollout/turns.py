"""Multi-turn trajectories on a rollout rank: the model's turns, the tool calls between them,
and the tools' answers put back into the context (``rollout.multi_turn``).

A response is a trajectory of turns. The engine (either: this code is the same for both)
generates the model's turn until EOS or the end of a tool call (``turn_ends``:
a token ending with ``</tool_call>``, ``stop_at_tool_call``) and then
marks the response ``waiting``
(``Response.end_turn``); it generates nothing more for it until this module decides. Each
pass of the rollout loop (``advance``, after every engine step) looks at the waiting
responses of every group in flight, training and validation alike:

- a turn with tool calls (``format``: hermes, ``<tool_call>{json}</tool_call>``) starts
  them on the rank's pool (``tools/runner.py``: ``max_parallel_calls`` at once, each
  bounded by ``tool_timeout_s``), and the engine goes on with the other responses: a
  trajectory waiting for a tool never holds the engine;
- once every call of the turn has answered, the answers (each cut to
  ``max_tool_response_length`` characters, verl's way) become tool messages rendered
  through the model's chat template, and their tokens are appended as an observation
  (``Response.observe``: log-prob 0, version -1, ``loss_mask`` 0: context, never
  trained); the response runs again;
- a turn without a call ends the response, unless the task is an environment: its
  ``respond(prompt, response_text)`` may answer in plain text (a user message through the
  chat template, an observation as a tool's answer is) and the trajectory goes on, or
  return None to end it;
- past ``max_assistant_turns`` / ``max_user_turns`` (tool answers and an environment's
  alike), or without room left in ``rollout.response_length`` (model and observation
  tokens together), the response ends.

A call that raises, hangs past its timeout, returns garbage or names no tool answers with
an error message as its observation and is counted; it never ends the rank.

Tools live for one trajectory (``instance_id``: the group's key and the response's index,
the same after a resume): ``create`` with the prompt's ``tools_kwargs`` at its first
call, ``reward`` and ``release`` when its group is sent (``finish``). A checkpoint keeps
what each tool says of its trajectories (``state``, JSON) beside the cut group's tokens; a
response cut while its calls ran is waiting again after the resume (its last token is the
model's EOS), so its calls run again; those of a tool that is not ``rerun_safe`` answer
with an error instead. An engine restart keeps this object, calls in flight included.

Memory: per response in flight, its pending calls (a thread and an answer each) and a
few numbers; the tools' own state is theirs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from hpc_asyncppo.config import MultiTurnConfig
from hpc_asyncppo.rollout.generation import ResponseGroup
from hpc_asyncppo.tasks import Prompt
from hpc_asyncppo.tools.base import Tool
from hpc_asyncppo.tools.hermes import ToolCall, parse_tool_calls
from hpc_asyncppo.tools.runner import Observation, PendingCall, ToolRunner

log = logging.getLogger(__name__)
_MARK = "\u2063hpc-asyncppo-turn\u2063"  # stands for the model's turn in a rendered chat


class ChatTemplateMissing(ValueError):
    """The model's tokenizer has no chat template to render tool messages with."""


def truncate(text: str, limit: int, side: str) -> str:
    """verl's cut of a tool answer to ``limit`` characters: ``left`` keeps the start,
    ``right`` the end, ``middle`` both halves."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


def observation_ids(
    tokenizer: Any, answers: list[str], after_eos: bool, role: str = "tool"
) -> list[int]:
    """The tokens that follow the model's turn when ``answers`` come back as ``role``
    messages (tool answers; an environment's are "user"): ``messages_after_turn``."""
    messages = [{"role": role, "content": text} for text in answers]
    return messages_after_turn(tokenizer, messages, after_eos)


def messages_after_turn(
    tokenizer: Any, messages: list[dict], after_eos: bool, template_kwargs: dict | None = None
) -> list[int]:
    """The tokens that follow the model's turn when ``messages`` (tool answers, user
    messages: chat messages as the template takes them) come after it: what the chat
    template puts after an assistant message (``after_eos``: the turn ended with the
    model's EOS, which the template writes itself and is dropped from the text), then the
    messages and the generation prompt of the next assistant turn. Only these are ever
    tokenized: the model's own tokens stay as it sampled them. ``template_kwargs``: the
    template's own options (a gateway call's ``chat_template_kwargs``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateMissing(
            "rollout.multi_turn needs a model whose tokenizer has a chat template (tool "
            "answers go back as tool messages)"
        )
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}, *messages]
    rendered = tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )
    after = rendered[rendered.index(_MARK) + len(_MARK) :]
    eos = tokenizer.eos_token or ""
    at = after.find(eos) if eos and after_eos else -1
    if at >= 0 and not after[:at].strip():
        after = after[at + len(eos) :]
    return list(tokenizer(after, add_special_tokens=False)["input_ids"])


def call_end_ids(tokenizer: Any, cfg: MultiTurnConfig) -> list[int]:
    """The tokens that end a tool call in ``cfg.format`` (hermes: those whose text ends with
    ``</tool_call>``; Qwen2.5 has one), where the model's turn stops when
    ``stop_at_tool_call``. None: turns end at EOS only."""
    if not cfg.stop_at_tool_call:
        return []
    ids = sorted(i for token, i in tokenizer.get_vocab().items() if token.endswith("</tool_call>"))
    if not ids:
        log.info("no token of this tokenizer ends with </tool_call>: turns end at EOS only")
    return ids


@dataclass
class Trajectory:
    """One response's life on this rank, beyond its tokens."""

    instance_id: str
    started: float = field(default_factory=time.monotonic)
    calls: list[PendingCall] = field(default_factory=list)  # the turn's
    waiting_since: float | None = None
    wait_s: float = 0.0  # waiting for tools
    call_reward: float = 0.0  # the calls' own rewards, summed
    tools: dict[str, dict] = field(default_factory=dict)  # tool name -> state after a resume
    created: set[str] = field(default_factory=set)  # tools created for it
    rerun: bool = False  # resumed while waiting: its calls were cut by the checkpoint


class Turns:
    """The multi-turn state of one rollout rank (``advance`` after every engine step)."""

    def __init__(
        self,
        cfg: MultiTurnConfig,
        tokenizer: Any,
        tools: dict[str, Tool],
        eos_id: int,
        width: int,
        respond: Callable[[Prompt, str], str | None] | None = None,
    ):
        """``width``: rollout.response_length, the model's and the tools' tokens together.
        ``respond``: the task's, if it is an environment (``Environment``)."""
        self.cfg, self.tokenizer, self.tools, self.eos_id = cfg, tokenizer, tools, eos_id
        self.width, self.respond = width, respond
        self.runner = ToolRunner(tools, cfg.max_parallel_calls, cfg.tool_timeout_s)
        self.live: dict[tuple[Hashable, int], Trajectory] = {}
        self.turn_ends = frozenset({eos_id, *call_end_ids(tokenizer, cfg)})
        observation_ids(tokenizer, ["?"], after_eos=True)  # no chat template: say so now
        # cumulative over the attempt (sent with every group, as engine restarts are)
        self.wait_s = 0.0  # trajectory-seconds spent waiting for tools
        self.trajectory_s = 0.0  # trajectory-seconds from start to end
        self.cut_calls = 0  # calls cut by a checkpoint and not run again (not rerun_safe)

    # --- the loop -------------------------------------------------------------------------
    def advance(
        self, groups: dict[Hashable, ResponseGroup], prompt_of: Callable[[Hashable], Prompt]
    ) -> bool:
        """Start the calls of turns that just ended; put back the answers that came; end
        the responses that are done. True while some response may run on the engine."""
        runnable = False
        for key, group in groups.items():
            for j, r in enumerate(group.responses):
                if r.waiting:
                    self._waiting(key, j, group, prompt_of)
                runnable = runnable or r.runnable
        return runnable

    def _waiting(
        self,
        key: Hashable,
        j: int,
        group: ResponseGroup,
        prompt_of: Callable[[Hashable], Prompt],
    ) -> None:
        r = group.responses[j]
        t = self.trajectory(key, j)
        now = time.monotonic()
        if t.waiting_since is None:  # the turn just ended: read its calls
            t.waiting_since = now
            start = r.observations[-1][1] if r.observations else 0
            text = self.tokenizer.decode(r.tokens[start:], skip_special_tokens=False)
            parsed = parse_tool_calls(text)
            turns, answered = len(r.observations) + 1, len(r.observations)
            cfg = self.cfg
            over = (cfg.max_assistant_turns and turns >= cfg.max_assistant_turns) or (
                cfg.max_user_turns and answered >= cfg.max_user_turns
            )
            if over:
                self._end(r, t, now)
                return
            if not (parsed.calls or parsed.errors):  # the environment's turn, if there is one
                text = None
                if self.respond is not None:
                    whole = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
                    text = self.respond(prompt_of(key), whole)
                if text is None:
                    self._end(r, t, now)
                    return
                t.waiting_since = None
                ids = observation_ids(self.tokenizer, [text], r.tokens[-1] == self.eos_id, "user")
                self._observe(r, ids)
                return
            unread = ToolCall("?", {})
            t.calls = [
                self.runner.answered(t.instance_id, unread, Observation(e, error="garbage"))
                for e in parsed.errors
            ]
            t.calls += [self._start(t, call, prompt_of(key)) for call in parsed.calls]
            t.rerun = False  # only the turn cut by the checkpoint runs its calls again
        if not all(c.done() for c in t.calls):
            return
        answers = []
        for c in t.calls:
            obs = c.observation
            t.call_reward += obs.reward
            answers.append(truncate(obs.text, self.cfg.max_tool_response_length,
                                    self.cfg.tool_response_truncate_side))  # fmt: skip
        t.calls = []
        t.wait_s += now - t.waiting_since
        t.waiting_since = None
        # the template's text after a turn starts with its end of turn (EOS): dropped when
        # the model wrote it, kept when its turn stopped at the call's end
        ids = observation_ids(self.tokenizer, answers, r.tokens[-1] == self.eos_id)
        self._observe(r, ids)

    def _observe(self, r, ids: list[int]) -> None:
        """Append an observation, cut to the room left; without room the response ends."""
        room = self.width - len(r.tokens)
        r.observe(ids[:room])
        r.waiting = False
        if len(ids) >= room:  # no room for another turn
            r.finished = True

    def _start(self, t: Trajectory, call: ToolCall, prompt: Prompt) -> PendingCall:
        tool = self.tools.get(call.name)
        if tool is not None and t.rerun and not tool.rerun_safe:
            self.cut_calls += 1
            text = (
                f"error: the call to {call.name!r} was cut by a preemption and is not run "
                "again (the tool is not safe to re-run)"
            )
            return self.runner.answered(t.instance_id, call, Observation(text, error="raised"))
        if tool is not None and call.name not in t.created:
            state = t.tools.get(call.name)
            if state is not None:
                tool.load_state(t.instance_id, state)
            else:
                kwargs = (prompt.tools_kwargs or {}).get(call.name, {}).get("create_kwargs", {})
                tool.create(t.instance_id, **kwargs)
            t.created.add(call.name)
        return self.runner.start(t.instance_id, call)

    def _end(self, r, t: Trajectory, now: float) -> None:
        r.waiting, r.finished = False, True
        t.wait_s += now - t.waiting_since
        t.waiting_since = None

    # --- a group's end, checkpoints, resumes ------------------------------------------------
    def trajectory(self, key: Hashable, j: int) -> Trajectory:
        if (key, j) not in self.live:
            name = "-".join(map(str, key)) if isinstance(key, tuple) else str(key)
            self.live[(key, j)] = Trajectory(f"{name}-r{j}")
        return self.live[(key, j)]

    def finish(self, key: Hashable, n: int) -> list[float]:
        """A group is done: each response's reward from its tools (its calls' rewards and
        each tool's ``reward``), and the tools release its trajectories."""
        rewards = []
        now = time.monotonic()
        for j in range(n):
            t = self.live.pop((key, j), None)
            if t is None:
                rewards.append(0.0)
                continue
            total = t.call_reward
            for name in sorted(t.created):
                tool = self.tools[name]
                total += float(tool.reward(t.instance_id))
                tool.release(t.instance_id)
            self.wait_s += t.wait_s
            self.trajectory_s += now - t.started
            rewards.append(total)
        return rewards

    def forget(self, key: Hashable, n: int) -> None:
        """A group abandoned (a validation lost with its engine): release its tools."""
        for j in range(n):
            t = self.live.pop((key, j), None)
            for name in sorted(t.created) if t else []:
                self.tools[name].release(t.instance_id)

    def state(self, key: Hashable, n: int) -> dict[str, Any]:
        """What a checkpoint keeps of a group's trajectories (JSON values): per response,
        each created tool's ``state`` and the calls' rewards so far."""
        out = {}
        for j in range(n):
            t = self.live.get((key, j))
            if t is not None and (t.created or t.call_reward):
                tools = {name: self.tools[name].state(t.instance_id) for name in sorted(t.created)}
                out[str(j)] = {"tools": tools, "call_reward": t.call_reward}
        return out

    def load(self, key: Hashable, group: ResponseGroup, state: dict[str, Any]) -> None:
        """A cut group resumed from a checkpoint: its tools' state back (each tool gets it
        through ``load_state`` at its next call), and waiting responses marked to run
        their calls again."""
        for j, r in enumerate(group.responses):
            t = self.trajectory(key, j)
            saved = state.get(str(j), {})
            t.tools = dict(saved.get("tools", {}))
            t.call_reward = float(saved.get("call_reward", 0.0))
            t.rerun = r.waiting

    @property
    def counts(self) -> dict[str, float]:
        """Cumulative over the attempt, for the groups' senders' scalars."""
        c = self.runner.counts
        return {
            "tool_calls": c["calls"],
            "tool_errors": c["raised"] + c["garbage"] + c["unknown_tool"],
            "tool_timeouts": c["timeout"],
            "tool_s": self.runner.seconds,
            "tool_wait_s": self.wait_s,
            "trajectory_s": self.trajectory_s,
        }


def encode_state(state: dict[str, Any]) -> bytes:
    return json.dumps(state, sort_keys=True).encode()


def decode_state(raw: bytes) -> dict[str, Any]:
    return json.loads(raw.decode()) if raw else {}
