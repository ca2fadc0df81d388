"""Wire protocol v1: the request entry on a lane stream, and its validation.

docs/protocol.md is the human description; this module is the executable one. It has no
engine dependency so clients import it cheaply; the worker adds the engine's own checks.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

import msgpack

from gpu_workers.engine.errors import valid_messages

VERSION = "1"
MAX_PRIORITY = 1_000_000  # |priority| of a job; lower runs first within its lane
JSON = "application/json"
MSGPACK = "application/msgpack"
CONTENT_TYPES = (JSON, MSGPACK)

# Sampling fields accepted in the body: exactly SamplingParams' fields
# (gpu_workers/engine/sampling_params.py; a unit test keeps the two equal).
SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "skip_special_tokens",
)
PROMPT_FIELDS = ("prompt", "messages", "token_ids")
BODY_FIELDS = frozenset(PROMPT_FIELDS + SAMPLING_FIELDS + ("model", "metadata", "stream"))

_JOB_ID = re.compile(r"[A-Za-z0-9_-]{8,128}")


class Code:
    """Stable error codes of a failed job (`error_code` in the job record)."""

    # Wire level: the entry itself.
    BAD_BODY = "bad_body"  # body is not valid JSON / msgpack, or not an object
    BAD_FIELD = "bad_field"  # a flat field or body field is missing, unknown or mistyped
    UNSUPPORTED_VERSION = "unsupported_version"
    INVALID_UTF8 = "invalid_utf8"
    UNKNOWN_MODEL = "unknown_model"
    MAX_TOKENS_OVER_LIMIT = "max_tokens_over_limit"
    # Engine level (the same strings as gpu_workers.engine.errors.ErrorCode).
    INVALID_PROMPT = "invalid_prompt"
    PROMPT_TOO_LONG = "prompt_too_long"
    INVALID_PARAMS = "invalid_params"
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"
    # Lifecycle.
    DEADLINE_EXCEEDED = "deadline_exceeded"
    TOO_MANY_DELIVERIES = "too_many_deliveries"  # delivered over max_deliveries times
    INTERNAL = "internal"


class WireError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class NoJobId(WireError):
    """The entry has no usable job id, so no result can be written for it."""


def new_job_id() -> str:
    return secrets.token_urlsafe(16)  # 128 random bits, [A-Za-z0-9_-]{22}


def valid_job_id(job_id: str) -> bool:
    return _JOB_ID.fullmatch(job_id) is not None


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Length metadata when only text is known: ceil(UTF-8 bytes / 4), plus 4 per chat
    message for the template. Exact for token_ids."""
    if isinstance(body.get("token_ids"), list):
        return len(body["token_ids"])
    if isinstance(body.get("messages"), list):
        n = 0
        for m in body["messages"]:
            content = m.get("content", "") if isinstance(m, dict) else ""
            n += 4 + _text_estimate(content if isinstance(content, str) else "")
        return n
    prompt = body.get("prompt")
    return _text_estimate(prompt) if isinstance(prompt, str) else 0


def _text_estimate(text: str) -> int:
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / 4)


def encode_body(body: dict[str, Any], content_type: str = MSGPACK) -> bytes:
    if content_type == MSGPACK:
        return msgpack.packb(body, use_bin_type=True)
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass
class Envelope:
    """The flat fields of one request entry."""

    job_id: str
    max_tokens: int
    prompt_tokens: int | None
    priority: int = 0
    lane: str | None = None
    content_type: str = JSON
    body: bytes = b""
    deadline_ms: int | None = None
    idem: str | None = None


@dataclass
class Request:
    envelope: Envelope
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = None
    params: dict[str, Any] = field(default_factory=dict)  # sampling fields, max_tokens included
    model: str | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = True

    @property
    def prompt_tokens(self) -> int:
        """Length metadata for the capacity check: the entry's, else an estimate."""
        if self.envelope.prompt_tokens is not None:
            return self.envelope.prompt_tokens
        if self.token_ids is not None:
            return len(self.token_ids)
        return estimate_prompt_tokens({"prompt": self.prompt, "messages": self.messages})


def _text(fields: dict[bytes, bytes], name: str) -> str | None:
    raw = fields.get(name.encode())
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(Code.INVALID_UTF8, f"field {name!r} is not valid UTF-8") from None


def _int(fields: dict[bytes, bytes], name: str, required: bool = False) -> int | None:
    text = _text(fields, name)
    if text is None:
        if required:
            raise WireError(Code.BAD_FIELD, f"field {name!r} is required (an integer)")
        return None
    try:
        return int(text)
    except ValueError:
        raise WireError(
            Code.BAD_FIELD, f"field {name!r} must be an integer, got {text[:40]!r}"
        ) from None


def job_id_of(fields: dict[bytes, bytes]) -> str:
    raw = fields.get(b"id")
    job_id = raw.decode("utf-8", "replace") if raw is not None else ""
    if not valid_job_id(job_id):
        raise NoJobId(Code.BAD_FIELD, "field 'id' is missing or not 8-128 of [A-Za-z0-9_-]")
    return job_id


