"""Wire protocol v1: the request entry on a lane stream, and its validation.

docs/protocol.md is the human description; this module is the executable one. It has no
engine dependency so clients import it cheaply; the worker adds the engine's own checks.
The body field's decoding (JSON or msgpack, plain JSON values only) is broker_config/body.py;
the error codes an entry is refused with are broker_config/errors.py's `Code`.

One file, though long: the entry's fields, their bounds and their checks are protocol v1 as
one executable description, read beside docs/protocol.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

import msgpack

from plurai.broker_config import tracing
from plurai.broker_config.body import CONTENT_TYPES, INT64, JSON, MSGPACK, decode
from plurai.broker_config.errors import Code, NoJobId, WireError, valid_messages
from plurai.broker_config.text import text

VERSION = "2"  # what clients send; workers also take "1" entries (the same fields)
VERSIONS = ("1", "2")
MAX_PRIORITY = 1_000_000  # |priority| of a job; lower runs first within its lane

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
    "speculate",
    "response_format",
    "regex",
    "choice",
    "n",
)
PROMPT_FIELDS = ("prompt", "messages", "token_ids")
BODY_FIELDS = frozenset(
    PROMPT_FIELDS
    + SAMPLING_FIELDS
    + ("model", "metadata", "stream", "cache_salt", "special_tokens")
)

_JOB_ID = re.compile(r"[A-Za-z0-9_-]{8,128}")
# a tenant's name: no ':' (the separator of what is scoped under a tenant), nothing a key's
# hash tag or a metric label could take for syntax
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANT_CHARS = 64
DEFAULT_TENANT = "default"  # the tenant of a job that names none
_MODEL = re.compile(r"[A-Za-z0-9._/-]{1,128}")  # no ':', '{', '}': a key's hash tag holds it
_INT = re.compile(rb"-?[0-9]{1,19}")  # ASCII digits only: no '1_000', ' 5', '١٢'
MAX_FIELDS = 32  # flat fields of one entry (v1 defines 11)


@dataclass(frozen=True)
class Limits:
    """Sizes a request may have on the wire, each refused before any tokenization
    (docs/protocol.md, "Limits"). Settings carries the deployment's values."""

    max_tokens: int = 4096
    body_bytes: int = 4 << 20  # the entry's body field
    prompt_chars: int = 1 << 20  # `prompt`, or all of `messages` (roles and contents)
    messages: int = 1024  # entries of `messages`
    stop: int = 16  # strings in `stop`
    stop_chars: int = 256  # characters of one stop string
    stop_token_ids: int = 256
    metadata_bytes: int = 16 << 10  # `metadata` as compact JSON
    depth: int = 16  # nesting of lists and maps in the body
    logprobs: int = 20
    grammar_bytes: int = 64 << 10  # `response_format`, `regex` or `choice`, as compact JSON
    cache_salt_chars: int = 256
    n: int = 16  # choices of one request (its `n`)
    # Tokens a prompt may have: the engine's max_model_len less one (the worker sets it);
    # a `prompt_tokens` claim or `token_ids` list over it is refused at once.
    prompt_tokens: int | None = None


def tenant_salt(tenant: str, cache_salt: str | None) -> str:
    """A tenant's cache salt: its name, or a client's own salt scoped under it ('tenant:salt',
    or 'tenant:sha256:<hex>' where that would exceed the salt length), so that two tenants'
    requests never share cached prefixes, whatever salts they pick."""
    if not cache_salt:
        return tenant
    scoped = f"{tenant}:{cache_salt}"
    if len(scoped) <= Limits.cache_salt_chars:
        return scoped
    digest = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{tenant}:sha256:{digest}"


def tenant_name(tenant: Any) -> str:
    """`tenant` if it can name a tenant; else ValueError saying what is allowed."""
    if not isinstance(tenant, str) or _TENANT.fullmatch(tenant) is None:
        raise ValueError(
            f"tenant name {str(tenant)[:80]!r}: 1 to {TENANT_CHARS} letters, digits, '.', "
            "'-' or '_', starting with a letter or digit"
        )
    return tenant


def new_job_id() -> str:
    """128 random bits, [A-Za-z0-9_-]{22}, never starting with '-': a command line would
    take such an id for an option (`plurai get -x...`)."""
    while True:
        job_id = secrets.token_urlsafe(16)
        if job_id[0] != "-":
            return job_id


