"""Job results as OpenAI responses: the shapes of OpenAI's chat.completion, text_completion
and their stream chunks, its error body, and the HTTP status of each job error code. The
request bodies are parsed by producer/openai_body.py (shared with batch input lines)."""

from __future__ import annotations

import time
from typing import Any

from plurai.broker_config.protocol import Code
from plurai.producer.openai_body import Job
from plurai.results.records import Choice, JobRecord

# HTTP status of each job error code: what the client sent (400, 404, 413) or not (5xx).
STATUS = {
    Code.BAD_BODY: 400,
    Code.BAD_FIELD: 400,
    Code.INVALID_UTF8: 400,
    Code.INVALID_PROMPT: 400,
    Code.INVALID_PARAMS: 400,
    Code.PROMPT_TOO_LONG: 400,
    Code.TOKEN_OUT_OF_VOCAB: 400,
    Code.MAX_TOKENS_OVER_LIMIT: 400,
    Code.N_OVER_LIMIT: 400,
    Code.UNSUPPORTED_VERSION: 400,
    Code.TOO_LARGE: 413,
    Code.UNKNOWN_MODEL: 404,
    Code.DEADLINE_EXCEEDED: 504,
}


def error_body(message: str, code: str, param: str | None = None, kind: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {
        "error": {
            "message": message,
            "type": kind or "invalid_request_error",
            "param": param,
            "code": code,
        }
    }


def response_id(job: Job, job_id: str) -> str:
    return ("chatcmpl-" if job.chat else "cmpl-") + job_id


def usage(rec: JobRecord) -> dict[str, Any]:
    """OpenAI's usage: the prompt once, the output tokens of every choice."""
    prompt, out = rec.prompt_tokens or 0, rec.output_tokens or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": out,
        "total_tokens": prompt + out,
        "prompt_tokens_details": {"cached_tokens": rec.cached_tokens or 0},
    }


def logprobs_body(job: Job, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The worker's logprob entries ({token_id, token, logprob, top: [[id, logprob]],
    top_tokens}) in the chat or completions shape."""
    if job.logprobs is None or entries is None:
        return None

    def tok(e: dict[str, Any]) -> str:
        return e["token"] if isinstance(e.get("token"), str) else ""

    def top(e: dict[str, Any]) -> list[tuple[str, float]]:
        texts = e.get("top_tokens") or [""] * len(e.get("top", []))
        return [(t, lp) for t, (_, lp) in zip(texts, e.get("top", []), strict=False)]

    if job.chat:
        return {
            "content": [
                {
                    "token": tok(e),
                    "logprob": e["logprob"],
                    "bytes": list(tok(e).encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top(e)
                    ],
                }
                for e in entries
            ]
        }
    return {
        "tokens": [tok(e) for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [dict(top(e)) for e in entries],
        "text_offset": None,
    }


def completion(job: Job, rec: JobRecord) -> dict[str, Any]:
    """The whole response of a finished job: a choice per choice of its record."""
    return {
        "id": response_id(job, rec.id),
        "object": "chat.completion" if job.chat else "text_completion",
        "created": (rec.created_ms or int(time.time() * 1000)) // 1000,
        "model": job.model,
        "choices": [_choice(job, c) for c in rec.choices],
        "usage": usage(rec),
    }


def _choice(job: Job, c: Choice) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": c.index,
        "logprobs": logprobs_body(job, c.logprobs),
        "finish_reason": c.finish_reason or "stop",
    }
    if job.chat:
        choice["message"] = {"role": "assistant", "content": c.text}
    else:
        choice["text"] = c.text
    return choice


def chunk(
    job: Job,
    job_id: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    first: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    """One stream chunk of choice `index`: a text delta, or (text None) the closing one
    with finish_reason; `first`: the choice's first chunk (a chat's carries the role)."""
    choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish_reason}
    if job.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {
        "id": response_id(job, job_id),
        "object": "chat.completion.chunk" if job.chat else "text_completion",
        "created": created,
        "model": job.model,
        "choices": [choice],
    }


def usage_chunk(job: Job, rec: JobRecord, created: int) -> dict[str, Any]:
    return {
        "id": response_id(job, rec.id),
        "object": "chat.completion.chunk" if job.chat else "text_completion",
        "created": created,
        "model": job.model,
        "choices": [],
        "usage": usage(rec),
    }