def parse_envelope(fields: dict[bytes, bytes], max_tokens_limit: int) -> Envelope:
    """Check the flat fields. Raises NoJobId first, then WireError with the job id known."""
    job_id = job_id_of(fields)
    version = _text(fields, "v")
    if version is None:
        raise WireError(
            Code.BAD_FIELD, f"field 'v' (protocol version) is required; send '{VERSION}'"
        )
    if version != VERSION:
        raise WireError(
            Code.UNSUPPORTED_VERSION,
            f"protocol version {version[:20]!r} is not supported; this worker speaks '{VERSION}'",
        )
    max_tokens = _int(fields, "max_tokens", required=True)
    assert max_tokens is not None
    if max_tokens <= 0:
        raise WireError(
            Code.INVALID_PARAMS, f"max_tokens must be a positive integer, got {max_tokens}"
        )
    if max_tokens > max_tokens_limit:
        raise WireError(
            Code.MAX_TOKENS_OVER_LIMIT,
            f"max_tokens {max_tokens} is over this deployment's limit of {max_tokens_limit}",
        )
    prompt_tokens = _int(fields, "prompt_tokens")
    if prompt_tokens is not None and prompt_tokens < 0:
        raise WireError(Code.BAD_FIELD, "field 'prompt_tokens' must be >= 0")
    content_type = _text(fields, "content_type") or JSON
    if content_type not in CONTENT_TYPES:
        raise WireError(
            Code.BAD_FIELD,
            f"content_type {content_type[:60]!r} is not one of {list(CONTENT_TYPES)}",
        )
    body = fields.get(b"body")
    if body is None:
        raise WireError(Code.BAD_FIELD, "field 'body' is required")
    return Envelope(
        job_id=job_id,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        priority=_priority(_int(fields, "priority") or 0),
        lane=_text(fields, "lane"),
        content_type=content_type,
        body=body,
        deadline_ms=_int(fields, "deadline"),
        idem=_text(fields, "idem"),
    )


def _priority(p: int) -> int:
    if abs(p) > MAX_PRIORITY:
        raise WireError(
            Code.BAD_FIELD, f"priority must be from -{MAX_PRIORITY} to {MAX_PRIORITY}, got {p}"
        )
    return p


def engine_priority(lane_rank: int, priority: int) -> int:
    """The priority a worker gives its engine: every request of a higher lane (rank 0 is the
    top) before any of a lower one, then the job's own priority. Aging inside the engine
    moves a request by one unit per priority_aging_steps, so it never crosses a lane."""
    return lane_rank * (2 * MAX_PRIORITY + 1) + priority


def decode_body(env: Envelope) -> dict[str, Any]:
    try:
        if env.content_type == MSGPACK:
            body = msgpack.unpackb(env.body, raw=False, strict_map_key=True)
        else:
            body = json.loads(env.body)
    except UnicodeDecodeError:
        raise WireError(
            Code.INVALID_UTF8, "the body contains a string that is not valid UTF-8"
        ) from None
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        kind = "msgpack" if env.content_type == MSGPACK else "JSON"
        raise WireError(
            Code.BAD_BODY, f"body is not valid {kind} ({type(e).__name__}: {str(e)[:120]})"
        ) from None
    if not isinstance(body, dict):
        raise WireError(Code.BAD_BODY, f"body must be an object (map), got {type(body).__name__}")
    return body


def parse_request(fields: dict[bytes, bytes], max_tokens_limit: int) -> Request:
    """Envelope plus body; every wire-level error is raised here as WireError."""
    env = parse_envelope(fields, max_tokens_limit)
    body = decode_body(env)
    unknown = sorted(str(k) for k in set(body) - BODY_FIELDS)
    if unknown:
        raise WireError(
            Code.BAD_FIELD, f"unknown body field(s) {unknown}; allowed: {sorted(BODY_FIELDS)}"
        )
    given = [k for k in PROMPT_FIELDS if body.get(k) is not None]
    if len(given) != 1:
        raise WireError(
            Code.INVALID_PROMPT,
            "give exactly one of 'prompt' (string), 'messages' (list of {role, content}) "
            f"or 'token_ids' (list of integers); got {given or 'none'}",
        )
    req = Request(envelope=env)
    if "prompt" in given:
        if not isinstance(body["prompt"], str):
            raise WireError(
                Code.INVALID_PROMPT,
                f"'prompt' must be a string, got {type(body['prompt']).__name__}",
            )
        req.prompt = body["prompt"]
    elif "messages" in given:
        msgs = body["messages"]
        if not valid_messages(msgs):
            raise WireError(
                Code.INVALID_PROMPT,
                "'messages' must be a non-empty list of {role: str, content: str}",
            )
        req.messages = msgs
    else:
        ids = body["token_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise WireError(Code.INVALID_PROMPT, "'token_ids' must be a list of integers")
        req.token_ids = ids
    params = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    if "max_tokens" in params and params["max_tokens"] != env.max_tokens:
        raise WireError(
            Code.BAD_FIELD,
            f"body max_tokens {params['max_tokens']!r} differs from the entry's max_tokens field "
            f"{env.max_tokens}; send one value (the field is enough)",
        )
    params["max_tokens"] = env.max_tokens
    req.params = params
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise WireError(Code.BAD_FIELD, "'model' must be a string")
    req.model = model
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise WireError(Code.BAD_FIELD, "'metadata' must be an object")
    req.metadata = metadata
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise WireError(Code.BAD_FIELD, "'stream' must be a boolean")
    req.stream = stream
    return req
