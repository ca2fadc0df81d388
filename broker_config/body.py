"""The body field of a request entry: its content types, and decoding it into plain JSON
values (the same rule for JSON and msgpack bodies), each refusal a `WireError` with its
code. broker_config/protocol.py parses the entry around it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgpack

from plurai.broker_config.errors import Code, WireError
from plurai.broker_config.text import valid_text

JSON = "application/json"
MSGPACK = "application/msgpack"
CONTENT_TYPES = (JSON, MSGPACK)
INT64 = 2**63
_LONG_INT = re.compile(rb"[0-9]{20}")  # a JSON integer that may exceed 64 bits


def _no_constant(name: str) -> Any:
    raise WireError(Code.BAD_FIELD, f"the body holds {name}; numbers must be finite")


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > 19:  # also spares int() its quadratic cost on huge literals
        raise WireError(Code.BAD_FIELD, f"integer {text[:24]}... is out of the 64-bit range")
    return int(text)


def decode(content_type: str, raw: bytes, depth: int) -> dict[str, Any]:
    """The body `raw` (of `content_type`) as plain JSON values: maps with string keys, lists,
    valid strings, finite floats, 64-bit integers, booleans and null, nested at most
    `depth` deep."""
    try:
        if content_type == MSGPACK:
            # Any key type is decoded so that check_json_value names the bad one.
            body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        else:  # UTF-8 only: json.loads would also take UTF-16 and UTF-32 bytes
            hooks = {"parse_int": _json_int} if _LONG_INT.search(raw) else {}
            body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, **hooks)
    except UnicodeDecodeError:
        raise WireError(
            Code.INVALID_UTF8, "the body contains a string that is not valid UTF-8"
        ) from None
    except (RecursionError, msgpack.exceptions.StackError):
        raise WireError(Code.BAD_FIELD, f"the body is nested more than {depth} deep") from None
    except TypeError:  # msgpack: a list or map as a map key
        raise WireError(Code.BAD_FIELD, "body: map keys must be strings") from None
    except (ValueError, msgpack.UnpackException) as e:
        if isinstance(e, WireError):
            raise
        kind = "msgpack" if content_type == MSGPACK else "JSON"
        raise WireError(
            Code.BAD_BODY, f"body is not valid {kind} ({type(e).__name__}: {str(e)[:120]})"
        ) from None
    if not isinstance(body, dict):
        raise WireError(Code.BAD_BODY, f"body must be an object (map), got {type(body).__name__}")
    check_json_value(body, depth, "body")
    return body


def check_json_value(value: Any, depth: int, where: str) -> None:
    """Raise WireError unless `value` is made of JSON values only (see decode). Errors
    name the top-level field they were found under; no path is built on the way, since a
    4 MiB body can hold two million values."""
    stack: list[tuple[Any, int, str]] = [(value, 0, where)]
    while stack:
        v, d, field = stack.pop()
        t = type(v)
        if t is str:
            if not valid_text(v):
                raise WireError(
                    Code.INVALID_UTF8, f"{field} holds a lone surrogate (not valid Unicode text)"
                )
        elif t is int:
            if not -INT64 <= v < INT64:
                raise WireError(Code.BAD_FIELD, f"{field}: an integer is out of the 64-bit range")
        elif t is float:
            if not math.isfinite(v):
                raise WireError(Code.BAD_FIELD, f"{field}: numbers must be finite, got {v}")
        elif t is list or t is dict:
            if d >= depth:
                raise WireError(Code.BAD_FIELD, f"{field}: nested more than {depth} deep")
            if t is list:
                for x in v:  # integers checked in place: token id lists are long
                    if type(x) is int:
                        if not -INT64 <= x < INT64:
                            raise WireError(
                                Code.BAD_FIELD, f"{field}: an integer is out of the 64-bit range"
                            )
                    elif x is not None and type(x) is not bool:
                        stack.append((x, d + 1, field))
                continue
            for k, x in v.items():
                if type(k) is not str:
                    raise WireError(
                        Code.BAD_FIELD, f"{field}: map keys must be strings, got {type(k).__name__}"
                    )
                sub = f"body field {k[:40]!r}" if d == 0 else field
                stack.append((k, d + 1, sub))
                stack.append((x, d + 1, sub))
        elif v is not None and t is not bool:  # msgpack bin, ext, timestamp
            raise WireError(
                Code.BAD_FIELD,
                f"{field}: {t.__name__} values are not allowed; use JSON types "
                "(string, number, boolean, null, list, map)",
            )
