"""Parse and validate input lines.

An OpenAI Batch line: {"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}. A document line (with a task): {"custom_id" or "id",
"text"}. Each line becomes a request dict or an error (code, message); a bad line never
stops the others. A custom_id must be a non-empty string of valid Unicode, and so must every
string of a line (JSON can escape a lone surrogate, which no UTF-8 store can hold).
"""

from __future__ import annotations

import json
from typing import Any

from plurai.broker_config import protocol
from plurai.broker_config.text import valid_text
from plurai.producer import openai_body

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
URLS = (CHAT, COMPLETIONS)

# Body fields of the live endpoints that a batch line cannot honour: the batch sets the
# lane and runs to its end, and its output lines hold no logprobs.
_NOT_IN_BATCH = {
    "lane": "a batch runs in the batch lane",
    "background": "a batch runs to its end",
    "logprobs": "batch output lines hold no logprobs",
    "top_logprobs": "batch output lines hold no logprobs",
}


class LineError(ValueError):
    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.custom_id = custom_id


def parse_line(
    raw: str,
    number: int,
    *,
    documents: bool,
    max_line_bytes: int,
    max_tokens_limit: int,
    default_max_tokens: int,
) -> dict[str, Any]:
    """The request of input line `number` (1-based), or raises LineError."""
    where = f"line {number}"
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise LineError("invalid_json", f"{where}: not valid JSON ({e})") from None
    given = (
        obj.get("custom_id", obj.get("id") if documents else None)
        if isinstance(obj, dict)
        else None
    )
    cid = given if isinstance(given, str) and given and valid_text(given) else None
    if given is not None and cid is None:  # the error line must not carry it either
        what = (
            f"a {type(given).__name__}"
            if not isinstance(given, str)
            else "empty"
            if not given
            else "not valid Unicode"
        )
        raise LineError(
            "invalid_custom_id",
            f"{where}: custom_id must be a non-empty string of valid Unicode; it is {what}",
        )
    size = len(raw.encode("utf-8", "replace"))
    if size > max_line_bytes:
        raise LineError(
            "line_too_large", f"{where}: {size} bytes, over the limit of {max_line_bytes}", cid
        )
    if not isinstance(obj, dict):
        raise LineError("invalid_request", f"{where}: expected a JSON object")
    if not valid_text(json.dumps(obj, ensure_ascii=False)):
        raise LineError(
            "invalid_request",
            f"{where}: a string is not valid Unicode (a lone surrogate such as \\ud800)",
            cid,
        )
    if cid is None:
        want = "custom_id (or id)" if documents else "custom_id"
        raise LineError("missing_custom_id", f"{where}: {want} must be a non-empty string")
    if documents:
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            raise LineError("invalid_request", f"{where}: text must be a non-empty string", cid)
        return {"custom_id": cid, "kind": "doc", "text": text}
    return _openai(obj, cid, where, max_tokens_limit, default_max_tokens)


def _openai(
    obj: dict[str, Any], cid: str, where: str, limit: int, default_max_tokens: int
) -> dict[str, Any]:
    """The line's body through the gateway's own parser (producer/openai_body.py): the same
    options as the same body sent live, less what a batch sets itself (lane, stream)."""

    def bad(code: str, message: str) -> LineError:
        return LineError(code, f"{where}: {message}", cid)

    method = obj.get("method", "POST")
    if method != "POST":
        raise bad("invalid_method", f"method {method!r}: only POST is supported")
    url = obj.get("url")
    if url not in URLS:
        raise bad("invalid_url", f"url {url!r} is not supported; use one of {', '.join(URLS)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise bad("invalid_body", "body must be a JSON object")
    for name, why in _NOT_IN_BATCH.items():
        value = body.get(name)
        if value is not None and value is not False:  # 0 asks for logprobs: not "off"
            raise bad("invalid_body", f"{name} is not taken in a batch line: {why}")
    try:
        job = (
            openai_body.chat_job(body, default_max_tokens, model_required=False)
            if url == CHAT
            else openai_body.completion_job(body, model_required=False)
        )
    except openai_body.BadRequest as e:
        where_in = f"body.{e.param}: " if e.param else ""
        raise bad("invalid_body", where_in + e.message) from None
    options = {k: v for k, v in job.options.items() if k != "model"}
    if options["max_tokens"] > limit:
        raise bad(
            "max_tokens_over_limit", f"max_tokens {options['max_tokens']} is over the limit {limit}"
        )
    try:  # as the driver sends it: msgpack holds no integer beyond 64 bits
        protocol.encode_body(options)
    except (OverflowError, ValueError) as e:
        raise bad("invalid_body", f"a value cannot be sent: {e}") from None
    kind = "chat" if url == CHAT else "completion"
    return {"custom_id": cid, "kind": kind, "options": options, "model": job.model or None}
