"""Redis replies as text, whatever the connection decodes."""

from __future__ import annotations

from typing import Any


def valid_text(s: str) -> bool:
    """Whether `s` is valid Unicode text (no lone surrogates), i.e. encodable as UTF-8."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text(v: bytes | str | Any) -> str:
    """`v` as a str: bytes decoded as UTF-8 (bytes that are not UTF-8 become U+FFFD), anything
    else through str()."""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
