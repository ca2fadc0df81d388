"""The batch record `plurai:batch:<id>` and its per-line results.

Statuses follow OpenAI's Batch API: validating → in_progress → finalizing → completed,
or failed (no valid line), cancelling → cancelled, expired. Counts: total, completed,
failed. Each input line gets exactly one result line (HSETNX), and the counts move in the
same script, so a retried step can neither duplicate a line nor count it twice.

Every key of a batch (keys.batch_all) expires: BulkSettings.running_ttl_s after it was last
written or renewed while the batch runs (each write that creates a key sets it, each pass
renews it), BulkSettings.ttl_s after the batch ends. A batch id names keys and files, so
only ids of letters, digits, `_` and `-` are accepted (check_id).
"""

from __future__ import annotations

import re
import time
from typing import Any

import redis

from broker_config import keys

VALIDATING = "validating"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
FAILED = "failed"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
EXPIRED = "expired"
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED, EXPIRED})

BATCH_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

# KEYS: lines, record. ARGV: index, line JSON, ok (1/0), prompt tokens, output tokens,
# now ms, TTL seconds of both keys.
_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[3] == '1' and 'completed' or 'failed', 1)
redis.call('HINCRBY', KEYS[2], 'prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[2], 'output_tokens', ARGV[5])
redis.call('HSET', KEYS[2], 'beat_ms', ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('EXPIRE', KEYS[2], ARGV[7])
return 1
"""
# KEYS: record. The new generation, or false if there is no record (HINCRBY alone would
# create one, without a TTL).
_BUMP_GEN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
return redis.call('HINCRBY', KEYS[1], 'gen', 1)
"""
# KEYS: record. ARGV: new status, then the statuses it may replace.
_MOVE = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
for i = 2, #ARGV do
  if cur == ARGV[i] then redis.call('HSET', KEYS[1], 'status', ARGV[1]) return ARGV[1] end
end
return cur
"""


class InvalidBatchId(ValueError):
    """Not a batch id: it could name other keys, or a path outside a folder."""


def check_id(batch_id: str) -> str:
    """`batch_id` if it is a well-formed batch id, else InvalidBatchId."""
    if not isinstance(batch_id, str) or not BATCH_ID.fullmatch(batch_id):
        raise InvalidBatchId(
            f"invalid batch id {batch_id!r}: use 1 to 64 letters, digits, '_' or '-'"
        )
    return batch_id


def now_ms() -> int:
    return int(time.time() * 1000)


def get(r: redis.Redis, batch_id: str) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in r.hgetall(keys.batch(batch_id)).items()}


def counts(meta: dict[str, str]) -> dict[str, int]:
    return {k: int(meta.get(k, 0) or 0) for k in ("total", "completed", "failed")}


def record_line(
    r: redis.Redis,
    batch_id: str,
    index: int,
    line: str,
    ok: bool,
    usage: tuple[int, int],
    ttl_s: int,
) -> bool:
    """Store line `index`'s one result (the lines and the record then expire in `ttl_s`);
    False if it already had one."""
    return bool(
        r.eval(
            _RECORD,
            2,
            keys.batch_lines(batch_id),
            keys.batch(batch_id),
            index,
            line,
            int(ok),
            usage[0],
            usage[1],
            now_ms(),
            ttl_s,
        )
    )


def bump_gen(r: redis.Redis, batch_id: str) -> int | None:
    """The batch's next generation (tasks.kick); None if the batch has no record."""
    out = r.eval(_BUMP_GEN, 1, keys.batch(batch_id))
    return None if out is None else int(out)


def move(r: redis.Redis, batch_id: str, status: str, *allowed: str) -> str | None:
    """Set `status` if the current one is in `allowed`; returns the status now (None: no
    such batch)."""
    out = r.eval(_MOVE, 1, keys.batch(batch_id), status, *allowed)
    return _s(out) if out is not None else None


def expire(r: redis.Redis, batch_id: str, ttl_s: int) -> None:
    """Set every key of the batch to expire in `ttl_s` (the ones that exist)."""
    pipe = r.pipeline(transaction=False)
    expire_pipe(pipe, batch_id, ttl_s)
    pipe.execute()


def expire_pipe(pipe: Any, batch_id: str, ttl_s: int) -> None:
    """Queue `expire` on a pipeline, after the writes queued on it."""
    for key in keys.batch_all(batch_id):
        pipe.expire(key, ttl_s)


def unfinished(r: redis.Redis) -> list[str]:
    """Ids of known batches not in a terminal status."""
    ids = [_s(b) for b in r.zrange(keys.BATCHES, 0, -1)]
    bad = [b for b in ids if not BATCH_ID.fullmatch(b)]
    if bad:
        r.zrem(keys.BATCHES, *bad)  # not written by manage.create: never driven
        ids = [b for b in ids if BATCH_ID.fullmatch(b)]
    pipe = r.pipeline(transaction=False)
    for b in ids:
        pipe.hget(keys.batch(b), "status")
    out = []
    for b, st in zip(ids, pipe.execute(), strict=True):
        if st is None:
            r.zrem(keys.BATCHES, b)  # its keys expired
        elif _s(st) not in TERMINAL:
            out.append(b)
    return out


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
