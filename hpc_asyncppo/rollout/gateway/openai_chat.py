"""The Chat Completions and Completions door: ``POST /v1/chat/completions`` and
``/v1/completions``. Their fields map onto a ``Call`` (``requests.py``, the table); this
module only writes the answer back in OpenAI's shape: ``chat.completion`` (or a stream of
``chat.completion.chunk`` events) and ``text_completion``.

Every answer carries the exact tokens beside OpenAI's fields, as vLLM's
``return_token_ids`` does: ``prompt_token_ids``, and per choice ``token_ids``,
``token_logprobs`` and ``token_versions`` (the weights version that sampled each token; -1
for an opening the gateway put at the turn's start). ``logprobs: true`` adds OpenAI's
``choice.logprobs.content`` (each token's text, log-prob and bytes; ``top_logprobs`` is
empty: the engines keep the sampled token's log-prob, not its rivals'). The reasoning of a
``<think>`` turn is ``message.reasoning_content``; what the gateway did not do as asked is
under ``hpc_asyncppo`` (``Call.notes``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from hpc_asyncppo.rollout.gateway.chat import openai_message
from hpc_asyncppo.rollout.gateway.sessions import Result


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
    texts = [f"token_id:{t}" if call.tokens_as_ids else piece(t) for t in result.token_ids]
    if chat:
        return {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()),
                             "top_logprobs": []}
                            for text, lp in zip(texts, result.log_probs, strict=True)]}  # fmt: skip
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": result.log_probs,
            "top_logprobs": [{} for _ in texts], "text_offset": offsets}  # fmt: skip


def chat_chunks(result: Result, model: str, piece: Any) -> list[dict[str, Any]]:
    """The answer as ``chat.completion.chunk`` events: the role, the reasoning, the text,
    the tool calls, then the finish reason (with the exact tokens; usage there, or in a
    last chunk of its own with no choices when ``stream_options.include_usage``)."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}  # fmt: skip
    message = message_of(result)
    include_usage = result.call is not None and result.call.include_usage

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        out = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                    "logprobs": None, **extra}]}  # fmt: skip
        if include_usage:
            out["usage"] = None
        return out

    out = [chunk({"role": "assistant", "content": ""})]
    if message.get("reasoning_content"):
        out.append(chunk({"reasoning_content": message["reasoning_content"]}))
    if message.get("content"):
        out.append(chunk({"content": message["content"]}))
        out[-1]["choices"][0]["logprobs"] = logprobs(result, piece, chat=True)
    for k, call in enumerate(message.get("tool_calls", [])):
        out.append(chunk({"tool_calls": [{"index": k, **call}]}))
    last = chunk({}, result.answer.finish_reason, stop_reason=result.answer.stop_sequence,
                 **tokens(result))  # fmt: skip
    last.update(session_id=result.session, prompt_token_ids=result.prompt_ids)
    notes = result.notes()
    if notes:
        last["hpc_asyncppo"] = notes
    if include_usage:
        out.append(last)
        out.append({**base, "choices": [], "usage": usage(result)})
    else:
        last["usage"] = usage(result)
        out.append(last)
    return out
