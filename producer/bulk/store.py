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

The record is read as a BatchRecord and each in-flight line's progress as a LineProgress:
what Redis holds is checked where it is parsed, and a field no Plurai process writes is a
BadRecord naming it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

import redis

from plurai.broker_config import keys
from plurai.broker_config.text import text
from plurai.results import jobs
from plurai.results.records import BadRecord, now_ms

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


_COUNT = re.compile(r"[0-9]{1,18}")


@dataclass
class BatchRecord:
    """The hash `plurai:batch:<id>`. Counts are written at creation; a field that is None
    has not been written (`valid`: the lines that parsed, once validation is done;
    `cancelling_ms` is set once, by HSETNX). `task` and `metadata` are JSON as the client
    gave them: their readers judge them (a task no longer valid fails the batch)."""

    id: str
    status: str
    total: int = 0
    completed: int = 0
    failed: int = 0
    gen: int = 0
    created_ms: int | None = None
    expires_ms: int | None = None
    started_ms: int | None = None
    beat_ms: int | None = None
    cancelling_ms: int | None = None
    finished_ms: int | None = None
    valid: int | None = None
    next: int | None = None  # the first line no pass has looked at yet
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    max_model_len: int | None = None
    end_status: str | None = None  # the status finalizing ends in
    stop_reason: str | None = None  # "expired": maintenance stopped it past its window
    error_code: str | None = None  # why the whole batch failed
    error: str | None = None
    task: str | None = None  # plan.Task.to_dict as JSON: a batch of documents
    model_dir: str | None = None  # the model the client meant (never read as a path)
    metadata: str | None = None
    input: str | None = None  # the input file (a path, or the gateway's file id)
    tenant: str | None = None  # the API key's tenant of a batch made through the gateway
    input_file_id: str | None = None
    endpoint: str | None = None
    completion_window: str | None = None

    @classmethod
    def from_hash(cls, batch_id: str, raw: dict[Any, Any]) -> BatchRecord:
        """The record of an HGETALL reply (bytes or str); BadRecord when a field holds what
        no Plurai process writes (a count that is not one, no status)."""
        h = {text(k): text(v) for k, v in raw.items()}
        if "status" not in h:
            raise BadRecord(f"batch {batch_id}: its record has no status")
        out: dict[str, Any] = {}
        for name in _OTHERS:
            v = h.get(name)
            if v is None:
                continue
            if name in _COUNTS and not _COUNT.fullmatch(v):
                raise BadRecord(f"batch {batch_id}: field {name!r} is not a count: {v[:40]!r}")
            out[name] = int(v) if name in _COUNTS else v
        return cls(id=batch_id, status=h["status"], **out)

    def to_hash(self) -> dict[str, str | int]:
        """The fields to write (HSET mapping): every field but the id and those not set."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if k != "id" and v is not None}

    @property
    def counts(self) -> dict[str, int]:
        """The request counts, as OpenAI names them."""
        return {"total": self.total, "completed": self.completed, "failed": self.failed}


_OTHERS = [f.name for f in dataclasses.fields(BatchRecord) if f.name not in ("id", "status")]
_COUNTS = frozenset(  # the integer fields (annotations are strings here)
    f.name for f in dataclasses.fields(BatchRecord) if f.type in ("int", "int | None")
)


@dataclass
class LineProgress:
    """A line in flight (keys.batch_state, one JSON value per line): its level (0: the
    request or a document's chunks; 1..: reduce levels), the jobs of that level, and the
    tokens of the levels before it. Stored as {"level", "jobs", "p", "o"}."""

    level: int
    jobs: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0

    @classmethod
    def from_json(cls, saved: str | bytes) -> LineProgress:
        """A line's saved progress; BadRecord when it is not one."""
        try:
            st = json.loads(saved)
        except (ValueError, RecursionError):
            raise BadRecord("a line's progress is not JSON") from None
        ok = (
            isinstance(st, dict)
            and all(_integer(st.get(k)) for k in ("level", "p", "o"))
            and isinstance(st.get("jobs"), list)
            and all(isinstance(j, str) for j in st["jobs"])
        )
        if not ok:
            raise BadRecord(f"a line's progress is not one: {text(saved)[:60]!r}")
        return cls(st["level"], st["jobs"], st["p"], st["o"])

    def to_json(self) -> str:
        return json.dumps(
            {
                "level": self.level,
                "jobs": self.jobs,
                "p": self.prompt_tokens,
                "o": self.output_tokens,
            }
        )

    @property
    def usage(self) -> tuple[int, int]:
        return self.prompt_tokens, self.output_tokens


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def get(r: redis.Redis, batch_id: str) -> BatchRecord | None:
    """The batch's record; None if it has none (never created, or expired). BadRecord
    when it is damaged, or its key holds another type."""
    try:
        raw = r.hgetall(keys.batch(batch_id))
    except UnicodeDecodeError:  # a connection that decodes replies
        raise BadRecord(f"batch {batch_id}: its record holds bytes that are not UTF-8") from None
    except redis.ResponseError as e:
        if not str(e).startswith("WRONGTYPE"):
            raise
        raise BadRecord(f"batch {batch_id}: its record key holds another type") from None
    return BatchRecord.from_hash(batch_id, raw) if raw else None


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


def fail_reason(r: redis.Redis, batch_id: str, problem: tuple[str, str]) -> None:
    """Record why the whole batch failed (manage.info shows it as `errors`)."""
    r.hset(keys.batch(batch_id), mapping={"error_code": problem[0], "error": problem[1]})