def model_name(name: str) -> str:
    """`name` if it can name a model's queue; else ValueError saying what is allowed."""
    if not isinstance(name, str) or _MODEL.fullmatch(name) is None:
        raise ValueError(
            f"model name {str(name)[:140]!r}: use 1-128 letters, digits, '.', '_', '-' or '/'"
        )
    return name


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
    attempts: int = 0  # processings of this job that failed (carried over by REQUEUE)
    # failed processings after which the job runs no more (its own `max_retries` + 1,
    # within the deployment's PLURAI_MAX_DELIVERIES); None: the deployment's
    max_deliveries: int | None = None
    # a failed job's wait before it runs again: this, doubled at each failure (retry_backoff)
    retry_backoff_ms: int = 0
    # the submit's trace context (W3C traceparent), read only while tracing is on; a field
    # that is not a valid one is ignored (broker_config/tracing.py)
    traceparent: str | None = None
    # whose job it is: the gateway's API key's tenant, or a client's own
    tenant: str = DEFAULT_TENANT


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
    cache_salt: str | None = None
    special_tokens: bool = False  # opt-in: special-token strings in the prompt are control tokens

    @property
    def n(self) -> int:
        """The choices it asks for: its `n` where that is a count (any other value the
        engine refuses), else 1."""
        n = self.params.get("n", 1)
        return n if type(n) is int and n >= 1 else 1

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
    raw = fields.get(name.encode())
    if raw is None:
        if required:
            raise WireError(Code.BAD_FIELD, f"field {name!r} is required (an integer)")
        return None
    if _INT.fullmatch(raw) is not None and -INT64 <= (value := int(raw)) < INT64:
        return value
    shown = _text(fields, name) or ""  # not UTF-8 at all: invalid_utf8 first
    raise WireError(
        Code.BAD_FIELD,
        f"field {name!r} must be an integer (ASCII digits, optional '-', 64-bit), "
        f"got {shown[:40]!r}",
    )


def job_id_of(fields: dict[bytes, bytes]) -> str:
    raw = fields.get(b"id")
    job_id = text(raw) if raw is not None and len(raw) <= 128 else ""
    if not valid_job_id(job_id):
        raise NoJobId(Code.BAD_FIELD, "field 'id' is missing or not 8-128 of [A-Za-z0-9_-]")
    return job_id


MAX_RETRIES = 100  # the most `max_retries` a job may ask for
MAX_BACKOFF_MS = 3_600_000  # the longest a failed job waits to run again (and its base)


def max_deliveries_of(fields: dict[bytes, bytes], deployment: int) -> int:
    """The failed processings after which the job runs no more: its `max_retries` + 1,
    never over the deployment's PLURAI_MAX_DELIVERIES; the deployment's where it asks
    none or sends one that is not a count (parse_envelope refuses that job)."""
    raw = fields.get(b"max_retries")
    if raw is None or not raw.isdigit() or len(raw) > 3:
        return deployment
    return min(deployment, int(raw) + 1)


def attempts_of(fields: dict[bytes, bytes]) -> int:
    """The entry's count of failed processings; 0 when absent or malformed (the entry is
    then refused by parse_envelope anyway)."""
    try:
        return max(0, _int(fields, "attempts") or 0)
    except WireError:
        return 0


