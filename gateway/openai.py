"""OpenAI request bodies as queue jobs, and job results as OpenAI responses.

`chat_job` and `completion_job` check what the gateway can check alone (shapes, types, the
fields it does not support) and return the options of a job (producer.request.prepare);
the sampling values themselves are checked by the worker, which refuses bad ones with a
stable code that the gateway answers as a 400. The response builders follow the shapes
of OpenAI's chat.completion, text_completion and their stream chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from broker_config.protocol import Code
from results.records import JobRecord

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
    Code.UNSUPPORTED_VERSION: 400,
    Code.TOO_LARGE: 413,
    Code.UNKNOWN_MODEL: 404,
    Code.DEADLINE_EXCEEDED: 504,
}

# Sampling fields taken as they are (OpenAI's, then the engine's extras, as vLLM takes them).
SAMPLING = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "stop_token_ids",
    # structured output: OpenAI's response_format, and Plurai's regex and choice
    "response_format",
    "regex",
    "choice",
)
# Fields a client may send that change nothing here (safety_identifier and
# prompt_cache_key are OpenAI's successors of `user`).
IGNORED = (
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "modalities",
)
COMMON = (
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "n",
    "stop",
    "priority",
    "lane",
    "cache_salt",
    "metadata",
    "background",
    *SAMPLING,
    *IGNORED,
)
CHAT = (*COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs")
COMPLETION = (*COMMON, "prompt", "logprobs", "echo", "suffix", "best_of")
UNSUPPORTED = {
    "tools": "tool calls",
    "tool_choice": "tool calls",
    "functions": "function calls",
    "function_call": "function calls",
    "logit_bias": "logit_bias",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning_effort",
    "web_search_options": "web search",
}


class BadRequest(ValueError):
    """A request refused before it becomes a job: HTTP `status`, OpenAI `code`, `param`."""

    def __init__(
        self, message: str, code: str = Code.BAD_FIELD, param: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.status = message, code, param, status


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


@dataclass
class Job:
    """What the gateway submits and how it answers: the job options, and the response's
    kind, model name, streaming and logprob settings."""

    options: dict[str, Any]
    chat: bool
    model: str
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: none asked for
    background: bool


def _check_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for name in body:
        if name in UNSUPPORTED:
            raise BadRequest(f"{UNSUPPORTED[name]} are not supported by this server", param=name)
        if name not in allowed:
            raise BadRequest(f"unknown field {name!r}", param=name)


def _int(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise BadRequest(f"{name} must be an integer in [{low}, {high}]", param=name)
    if not low <= v <= high:  # the queue's own code for a value out of range
        raise BadRequest(
            f"{name} must be an integer in [{low}, {high}]", code=Code.INVALID_PARAMS, param=name
        )
    return v


def _bool(body: dict[str, Any], name: str, where: str = "") -> bool:
    """A boolean field; null, as OpenAI's API takes it, is the default false."""
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"{where}{name} must be a boolean", param=where + name)
    return bool(v)


