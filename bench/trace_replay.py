"""A production trace as the serving bench's requests: prompts made of token blocks, so that
requests that share blocks in the trace share them here too.

The trace's format is Mooncake's (FAST'25 release; ../shared/traces/ holds its conversation
trace): one JSON object a line, `timestamp` (ms from the trace's start), `input_length` and
`output_length` (tokens), and `hash_ids`, the prompt's blocks of `TRACE_BLOCK` tokens, equal
ids for equal blocks (the last block may be partial). Any trace of that format replays.

    requests = replay(read_trace(path), vocab=2048, scale=1 / 16, rate=4.0, seed=0)

Lengths shrink by `scale` (a 512-token block becomes a 32-token one at 1/16; outputs
likewise, at least one token), since the bench's models are small and its machine slow.
Block `h` is the same `scale * 512` token ids wherever it stands, drawn from a generator
seeded by (seed, h), so a prompt's shared blocks are equal token for token and the prefix
caches see what the trace's engines saw. Times keep the trace's pattern (its bursts and
lulls), squeezed or stretched to the offered `rate` (requests/s over the whole run).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512  # tokens of one hash id in Mooncake's traces
FIRST_ID = 3  # token ids below this are the factory tokenizer's special tokens


@dataclass
class TraceEntry:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass
class TraceRequest:
    arrival_s: float  # offset from the start of the run
    prompt_ids: list[int]
    max_tokens: int
    hash_ids: list[int]  # the trace's, for the prefix-sharing figures


def read_trace(path: str | Path, limit: int | None = None, skip: int = 0) -> list[TraceEntry]:
    """The trace's entries in time order (at most `limit`, after the first `skip`); a line
    that is not an entry of the format raises ValueError naming the line."""
    out: list[TraceEntry] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if skip > 0:
                skip -= 1
                continue
            try:
                d = json.loads(line)
                entry = TraceEntry(
                    float(d["timestamp"]),
                    int(d["input_length"]),
                    int(d["output_length"]),
                    [int(h) for h in d["hash_ids"]],
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace entry ({e})") from None
            if entry.input_length < 1 or entry.output_length < 0 or not entry.hash_ids:
                raise ValueError(f"{path}:{n}: empty prompt or negative lengths")
            out.append(entry)
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda e: e.timestamp_ms)
    return out


def block_tokens(h: int, size: int, vocab: int, seed: int) -> list[int]:
    """The token ids of block `h`: the same wherever it stands."""
    rng = random.Random(f"{seed}:{h}")
    return [rng.randrange(FIRST_ID, vocab) for _ in range(size)]


def replay(
    entries: list[TraceEntry], vocab: int, scale: float, rate: float, seed: int = 0
) -> list[TraceRequest]:
    """The entries as requests: lengths times `scale`, arrivals at `rate` requests/s on
    average, with the trace's relative timing."""
    if not entries:
        return []
    block = max(1, round(TRACE_BLOCK * scale))
    start = entries[0].timestamp_ms
    span_s = (entries[-1].timestamp_ms - start) / 1000
    # the trace's own rate over its span, to the offered one (all at once: no span)
    stretch = (len(entries) - 1) / rate / span_s if span_s > 0 else 0.0
    out = []
    for e in entries:
        length = min(max(1, round(e.input_length * scale)), block * len(e.hash_ids))
        prompt: list[int] = []
        for h in e.hash_ids:
            if len(prompt) >= length:
                break
            prompt += block_tokens(h, block, vocab, seed)
        out.append(
            TraceRequest(
                arrival_s=(e.timestamp_ms - start) / 1000 * stretch,
                prompt_ids=prompt[:length],
                max_tokens=max(1, round(e.output_length * scale)),
                hash_ids=e.hash_ids,
            )
        )
    return out