def parse_envelope(fields: dict[bytes, bytes], limits: Limits) -> Envelope:
    """Check the flat fields. Raises NoJobId first, then WireError with the job id known."""
    job_id = job_id_of(fields)
    if len(fields) > MAX_FIELDS:
        raise _too_large("the entry's fields", len(fields), MAX_FIELDS, "")
    version = _text(fields, "v")
    if version is None:
        raise WireError(
            Code.BAD_FIELD, f"field 'v' (protocol version) is required; send '{VERSION}'"
        )
    if version not in VERSIONS:
        raise WireError(
            Code.UNSUPPORTED_VERSION,
            f"protocol version {version[:20]!r} is not supported; send '{VERSION}'",
        )
    max_tokens = _int(fields, "max_tokens", required=True)
    assert max_tokens is not None
    if max_tokens <= 0:
        raise WireError(
            Code.INVALID_PARAMS, f"max_tokens must be a positive integer, got {max_tokens}"
        )
    if max_tokens > limits.max_tokens:
        raise WireError(
            Code.MAX_TOKENS_OVER_LIMIT,
            f"max_tokens {max_tokens} is over this deployment's limit of {limits.max_tokens}",
        )
    prompt_tokens = _int(fields, "prompt_tokens")
    if prompt_tokens is not None and prompt_tokens < 0:
        raise WireError(Code.BAD_FIELD, "field 'prompt_tokens' must be >= 0")
    if prompt_tokens is not None:
        _check_prompt_tokens(prompt_tokens, limits, "field 'prompt_tokens' claims")
    attempts = _int(fields, "attempts") or 0
    if attempts < 0:
        raise WireError(Code.BAD_FIELD, "field 'attempts' must be >= 0")
    backoff = _int(fields, "retry_backoff_ms") or 0
    if not 0 <= backoff <= MAX_BACKOFF_MS:
        raise WireError(
            Code.BAD_FIELD, f"field 'retry_backoff_ms' must be 0..{MAX_BACKOFF_MS}, got {backoff}"
        )
    retries = _int(fields, "max_retries")
    if retries is not None and not 0 <= retries <= MAX_RETRIES:
        raise WireError(
            Code.BAD_FIELD, f"field 'max_retries' must be 0..{MAX_RETRIES}, got {retries}"
        )
    content_type = _text(fields, "content_type")
    content_type = JSON if content_type is None else content_type
    if content_type not in CONTENT_TYPES:
        raise WireError(
            Code.BAD_FIELD,
            f"content_type {content_type[:60]!r} is not one of {list(CONTENT_TYPES)}",
        )
    body = fields.get(b"body")
    if body is None:
        raise WireError(Code.BAD_FIELD, "field 'body' is required")
    if len(body) > limits.body_bytes:
        raise WireError(
            Code.TOO_LARGE,
            f"the body has {len(body)} bytes; the limit is {limits.body_bytes} "
            "(PLURAI_MAX_BODY_BYTES)",
        )
    idem = _text(fields, "idem")
    tenant = _tenant(fields)
    return Envelope(
        job_id=job_id,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        priority=_priority(_int(fields, "priority") or 0),
        lane=(_text(fields, "lane") or "")[:128] or None,
        content_type=content_type,
        body=body,
        deadline_ms=_int(fields, "deadline"),
        idem=idem[:512] if idem is not None else None,
        attempts=attempts,
        max_deliveries=None if retries is None else retries + 1,
        retry_backoff_ms=backoff,
        traceparent=tracing.valid(fields.get(b"traceparent")) if tracing.ON else None,
        tenant=tenant,
    )


def _tenant(fields: dict[bytes, bytes]) -> str:
    raw = fields.get(b"tenant")
    if raw is None:
        return DEFAULT_TENANT
    if len(raw) > TENANT_CHARS:  # refused before it is decoded
        raise WireError(
            Code.BAD_FIELD,
            f"field 'tenant' has {len(raw)} bytes; a tenant name has 1 to {TENANT_CHARS}",
        )
    name = _text(fields, "tenant")  # not UTF-8: invalid_utf8
    try:
        return tenant_name(name)
    except ValueError as e:
        raise WireError(Code.BAD_FIELD, f"field 'tenant': {e}") from None


