"""What the gateway does with each field of a request, in one table, and the ``Call`` every
front door hands the sessions.

Harnesses send what their SDK sends, and most of them die on a 400 (or, mini-swe-agent,
retry it for minutes): a field is refused only where answering would be a lie. Every
field of OpenAI's Chat Completions and Completions requests, and the extension fields
vLLM's clients send, falls in one of four rows:

- ``HONOURED``: shapes the answer (``stop``, ``max_tokens``, ``logprobs``, ``tool_choice``,
  ``parallel_tool_calls``, ``stream_options``, ``chat_template_kwargs``, ...);
- ``SAMPLING``: would change the sampling distribution (``temperature``, ``top_p``,
  ``top_k``, ``min_p``, the penalties, ``logit_bias``, ...). The trainer's log-probs
  assume the run's sampling (``rollout.*``), so a value other than the run's is, under
  ``gateway.sampling=override`` (the default), replaced by the run's, and the answer says
  so (``hpc_asyncppo.overridden``); under ``refuse`` it gets a 400 naming the field;
- ``NOT_APPLIED``: asks for a constraint the gateway does not apply (``response_format``:
  a constrained sample is not a sample of the policy the trainer's log-probs describe);
  the answer says so (``hpc_asyncppo.not_applied``) and the reward is where to teach it;
- ``NO_OP``: changes nothing the model samples or the answer carries (``user``,
  ``metadata``, ``store``, ``seed`` on the engines' shared batches, ...).

A field in none of them is accepted, with one warning per field per rank (not per call),
and named in the answer (``hpc_asyncppo.ignored``). A field of the right name and the wrong
type is a 400 naming it: a string ``temperature`` is the client's bug, not the server's.
``n`` above 1 is refused: a group's n samples are n sessions.

The Responses and Messages doors translate their own fields into these names first
(``max_output_tokens`` is ``max_tokens``, ``stop_sequences`` is ``stop``, ...), so every
door shares this table. Here too: ``RequestError`` (a refusal, written in each API's error
shape by ``server.py``) and ``normalize`` (chat messages as the sessions compare them).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the gateway refuses: its HTTP status, its message, the field at fault,
    OpenAI's error type and, where OpenAI has one, its string ``code``
    (``context_length_exceeded``, ...). Each front door writes it in its API's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "",
                 code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error body (``/v1/messages``)."""
        kinds = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
        kind = kinds.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise RequestError(400, f"{where}: only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestError(400, f"{where}: content must be a string or a list of text parts")


def normalize(messages: Any) -> list[dict[str, Any]]:
    """OpenAI's messages, as the gateway compares and renders them: role, content text,
    and where present tool_calls (id, name, arguments as parsed JSON), tool_call_id and
    name. Fields a client sends as null (refusal, audio, ...) are dropped; RequestError
    (400) names what cannot be read."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(400, f"{where}: a message needs a role, one of {', '.join(ROLES)}",
                               "messages")  # fmt: skip
        msg: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"), where)}
        calls = m.get("tool_calls") or []
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise RequestError(400, f"{where}: tool_calls belong to assistant messages")
            msg["tool_calls"] = [_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = str(m[key])
        out.append(msg)
    return out


def _call(call: Any, where: str) -> dict[str, Any]:
    try:
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        return {"id": str(call.get("id", "")), "name": str(function["name"]), "arguments": parsed}
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError):
        raise RequestError(400, f"{where}: a tool call is {{id, type, function: {{name, "
                           "arguments}}}} with arguments a JSON object") from None  # fmt: skip


# shapes the answer (each read below)
HONOURED = {
    "model", "messages", "prompt", "tools", "tool_choice", "parallel_tool_calls",
    "max_tokens", "max_completion_tokens", "stop", "stop_token_ids", "stream",
    "stream_options", "logprobs", "top_logprobs", "n", "chat_template_kwargs",
    "return_token_ids", "return_tokens_as_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "session_id",
}  # fmt: skip
# would change the sampling distribution: the run's value, and what each means when absent
SAMPLING = {
    "temperature": None, "top_p": None, "top_k": None, "min_p": 0.0,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "logit_bias": None, "min_tokens": 0, "bad_words": None, "allowed_token_ids": None,
    "typical_p": 1.0, "best_of": None, "use_beam_search": False, "length_penalty": 1.0,
}  # fmt: skip
# a constraint on the output that is not applied (the answer says so)
NOT_APPLIED = {"response_format", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "structured_outputs", "prediction"}  # fmt: skip
# nothing the model samples or the answer carries changes
NO_OP = {
    "user", "metadata", "store", "seed", "service_tier", "reasoning_effort", "verbosity",
    "modalities", "audio", "web_search_options", "prompt_cache_key", "safety_identifier",
    "extra_headers", "extra_body", "request_id", "priority", "cache_salt", "suffix",
    "add_generation_prompt", "add_special_tokens", "continue_final_message", "documents",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "ignore_eos",
    "prompt_logprobs", "echo", "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs",
    "functions", "function_call",
}  # fmt: skip

TOOL_CHOICES = ("auto", "none", "required")


@dataclass
class Call:
    """One call as the sessions take it, from any door: the conversation (``messages``
    normalized, ``tools``) or the text (``prompt``), and what limits and shapes the turn."""

    kind: str  # chat | completion
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: str | None = None
    max_tokens: int | None = None  # the turn's limit (the room's end bounds it too)
    stop: tuple[str, ...] = ()  # the turn ends at the first; the text leaves it out
    stop_token_ids: tuple[int, ...] = ()
    include_stop: bool = False  # include_stop_str_in_output: the text keeps the stop string
    # auto | none (the tools stay in the prompt, no call is read) | required | a tool's name
    tool_choice: str = "auto"
    named: bool = False  # tool_choice names one function
    parallel_tool_calls: bool = True  # False: the turn ends at the first call's end
    logprobs: bool = False
    top_logprobs: int = 0
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: log-prob tokens as token_id:N
    seed: Any = None  # no-op for sampling; another seed makes the same call a new question
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    include_usage: bool = False  # stream_options.include_usage: usage in its own last chunk
    # what the answer says of the request (hpc_asyncppo.*): sampling fields replaced by the
    # run's (name -> what was asked), constraints not applied, unknown fields
    overridden: dict[str, Any] = field(default_factory=dict)
    not_applied: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def same_request(self, other: Call) -> bool:
        """The same call again (a client's retry): what shapes the turn is equal."""
        return (self.kind, self.messages, self.tools, self.prompt, self.max_tokens, self.stop,
                self.stop_token_ids, self.tool_choice, self.parallel_tool_calls,
                self.chat_template_kwargs, self.seed, self.overridden) == (
                other.kind, other.messages, other.tools, other.prompt, other.max_tokens,
                other.stop, other.stop_token_ids, other.tool_choice, other.parallel_tool_calls,
                other.chat_template_kwargs, other.seed, other.overridden)  # fmt: skip

    def notes(self) -> dict[str, Any]:
        """The answer's ``hpc_asyncppo`` extension: what was not done as asked."""
        out: dict[str, Any] = {}
        if self.overridden:
            out["overridden"] = dict(self.overridden)
        if self.not_applied:
            out["not_applied"] = list(self.not_applied)
        if self.ignored:
            out["ignored"] = list(self.ignored)
        return out


class Fields:
    """The table applied to a rank's requests: the run's sampling, what a sampling field
    other than it gets (``gateway.sampling``), and the unknown fields already warned of."""

    def __init__(self, sampling: dict[str, float], mode: str = "override",
                 parallel_tool_calls: bool = True):  # fmt: skip
        """``sampling``: the run's temperature, top_p and top_k (``rollout.*``);
        ``mode``: gateway.sampling; ``parallel_tool_calls``: what a call that does not
        say gets (gateway.parallel_tool_calls)."""
        self.sampling = {**SAMPLING, **sampling}
        self.mode, self.parallel_tool_calls = mode, parallel_tool_calls
        self.warned: set[str] = set()
        self.lock = threading.Lock()

    def chat(self, body: Any) -> Call:
        """A Chat Completions body as a ``Call``; RequestError (400) names the first field
        that is wrong."""
        call = self._common("chat", body)
        call.messages = normalize(body.get("messages"))
        call.tools = _tools(body.get("tools"))
        choice = body.get("tool_choice")
        if choice is None or choice in TOOL_CHOICES:
            call.tool_choice = choice or "auto"
        elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"),
                                                     str):  # fmt: skip
            call.tool_choice, call.named = choice["function"]["name"], True
        else:
            raise RequestError(400, 'tool_choice: "auto", "none", "required" or {"type": '
                               '"function", "function": {"name": ...}}', "tool_choice")  # fmt: skip
        if call.tool_choice != "auto" and not call.tools and call.tool_choice != "none":
            raise RequestError(400, f"tool_choice {call.tool_choice!r} needs tools",
                               "tool_choice")  # fmt: skip
        if call.named and call.tool_choice not in {t["function"]["name"] for t in call.tools}:
            raise RequestError(400, f"tool_choice names {call.tool_choice!r}, which is not "
                               "one of the tools", "tool_choice")  # fmt: skip
        parallel = body.get("parallel_tool_calls")
        call.parallel_tool_calls = (
            self.parallel_tool_calls if parallel is None else _bool(parallel, "parallel_tool_calls")
        )
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RequestError(400, "chat_template_kwargs must be an object",
                               "chat_template_kwargs")  # fmt: skip
        call.chat_template_kwargs = dict(kwargs or {})
        return call

    def completion(self, body: Any) -> Call:
        call = self._common("completion", body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch of one, as some clients send it
        if not isinstance(prompt, str):
            raise RequestError(400, "prompt must be a string (one prompt per call)", "prompt")
        call.prompt = prompt
        return call

    def _common(self, kind: str, body: Any) -> Call:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        call = Call(kind)
        n = body.get("n")
        if n is not None and n != 1:
            raise RequestError(400, "n must be 1: a group's n samples are n sessions", "n")
        self._sampling(body, call)
        limits = [_positive(body, name) for name in ("max_tokens", "max_completion_tokens")]
        call.max_tokens = min((v for v in limits if v is not None), default=None)
        call.stop = _stop(body.get("stop"))
        ids = body.get("stop_token_ids") or []
        if not (isinstance(ids, list) and all(_is_int(i) for i in ids)):
            raise RequestError(400, "stop_token_ids must be a list of token ids", "stop_token_ids")
        call.stop_token_ids = tuple(ids)
        if body.get("include_stop_str_in_output") is not None:
            call.include_stop = _bool(
                body["include_stop_str_in_output"], "include_stop_str_in_output"
            )
        logprobs = body.get("logprobs")
        if kind == "completion" and _is_int(logprobs):  # completions: the top count itself
            call.logprobs, call.top_logprobs = True, int(logprobs)
        else:
            call.logprobs = bool(logprobs is not None and _bool(logprobs, "logprobs"))
            top = body.get("top_logprobs")
            if top is not None and not (_is_int(top) and 0 <= top <= 20):
                raise RequestError(400, "top_logprobs must be an integer from 0 to 20",
                                   "top_logprobs")  # fmt: skip
            call.top_logprobs = int(top or 0)
        if body.get("return_tokens_as_token_ids") is not None:
            call.tokens_as_ids = _bool(
                body["return_tokens_as_token_ids"], "return_tokens_as_token_ids"
            )
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise RequestError(400, "stream_options must be an object", "stream_options")
        call.include_usage = bool((options or {}).get("include_usage"))
        if body.get("stream") is not None:
            _bool(body["stream"], "stream")
        call.seed = body.get("seed")
        call.not_applied = sorted(k for k in NOT_APPLIED if body.get(k) is not None)
        known = HONOURED | SAMPLING.keys() | NOT_APPLIED | NO_OP
        call.ignored = sorted(k for k in body if k not in known)
        self._warn(call.ignored)
        return call

    def _sampling(self, body: dict[str, Any], call: Call) -> None:
        for name, run in self.sampling.items():
            asked = body.get(name)
            if asked is None:
                continue
            if name in ("logit_bias", "bad_words", "allowed_token_ids"):
                if not isinstance(asked, dict | list):
                    raise RequestError(400, f"{name} must be an object or a list", name)
                differs = bool(asked)
            elif isinstance(asked, bool):
                differs = asked != bool(run)
            elif _is_number(asked):
                differs = run is None or not math.isclose(float(asked), float(run), abs_tol=1e-6)
                if name == "top_k" and asked in (-1, 0) and run in (0, -1, None):
                    differs = False  # both mean "no top-k"
            else:
                raise RequestError(400, f"{name} must be a number", name)
            if not differs:
                continue
            if self.mode == "refuse":
                raise RequestError(400, f"{name}={asked}: this run samples with its own "
                                   f"{name} ({run}; the trainer's log-probs assume it), and "
                                   "gateway.sampling=refuse", name)  # fmt: skip
            call.overridden[name] = asked

    def _warn(self, names: list[str]) -> None:
        with self.lock:
            new = [n for n in names if n not in self.warned]
            self.warned.update(new)
        for name in new:
            log.warning("the gateway ignores the request field %r (it is neither OpenAI's nor "
                        "vLLM's): said once per rank", name)  # fmt: skip


def function_tool(name: str, parameters: Any, description: str | None) -> dict[str, Any]:
    """A tool in Chat Completions' shape (what the chat template renders), from another
    API's flat one."""
    function = {"name": name, "parameters": parameters or {}}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not (isinstance(tools, list) and all(
            isinstance(t, dict) and t.get("type") == "function"
            and isinstance((t.get("function") or {}).get("name"), str) for t in tools)):  # fmt: skip
        raise RequestError(400, "tools must be a list of {type: function, function: {name, "
                           "...}}", "tools")  # fmt: skip
    return tools


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError(400, "stop must be a string or a list of strings", "stop")
    return tuple(s for s in stop if s)


def _positive(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and not (_is_int(value) and value >= 1):
        raise RequestError(400, f"{name} must be a positive integer", name)
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(400, f"{name} must be true or false", name)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
