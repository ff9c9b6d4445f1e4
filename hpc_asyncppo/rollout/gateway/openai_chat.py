"""The Chat Completions and Completions door: ``POST /v1/chat/completions`` and
``/v1/completions``. Their fields map onto a ``Call`` (``requests.py``, the table); this
module only writes the answer back in OpenAI's shape: ``chat.completion`` (or a stream of
``chat.completion.chunk`` events) and ``text_completion``.

Every answer carries the exact tokens beside OpenAI's fields, as vLLM's
``return_token_ids`` does: ``prompt_token_ids``, and per choice ``token_ids``,
``token_logprobs`` and ``token_versions`` (the weights version that sampled each token; -1
for an opening the gateway put at the turn's start). ``logprobs: true`` adds OpenAI's
``choice.logprobs.content`` (each token's text, log-prob and bytes, and with
``top_logprobs: k`` the k most likely tokens at its place, as the engine sampled it: the
same log-prob as the sampled token's, the run's temperature). The reasoning of a
``<think>`` turn is ``message.reasoning_content``; what the gateway did not do as asked is
under ``hpc_asyncppo`` (``Call.notes``). With ``stream: true`` the answer comes in chunks
as the turn grows (``ChatStream``, ``CompletionStream``; ``streaming.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from hpc_asyncppo.rollout.gateway.chat import openai_message
from hpc_asyncppo.rollout.gateway.requests import Call, RequestError
from hpc_asyncppo.rollout.gateway.sessions import Result
from hpc_asyncppo.rollout.gateway.streaming import CONTENT, REASONING


def chat_body(result: Result, model: str, piece: Any) -> dict[str, Any]:
    """A ``chat.completion``. ``piece``: a token id's text (the tokenizer's)."""
    return _body(result, model, "chat", piece)


def completion_body(result: Result, model: str, piece: Any) -> dict[str, Any]:
    """A ``text_completion``."""
    return _body(result, model, "completion", piece)


def _body(result: Result, model: str, kind: str, piece: Any) -> dict[str, Any]:
    a = result.answer
    chat = kind == "chat"
    said = {"message": message_of(result)} if chat else {"text": a.text}
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "session_id": result.session,
        "prompt_token_ids": result.prompt_ids,
        "choices": [
            {
                "index": 0,
                **said,
                "finish_reason": a.finish_reason,
                "stop_reason": a.stop_sequence,
                "logprobs": logprobs(result, piece, chat),
                **tokens(result),
            }
        ],
        "usage": usage(result),
    }
    notes = result.notes()
    if notes:
        body["hpc_asyncppo"] = notes
    return body


def message_of(result: Result) -> dict[str, Any]:
    message = openai_message(result.answer.message)
    if result.answer.reasoning:
        message["reasoning_content"] = result.answer.reasoning
    return message


def tokens(result: Result) -> dict[str, Any]:
    return {"token_ids": result.token_ids, "token_logprobs": result.log_probs,
            "token_versions": result.versions}  # fmt: skip


def usage(result: Result) -> dict[str, int]:
    p, c = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def logprobs(result: Result, piece: Any, chat: bool) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of the turn's tokens, when the call asked for them."""
    call = result.call
    if call is None or not call.logprobs:
        return None

    def text(t: int) -> str:
        return f"token_id:{t}" if call.tokens_as_ids else piece(t)

    texts = [text(t) for t in result.token_ids]
    rivals = result.alternatives or [[] for _ in texts]
    if chat:
        return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()),
                             "top_logprobs": [{"token": text(t), "logprob": x,
                                               "bytes": list(text(t).encode())}
                                              for t, x in top]}
                            for s, lp, top in zip(texts, result.log_probs, rivals, strict=True)]}  # fmt: skip
    offsets, at = [], 0
    for s in texts:
        offsets.append(at)
        at += len(s)
    return {"tokens": texts, "token_logprobs": result.log_probs,
            "top_logprobs": [{text(t): x for t, x in top} for top in rivals],
            "text_offset": offsets}  # fmt: skip


class ChatStream:
    """A streamed chat answer (``streaming.py``): the role first, then
    ``chat.completion.chunk`` events with the reasoning and content as the turn grows,
    the tool calls, and the finish reason with the exact tokens and the log-probs (usage
    there, or in a last chunk of its own with no choices when
    ``stream_options.include_usage``)."""

    done = True  # the stream ends with data: [DONE]

    def __init__(self, model: str, piece: Any, call: Call):
        self.piece, self.include_usage = piece, call.include_usage
        self.base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": model}  # fmt: skip

    def _chunk(self, delta: dict[str, Any], finish: str | None = None,
               **extra: Any) -> dict[str, Any]:  # fmt: skip
        out = {**self.base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                         "logprobs": None, **extra}]}  # fmt: skip
        if self.include_usage:
            out["usage"] = None
        return out

    def start(self, prompt_tokens: int) -> list[tuple[str | None, dict[str, Any]]]:
        return [(None, self._chunk({"role": "assistant", "content": ""}))]

    def pieces(self, pieces: list[tuple[str, str]]) -> list[tuple[str | None, dict[str, Any]]]:
        names = {REASONING: "reasoning_content", CONTENT: "content"}
        return [(None, self._chunk({names[kind]: text})) for kind, text in pieces]

    def finish(self, result: Result, rest: list[tuple[str, str]]
               ) -> list[tuple[str | None, dict[str, Any]]]:  # fmt: skip
        out = self.pieces(rest)
        for k, call in enumerate(message_of(result).get("tool_calls", [])):
            out.append((None, self._chunk({"tool_calls": [{"index": k, **call}]})))
        last = self._chunk({}, result.answer.finish_reason,
                           stop_reason=result.answer.stop_sequence, **tokens(result))  # fmt: skip
        last["choices"][0]["logprobs"] = logprobs(result, self.piece, chat=True)
        last.update(session_id=result.session, prompt_token_ids=result.prompt_ids)
        notes = result.notes()
        if notes:
            last["hpc_asyncppo"] = notes
        out.append((None, last))
        if self.include_usage:
            out.append((None, {**self.base, "choices": [], "usage": usage(result)}))
        else:
            last["usage"] = usage(result)
        return out

    def error(self, exc: RequestError) -> list[tuple[str | None, dict[str, Any]]]:
        return [(None, exc.body())]


class CompletionStream:
    """A streamed completion: ``text_completion`` chunks with the text as the turn grows,
    then one with the finish reason, the exact tokens, the log-probs and usage."""

    done = True

    def __init__(self, model: str, piece: Any, call: Call):
        self.model, self.piece = model, piece
        self.base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                     "created": int(time.time()), "model": model}  # fmt: skip

    def start(self, prompt_tokens: int) -> list[tuple[str | None, dict[str, Any]]]:
        return []

    def pieces(self, pieces: list[tuple[str, str]]) -> list[tuple[str | None, dict[str, Any]]]:
        return [(None, {**self.base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                   "finish_reason": None}]})
                for _, text in pieces]  # fmt: skip

    def finish(self, result: Result, rest: list[tuple[str, str]]
               ) -> list[tuple[str | None, dict[str, Any]]]:  # fmt: skip
        last = {**_body(result, self.model, "completion", self.piece), **self.base}
        last["choices"][0]["text"] = ""
        return [*self.pieces(rest), (None, last)]

    def error(self, exc: RequestError) -> list[tuple[str | None, dict[str, Any]]]:
        return [(None, exc.body())]