def _common(body: dict[str, Any], default_max_tokens: int) -> tuple[dict[str, Any], Job]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required: one of GET /v1/models", param="model")
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):  # not true, not 1.0
        raise BadRequest("n must be 1: send one request per choice", param="n")
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    # include_obfuscation pads chunks against size side channels: none here, so it is moot
    if so is not None and (
        not isinstance(so, dict) or set(so) - {"include_usage", "include_obfuscation"}
    ):
        raise BadRequest(
            "stream_options takes only include_usage and include_obfuscation",
            param="stream_options",
        )
    for name in so or ():
        _bool(so, name, "stream_options.")
    include_usage = _bool(so or {}, "include_usage")
    # both checked; max_completion_tokens, OpenAI's newer name, wins
    max_tokens = _int(body, "max_tokens", 1, 2**31 - 1)
    newer = _int(body, "max_completion_tokens", 1, 2**31 - 1)
    if newer is not None:
        max_tokens = newer
    options: dict[str, Any] = {
        "model": model,
        "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
        # OpenAI's default temperature is 1; the queue's own default is greedy
        "temperature": 1.0,
        **{k: body[k] for k in SAMPLING if body.get(k) is not None},
    }
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("stop must be a string or a list of strings", param="stop")
        options["stop"] = stop
    priority = _int(body, "priority", -(10**6), 10**6)
    if priority is not None:
        options["priority"] = priority
    for name in ("lane", "cache_salt"):
        v = body.get(name)
        if v is not None and not isinstance(v, str):
            raise BadRequest(f"{name} must be a string", param=name)
        if v is not None:
            options[name] = v
    if body.get("metadata") is not None:
        if not isinstance(body["metadata"], dict):
            raise BadRequest("metadata must be an object", param="metadata")
        options["metadata"] = body["metadata"]
    background = _bool(body, "background")
    job = Job(options, False, model, stream, include_usage, None, background)
    return options, job


def _text_content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise BadRequest(
        f"messages[{i}].content must be a string or a list of text parts",
        code=Code.INVALID_PROMPT,
        param=f"messages[{i}].content",
    )


def chat_job(body: dict[str, Any], default_max_tokens: int) -> Job:
    _check_fields(body, CHAT)
    options, job = _common(body, default_max_tokens)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            "messages must be a non-empty list", code=Code.INVALID_PROMPT, param="messages"
        )
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(
                f"messages[{i}] must be an object with a role",
                code=Code.INVALID_PROMPT,
                param=f"messages[{i}]",
            )
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise BadRequest(
                f"messages[{i}] holds {sorted(extra)}: only role and content are supported",
                code=Code.INVALID_PROMPT,
                param=f"messages[{i}]",
            )
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise BadRequest(
                f"messages[{i}].name must be a string",
                code=Code.INVALID_PROMPT,
                param=f"messages[{i}].name",
            )
        chat.append({"role": m["role"], "content": _text_content(m.get("content"), i)})
    options["messages"] = chat
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if logprobs:
        job.logprobs = options["logprobs"] = top or 0
    job.chat = True
    return job


def completion_job(body: dict[str, Any], default_max_tokens: int) -> Job:
    _check_fields(body, COMPLETION)
    options, job = _common(body, default_max_tokens)
    for name in ("echo", "best_of", "suffix"):
        v = body.get(name)
        if v is not None and v is not False and not (name == "best_of" and v == 1):
            raise BadRequest(f"{name} is not supported by this server", param=name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        options["prompt"] = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        options["token_ids"] = prompt
    else:
        raise BadRequest(
            "prompt must be a string or a list of token ids (one prompt per request)",
            code=Code.INVALID_PROMPT,
            param="prompt",
        )
    logprobs = _int(body, "logprobs", 0, 20)
    if logprobs is not None:
        job.logprobs = options["logprobs"] = logprobs
    return job


# -- responses --------------------------------------------------------------------------


def response_id(job: Job, job_id: str) -> str:
    return ("chatcmpl-" if job.chat else "cmpl-") + job_id


def usage(rec: JobRecord) -> dict[str, Any]:
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
    """The whole response of a finished job."""
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": logprobs_body(job, rec.logprobs),
        "finish_reason": rec.finish_reason or "stop",
    }
    if job.chat:
        choice["message"] = {"role": "assistant", "content": rec.text or ""}
    else:
        choice["text"] = rec.text or ""
    return {
        "id": response_id(job, rec.id),
        "object": "chat.completion" if job.chat else "text_completion",
        "created": (rec.created_ms or int(time.time() * 1000)) // 1000,
        "model": job.model,
        "choices": [choice],
        "usage": usage(rec),
    }


def chunk(
    job: Job,
    job_id: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    first: bool = False,
) -> dict[str, Any]:
    """One stream chunk: a text delta, or (text None) the closing one with finish_reason."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
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