def _check_prompt_tokens(n: int, limits: Limits, what: str) -> None:
    if limits.prompt_tokens is not None and n > limits.prompt_tokens:
        raise WireError(
            Code.PROMPT_TOO_LONG,
            f"{what} {n} prompt tokens; this model serves at most {limits.prompt_tokens} "
            "(its context less one generated token): shorten the prompt",
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


def _too_large(what: str, n: int, limit: int, setting: str) -> WireError:
    where = f" (PLURAI_{setting})" if setting else ""
    return WireError(Code.TOO_LARGE, f"{what} has {n}; the limit is {limit}{where}; send less")


def parse_request(fields: dict[bytes, bytes], limits: Limits) -> Request:
    """Envelope plus body; every wire-level error is raised here as WireError."""
    env = parse_envelope(fields, limits)
    body = decode(env.content_type, env.body, limits.depth)
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
        if len(body["prompt"]) > limits.prompt_chars:
            raise _too_large(
                "'prompt' characters", len(body["prompt"]), limits.prompt_chars, "MAX_PROMPT_CHARS"
            )
        req.prompt = body["prompt"]
    elif "messages" in given:
        msgs = body["messages"]
        if isinstance(msgs, list) and len(msgs) > limits.messages:
            raise _too_large("'messages' entries", len(msgs), limits.messages, "MAX_MESSAGES")
        if not valid_messages(msgs):
            raise WireError(
                Code.INVALID_PROMPT,
                "'messages' must be a non-empty list of {role: str, content: str} "
                "(no other keys: a chat template could render them unescaped)",
            )
        chars = sum(len(m["role"]) + len(m["content"]) for m in msgs)
        if chars > limits.prompt_chars:
            raise _too_large(
                "'messages' (roles and contents) characters",
                chars,
                limits.prompt_chars,
                "MAX_PROMPT_CHARS",
            )
        req.messages = msgs
    else:
        ids = body["token_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise WireError(Code.INVALID_PROMPT, "'token_ids' must be a list of integers")
        _check_prompt_tokens(len(ids), limits, "'token_ids' has")
        req.token_ids = ids
    params = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    _check_sampling_sizes(params, limits)
    if "max_tokens" in params and (
        type(params["max_tokens"]) is not int or params["max_tokens"] != env.max_tokens
    ):
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
    req.model = model[:4096] if model is not None else None
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise WireError(Code.BAD_FIELD, "'metadata' must be an object")
        size = len(json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode())
        if size > limits.metadata_bytes:
            raise _too_large(
                "'metadata' (JSON bytes)", size, limits.metadata_bytes, "MAX_METADATA_BYTES"
            )
    req.metadata = metadata
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise WireError(Code.BAD_FIELD, "'stream' must be a boolean")
    req.stream = stream
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise WireError(Code.BAD_FIELD, "'cache_salt' must be a non-empty string")
    if salt is not None and len(salt) > limits.cache_salt_chars:
        raise _too_large("'cache_salt' characters", len(salt), limits.cache_salt_chars, "")
    req.cache_salt = salt
    special = body.get("special_tokens", False)
    if not isinstance(special, bool):
        raise WireError(Code.BAD_FIELD, "'special_tokens' must be a boolean")
    req.special_tokens = special
    return req


def _check_sampling_sizes(params: dict[str, Any], limits: Limits) -> None:
    """Sizes only: SamplingParams checks types and ranges."""
    stop = params.get("stop")
    if isinstance(stop, list):
        if len(stop) > limits.stop:
            raise _too_large("'stop' strings", len(stop), limits.stop, "MAX_STOP")
        longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
        if longest > limits.stop_chars:
            raise _too_large(
                "a 'stop' string's characters", longest, limits.stop_chars, "MAX_STOP_CHARS"
            )
    elif isinstance(stop, str) and len(stop) > limits.stop_chars:
        raise _too_large(
            "the 'stop' string's characters", len(stop), limits.stop_chars, "MAX_STOP_CHARS"
        )
    ids = params.get("stop_token_ids")
    if isinstance(ids, list) and len(ids) > limits.stop_token_ids:
        raise _too_large("'stop_token_ids'", len(ids), limits.stop_token_ids, "MAX_STOP_TOKEN_IDS")
    n = params.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > limits.n:
        raise WireError(
            Code.N_OVER_LIMIT,
            f"n {n} is over this deployment's limit of {limits.n} choices (PLURAI_MAX_N)",
        )
    lp = params.get("logprobs")
    if isinstance(lp, int) and not isinstance(lp, bool) and lp > limits.logprobs:
        raise _too_large("'logprobs'", lp, limits.logprobs, "MAX_LOGPROBS")
    for name in ("response_format", "regex", "choice"):
        if params.get(name) is not None:
            size = len(json.dumps(params[name], separators=(",", ":"), ensure_ascii=False).encode())
            if size > limits.grammar_bytes:
                raise _too_large(
                    f"'{name}' (JSON bytes)", size, limits.grammar_bytes, "MAX_GRAMMAR_BYTES"
                )
