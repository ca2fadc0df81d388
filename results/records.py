"""The job record: one hash per job, `plurai:job:<id>`, with a TTL.

States: queued → running → completed | failed | cancelled. A record with the field
`final` holds the job's one final result; nothing overwrites it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio

from broker_config import keys
from broker_config.text import text

QUEUED = "queued"
RUNNING = "running"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})
# No record: never submitted to this Redis, expired (result_ttl_s after the job ended), or
# queued by a client that writes none (the raw protocol: the worker writes it on start).
UNKNOWN = "unknown"


class BadRecord(ValueError):
    """A job record holding what no worker writes (a field that does not parse, or a key
    of another type); its `code` is the protocol's `bad_record`."""

    code = "bad_record"


def damaged(e: Exception, job_id: str, what: str) -> Exception:
    """What to raise for an error met reading one of the job's keys: a BadRecord where the
    key holds another type (WRONGTYPE) or bytes that are not UTF-8, `e` itself otherwise."""
    if isinstance(e, UnicodeDecodeError):
        return BadRecord(f"job {job_id}: its {what} holds bytes that are not UTF-8")
    if isinstance(e, redis.ResponseError) and str(e).startswith("WRONGTYPE"):
        return BadRecord(f"job {job_id}: its {what} key holds another type, not Plurai's")
    return e


def _int(h: dict[str, str], name: str) -> int | None:
    v = h.get(name)
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError:
        raise BadRecord(f"record field {name!r} is not an integer: {v[:40]!r}") from None


def _json(h: dict[str, str], name: str) -> Any:
    v = h.get(name)
    if not v:
        return None
    try:
        return json.loads(v)
    except (ValueError, RecursionError):
        raise BadRecord(f"record field {name!r} is not JSON: {v[:40]!r}") from None


@dataclass
class JobRecord:
    id: str
    state: str  # one of the states above, or UNKNOWN when no record exists
    final: bool = False
    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    spec_proposed: int | None = None  # speculative decoding's tokens proposed and accepted
    spec_accepted: int | None = None
    lane: str | None = None
    priority: int | None = None
    worker: str | None = None
    created_ms: int | None = None
    started_ms: int | None = None
    first_token_ms: int | None = None  # when the worker had the run's first token
    finished_ms: int | None = None
    metadata: dict[str, Any] | None = None
    logprobs: list[dict[str, Any]] | None = None
    raw: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def done(self) -> bool:
        return self.final

    @classmethod
    def from_hash(cls, job_id: str, raw: dict[Any, Any]) -> JobRecord:
        h = {text(k): text(v) for k, v in raw.items()}
        if not h:
            return cls(id=job_id, state=UNKNOWN)
        try:
            return cls._parse(job_id, h)
        except BadRecord as e:
            raise BadRecord(f"job {job_id}: {e}") from None

    @classmethod
    def _parse(cls, job_id: str, h: dict[str, str]) -> JobRecord:
        return cls(
            id=job_id,
            state=h.get("state", QUEUED),
            final="final" in h,
            text=h.get("text"),
            token_ids=_json(h, "token_ids"),
            finish_reason=h.get("finish_reason") or None,
            error_code=h.get("error_code") or None,
            error_message=h.get("error_message") or None,
            prompt_tokens=_int(h, "prompt_tokens"),
            output_tokens=_int(h, "output_tokens"),
            cached_tokens=_int(h, "cached_tokens"),
            spec_proposed=_int(h, "spec_proposed"),
            spec_accepted=_int(h, "spec_accepted"),
            lane=h.get("lane"),
            priority=_int(h, "priority"),
            worker=h.get("worker"),
            created_ms=_int(h, "created_ms"),
            started_ms=_int(h, "started_ms"),
            first_token_ms=_int(h, "first_token_ms"),
            finished_ms=_int(h, "finished_ms"),
            metadata=_json(h, "metadata"),
            logprobs=_json(h, "logprobs"),
            raw=h,
        )

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "raw" and v is not None}
        return d


def get(r: redis.Redis, job_id: str) -> JobRecord:
    """The job's record; raises BadRecord where its key holds something no worker wrote."""
    return get_many(r, [job_id])[0]


def get_many(r: redis.Redis, job_ids: list[str]) -> list[JobRecord]:
    """Many records in one round trip (a pipeline of HGETALL)."""
    try:
        replies = _reads(r.pipeline(transaction=False), job_ids).execute(False)
    except UnicodeDecodeError as e:  # a client that decodes replies
        raise damaged(e, _which(job_ids), "record") from None
    return _parse(job_ids, replies)


async def get_async(r: redis.asyncio.Redis, job_id: str) -> JobRecord:
    return (await get_many_async(r, [job_id]))[0]


async def get_many_async(r: redis.asyncio.Redis, job_ids: list[str]) -> list[JobRecord]:
    try:
        replies = await _reads(r.pipeline(transaction=False), job_ids).execute(False)
    except UnicodeDecodeError as e:
        raise damaged(e, _which(job_ids), "record") from None
    return _parse(job_ids, replies)


def _which(job_ids: list[str]) -> str:
    return job_ids[0] if len(job_ids) == 1 else f"{job_ids[0]} or another of {len(job_ids)}"


def _reads(pipe: Any, job_ids: list[str]) -> Any:
    for job_id in job_ids:
        pipe.hgetall(keys.job(job_id))
    return pipe


def _parse(job_ids: list[str], replies: list[Any]) -> list[JobRecord]:
    """The records of a pipeline run with raise_on_error off: a WRONGTYPE reply is a
    BadRecord, any other error is raised as it came."""
    for j, h in zip(job_ids, replies, strict=True):
        if isinstance(h, redis.ResponseError):
            raise damaged(h, j, "record")
    return [JobRecord.from_hash(j, h) for j, h in zip(job_ids, replies, strict=True)]


def now_ms() -> int:
    return int(time.time() * 1000)


def json_ids(ids: list[int]) -> str:
    """Token ids as compact JSON, as records and token streams hold them (per step: the
    plain join is several times cheaper than json.dumps)."""
    return "[" + ",".join(map(str, ids)) + "]"


def final_fields(
    *,
    text: str = "",
    token_ids: list[int] | None = None,
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    spec_proposed: int = 0,
    spec_accepted: int = 0,
    worker: str = "",
    finished_ms: int,
    first_token_ms: int = 0,
    error_code: str = "",
    error_message: str = "",
    logprobs: list[dict[str, Any]] | None = None,
) -> list[str | int]:
    """Field/value pairs of a final result, flat, for the FINALIZE script."""
    ids = token_ids or []
    out: list[str | int] = [
        "text",
        text,
        "token_ids",
        json_ids(ids),
        "prompt_tokens",
        prompt_tokens,
        "output_tokens",
        len(ids),
        "cached_tokens",
        cached_tokens,
        "worker",
        worker,
        "finished_ms",
        finished_ms,
    ]
    if first_token_ms:  # only where the run made a token
        out += ["first_token_ms", first_token_ms]
    if spec_proposed:  # only where the run speculated
        out += ["spec_proposed", spec_proposed, "spec_accepted", spec_accepted]
    if error_code:
        out += ["error_code", error_code, "error_message", error_message]
    if logprobs is not None:
        out += ["logprobs", json.dumps(logprobs, separators=(",", ":"))]
    return out
