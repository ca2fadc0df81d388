"""The batch record `plurai:batch:<id>` and its per-line results.

Statuses follow OpenAI's Batch API: validating → in_progress → finalizing → completed,
or failed (no valid line), cancelling → cancelled, expired. Counts: total, completed,
failed. Each input line gets exactly one result line (HSETNX), and the counts move in the
same script, so a retried step can neither duplicate a line nor count it twice.

Every key of a batch (keys.batch_all) expires: BulkSettings.running_ttl_s
(broker_config/settings.py) after it was last written or renewed while the batch runs (each
write that creates a key sets it, each pass renews it), BulkSettings.ttl_s after the batch
ends. A batch id names keys and files, so only ids of letters, digits, `_` and `-` are
accepted (check_id). The scripts are results/scripts.py's BATCH_*, called through
results/jobs.py.
"""

from __future__ import annotations

import re
from typing import Any

import redis

from broker_config import keys
from broker_config.text import text
from results import jobs
from results.records import now_ms

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


class InvalidBatchId(ValueError):
    """Not a batch id: it could name other keys, or a path outside a folder."""


def check_id(batch_id: str) -> str:
    """`batch_id` if it is a well-formed batch id, else InvalidBatchId."""
    if not isinstance(batch_id, str) or not BATCH_ID.fullmatch(batch_id):
        raise InvalidBatchId(
            f"invalid batch id {batch_id!r}: use 1 to 64 letters, digits, '_' or '-'"
        )
    return batch_id


def get(r: redis.Redis, batch_id: str) -> dict[str, str]:
    return {text(k): text(v) for k, v in r.hgetall(keys.batch(batch_id)).items()}


def counts(meta: dict[str, str]) -> dict[str, int]:
    """The request counts of a batch record; a damaged one reads as 0 (status still works)."""
    return {k: count(meta, k) for k in ("total", "completed", "failed")}


def count(meta: dict[str, str], name: str, default: int = 0) -> int:
    """An integer field of a batch record (a count, a unix ms); `default` when it is
    missing or damaged."""
    v = meta.get(name, "")
    return int(v) if v.isascii() and v.isdigit() else default


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
    call = jobs.batch_line(
        batch_id=batch_id,
        index=index,
        line=line,
        ok=ok,
        prompt_tokens=usage[0],
        output_tokens=usage[1],
        now_ms=now_ms(),
        ttl_s=ttl_s,
    )
    return bool(jobs.run(r, call))


def bump_gen(r: redis.Redis, batch_id: str) -> int | None:
    """The batch's next generation (tasks.kick); None if the batch has no record."""
    out = jobs.run(r, jobs.batch_gen(batch_id=batch_id))
    return None if out is None else int(out)


def move(r: redis.Redis, batch_id: str, status: str, *allowed: str) -> str | None:
    """Set `status` if the current one is in `allowed`; returns the status now (None: no
    such batch)."""
    out = jobs.run(r, jobs.batch_move(batch_id=batch_id, status=status, allowed=allowed))
    return text(out) if out is not None else None


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
    ids = [text(b) for b in r.zrange(keys.BATCHES, 0, -1)]
    bad = [b for b in ids if not BATCH_ID.fullmatch(b)]
    if bad:
        r.zrem(keys.BATCHES, *bad)  # not written by manage.create: never driven
        ids = [b for b in ids if BATCH_ID.fullmatch(b)]
    pipe = r.pipeline(transaction=False)
    for b in ids:
        pipe.hget(keys.batch(b), "status")
    out = []
    for b, st in zip(ids, pipe.execute(raise_on_error=False), strict=True):
        if st is None or isinstance(st, redis.ResponseError):
            r.zrem(keys.BATCHES, b)  # its keys expired (or its record is not a hash)
        elif text(st) not in TERMINAL:
            out.append(b)
    return out
