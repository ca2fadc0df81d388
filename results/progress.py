"""A running job's progress: the output tokens it has made so far (with their logprobs where
asked), from which any worker resumes it after a crash, a drain or a preemption.

One Redis string per job (keys.progress): a header naming the model, then one msgpack
chunk per write, appended as the job's tokens are written out, in the same script call as
its stream's deltas (results/scripts.py, DELTAS), so the stream and the progress always
hold the same tokens:

    b"plurai-progress/1 <model fingerprint>\\n"  [token_ids, logprobs or nil]  [...]  ...

A worker resumes only from progress it can trust: its own model's header (checked by
BEGIN, which starts the job over with a reset otherwise), chunks that parse, token ids
that are ints, at most max_tokens of them, logprobs for every token or for none; the
engine then checks the ids against its vocabulary and context (RequestError
bad_progress). Anything else restarts the job from its first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

# bytes a token's chunk entry may take: its id, and its logprob entry where asked (the
# token's text and the top 20 alternatives with theirs)
TOKEN_BYTES = 16
LOGPROB_BYTES = 4096


@dataclass
class Progress:
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None  # one entry per token, or None when not asked


def header(fingerprint: str) -> bytes:
    return f"plurai-progress/1 {fingerprint}\n".encode()


def chunk(token_ids: list[int], logprobs: list[dict[str, Any]] | None) -> bytes:
    return msgpack.packb([token_ids, logprobs], use_bin_type=True)


def limit(head: bytes, max_tokens: int, logprobs: bool) -> int:
    """The largest progress a job of `max_tokens` can have made: BEGIN drops a larger one
    unread."""
    return len(head) + max_tokens * (TOKEN_BYTES + (LOGPROB_BYTES if logprobs else 0))


def parse(blob: bytes, head: bytes, max_tokens: int, logprobs: bool) -> Progress | None:
    """The progress in `blob`, or None where it cannot be trusted (see the module's text)."""
    if not blob.startswith(head) or len(blob) > limit(head, max_tokens, logprobs):
        return None
    ids: list[int] = []
    lps: list[dict[str, Any]] = []
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(blob))
    unpacker.feed(blob[len(head) :])
    try:
        for item in unpacker:
            if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], list):
                return None
            new, entries = item
            if not all(type(t) is int for t in new):
                return None
            if logprobs:
                if not isinstance(entries, list) or len(entries) != len(new):
                    return None
                if not all(_logprob_ok(e, t) for e, t in zip(entries, new, strict=True)):
                    return None
                lps += entries
            elif entries is not None:
                return None
            ids += new
            if len(ids) > max_tokens:
                return None
    except (ValueError, msgpack.UnpackException):
        return None
    return Progress(ids, lps if logprobs else None)


def _logprob_ok(entry: Any, token_id: int) -> bool:
    """A logprob entry as the engines make them, for this token."""
    return (
        isinstance(entry, dict)
        and entry.get("token_id") == token_id
        and isinstance(entry.get("logprob"), (int, float))
        and all(isinstance(k, str) for k in entry)
    )
