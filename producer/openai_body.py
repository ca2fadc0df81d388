"""OpenAI request bodies (chat and completions) as job options: one parser for the gateway's
live endpoints and for batch input lines (producer/bulk), so a body runs the same either way.

`chat_job` and `completion_job` check what can be checked without a worker (shapes, types,
the fields this server does not support) and return the options of a job
(producer.request.prepare); the sampling values themselves are checked by the worker, which
refuses bad ones with a stable code. Defaults are OpenAI's: temperature 1, max_tokens 16 for a
completion; a chat's max_tokens is the caller's `default_max_tokens`
(PLURAI_GATEWAY_DEFAULT_MAX_TOKENS). `n` > 1 asks for that many choices of one job (its
bound, PLURAI_MAX_N, is the worker's to check, as max_tokens' is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plurai.broker_config.protocol import Code

# max_tokens of a completion that gives none: OpenAI's (a chat's is the caller's default)
COMPLETION_MAX_TOKENS = 16

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
    "speculate",
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
    n: int = 1  # choices


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


def _common(
    body: dict[str, Any], default_max_tokens: int, model_required: bool
) -> tuple[dict[str, Any], Job]:
    model = body.get("model")
    if model is None and not model_required:
        model = ""
    elif not isinstance(model, str) or not model:
        raise BadRequest("model is required: one of GET /v1/models", param="model")
    n = _int(body, "n", 1, 2**31 - 1) or 1
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
    if n > 1:  # a job of one choice leaves it out, as before n was taken
        options["n"] = n
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
    job = Job(options, False, model, stream, include_usage, None, background, n)
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


def chat_job(body: dict[str, Any], default_max_tokens: int, model_required: bool = True) -> Job:
    _check_fields(body, CHAT)
    options, job = _common(body, default_max_tokens, model_required)
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


def completion_job(body: dict[str, Any], model_required: bool = True) -> Job:
    _check_fields(body, COMPLETION)
    options, job = _common(body, COMPLETION_MAX_TOKENS, model_required)
    for name in ("echo", "best_of", "suffix"):
        v = body.get(name)
        if v is not None and v is not False and not (name == "best_of" and v == 1):
            raise BadRequest(f"{name} is not supported by this server", param=name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if prompt == "":
        raise BadRequest("prompt must not be empty", code=Code.INVALID_PROMPT, param="prompt")
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
