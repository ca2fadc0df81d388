"""Error codes of a refused request, defined once for every layer.

The engine (gpu_workers/engine/errors.py) raises `RequestError` with these codes; the
wire parser (broker_config/protocol.py, broker_config/body.py) refuses entries with the
same strings as `WireError`s (`Code` holds every code a job can end with); the worker
turns either into a terminal error result carrying the code (docs/protocol.md lists
them). This module sits at the bottom of
the import layering, so both sides import it and it imports nothing of theirs.
"""

from __future__ import annotations


class ErrorCode:
    """The codes a request can be refused with by the engine."""

    INVALID_PROMPT = "invalid_prompt"  # empty, wrong type, or not decodable
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt (+1 generated token) exceeds max_model_len
    INVALID_PARAMS = "invalid_params"  # sampling field unknown or out of range
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"  # token id < 0 or >= vocab size
    DUPLICATE_ID = "duplicate_request_id"  # the id is already running in this engine
    # the output tokens a resumed request brings cannot be continued exactly (out of range,
    # too many, refused by its grammar, already finished, or a backend that cannot resume)
    BAD_PROGRESS = "bad_progress"


class CodedError(ValueError):
    """A refusal with a stable `code` and a `message` that says what to fix: the base of
    the engine's `RequestError` and of the wire's `WireError`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Code:
    """Stable error codes of a failed job (`error_code` in the job record)."""

    # Wire level: the entry itself.
    BAD_BODY = "bad_body"  # body is not valid JSON / msgpack, or not an object
    BAD_FIELD = "bad_field"  # a flat field or body field is missing, unknown or mistyped
    TOO_LARGE = "too_large"  # a size over one of the Limits
    UNSUPPORTED_VERSION = "unsupported_version"
    INVALID_UTF8 = "invalid_utf8"
    UNKNOWN_MODEL = "unknown_model"
    MAX_TOKENS_OVER_LIMIT = "max_tokens_over_limit"
    N_OVER_LIMIT = "n_over_limit"  # more choices (`n`) than PLURAI_MAX_N
    # Engine level: the engine's own codes (ErrorCode above, defined once).
    INVALID_PROMPT = ErrorCode.INVALID_PROMPT
    PROMPT_TOO_LONG = ErrorCode.PROMPT_TOO_LONG
    INVALID_PARAMS = ErrorCode.INVALID_PARAMS
    TOKEN_OUT_OF_VOCAB = ErrorCode.TOKEN_OUT_OF_VOCAB
    BAD_PROGRESS = ErrorCode.BAD_PROGRESS
    # Lifecycle.
    DEADLINE_EXCEEDED = "deadline_exceeded"
    TOO_MANY_DELIVERIES = "too_many_deliveries"  # its processing failed max_deliveries times
    BAD_RECORD = "bad_record"  # the job's record or token stream in Redis has the wrong type
    INTERNAL = "internal"
    # Refusals of a submit (nothing queued, no record): the SDK's exceptions' `code`.
    QUEUE_FULL = "queue_full"  # the lane holds PLURAI_MAX_QUEUED_PER_LANE waiting jobs
    REDIS_OOM = "redis_oom"  # Redis is at maxmemory (noeviction): it refuses new writes


class WireError(CodedError):
    """An entry the wire parser refuses; `code` is one of `Code`."""


class NoJobId(WireError):
    """The entry has no usable job id, so no result can be written for it."""


def valid_messages(messages: object) -> bool:
    """A non-empty list of {role: str, content: str}, nothing else: what chat templates are
    given (another key, e.g. `name`, would reach the template without the escaping of
    special-token text that contents get). The wire parser and the engine refuse anything
    else with INVALID_PROMPT."""
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict)
            and m.keys() == {"role", "content"}
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )
