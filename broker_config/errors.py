"""Error codes of a refused request, defined once for every layer.

The engine (gpu_workers/engine/errors.py) raises `RequestError` with these codes; the
wire parser (broker_config/protocol.py) refuses entries with the same strings
(`protocol.Code` takes them from here); the worker turns either into a terminal error
result carrying the code (docs/protocol.md lists them). This module sits at the bottom of
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


class CodedError(ValueError):
    """A refusal with a stable `code` and a `message` that says what to fix: the base of
    the engine's `RequestError` and of the wire's `WireError`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


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
