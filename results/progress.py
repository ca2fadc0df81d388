"""A running job's progress: the output tokens it has made so far (with their logprobs where
asked), from which any worker resumes it after a crash, a drain or a preemption.

One Redis string per job (keys.progress): a header naming the model, then one msgpack
chunk per write, appended as the job's tokens are written out, in the same script call as
its stream's deltas (results/scripts.py, DELTAS), so the stream and the progress always
hold the same tokens:

    b"plurai-progress/1 <model fingerprint>\\n"  [token_ids, logprobs or nil]  [...]  ...

A job of n > 1 choices (its `n`) writes each choice's tokens in chunks of their own,
`[token_ids, logprobs or nil, index]`, in any order; a choice's chunks keep its order.

A worker resumes only from progress it can trust: its own model's header (checked by
BEGIN, which starts the job over with a reset otherwise), chunks that parse, token ids
that are ints, at most max_tokens of them per choice, a choice index for each chunk of a
job of n > 1 and none otherwise, logprobs for every token or for none; the engine then
checks the ids against its vocabulary and context (RequestError bad_progress). Anything
else restarts the job from its first token.
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
    """One choice's output so far."""

    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None  # one entry per token, or None when not asked


def header(fingerprint: str) -> bytes:
    return f"plurai-progress/1 {fingerprint}\n".encode()


def chunk(
    token_ids: list[int], logprobs: list[dict[str, Any]] | None, index: int | None = None
) -> bytes:
    """A chunk of one choice's new tokens; `index` only for a job of n > 1 choices."""
    item = [token_ids, logprobs] if index is None else [token_ids, logprobs, index]
    return msgpack.packb(item, use_bin_type=True)


def limit(head: bytes, max_tokens: int, logprobs: bool, n: int = 1) -> int:
    """The largest progress a job of `max_tokens` and `n` choices can have made: BEGIN
    drops a larger one unread."""
    return len(head) + n * max_tokens * (TOKEN_BYTES + (LOGPROB_BYTES if logprobs else 0))


def parse(
    blob: bytes, head: bytes, max_tokens: int, logprobs: bool, n: int = 1
) -> list[Progress] | None:
    """The progress in `blob` of each of the job's `n` choices, or None where it cannot be
    trusted (see the module's text)."""
    if not blob.startswith(head) or len(blob) > limit(head, max_tokens, logprobs, n):
        return None
    choices = [Progress([], [] if logprobs else None) for _ in range(n)]
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(blob))
    unpacker.feed(blob[len(head) :])
    try:
        for item in unpacker:
            if not isinstance(item, list) or len(item) != (2 if n == 1 else 3):
                return None
            new, entries, *index = item
            i = index[0] if index else 0
            if not isinstance(new, list) or type(i) is not int or not 0 <= i < n:
                return None
            if not all(type(t) is int for t in new):
                return None
            c = choices[i]
            if c.logprobs is not None:
                if not isinstance(entries, list) or len(entries) != len(new):
                    return None
                if not all(_logprob_ok(e, t) for e, t in zip(entries, new, strict=True)):
                    return None
                c.logprobs += entries
            elif entries is not None:
                return None
            c.token_ids += new
            if len(c.token_ids) > max_tokens:
                return None
    except (ValueError, msgpack.UnpackException):
        return None
    return choices


def _logprob_ok(entry: Any, token_id: int) -> bool:
    """A logprob entry as the engines make them, for this token."""
    return (
        isinstance(entry, dict)
        and entry.get("token_id") == token_id
        and isinstance(entry.get("logprob"), (int, float))
        and all(isinstance(k, str) for k in entry)
    )
