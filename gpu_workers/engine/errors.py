"""Request errors with stable codes.

Every way a single request can be refused maps to one code here. The engine raises
`RequestError` for that request only and keeps serving the others; the worker turns it
into a terminal error result carrying the same code (docs/protocol.md lists them).
"""

from __future__ import annotations


class ErrorCode:
    INVALID_PROMPT = "invalid_prompt"  # empty, wrong type, or not decodable
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt (+1 generated token) exceeds max_model_len
    INVALID_PARAMS = "invalid_params"  # sampling field unknown or out of range
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"  # token id < 0 or >= vocab size
    DUPLICATE_ID = "duplicate_request_id"  # the id is already running in this engine


class RequestError(ValueError):
    """A request the engine refuses; `code` is stable, `message` says what to fix."""

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
