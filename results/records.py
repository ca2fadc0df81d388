"""The job record: one hash per job, `plurai:job:<id>`, with a TTL.

States: queued → running → completed | failed | cancelled. A record with the field
`final` holds the job's one final result; nothing overwrites it.

A job that asked for n > 1 choices (its `n`) has them all in its `choices` field (JSON);
`text`, `token_ids`, `finish_reason` and `logprobs` are its first choice's, and
`output_tokens` counts the tokens of all. `JobRecord.choices` lists the choices of any
final record, one for a job of n 1.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
import redis.asyncio

from plurai.broker_config import keys
from plurai.broker_config.text import text

QUEUED = "queued"
RUNNING = "running"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})
# No record: never submitted to this Redis, expired (result_ttl_s after the job ended), or
# queued by a client that writes none (the raw protocol: the worker writes it on start).
UNKNOWN = "unknown"
# the queue hop's record fields, in order (unix µs): a front's receipt (the gateway's),
# the submit, the worker's take, the engine's add, the first token
HOPS = ("received_us", "queued_us", "taken_us", "added_us", "first_token_us")


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
class Choice:
    """One choice of a job's result."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[str, Any]] | None = None


def _choices(h: dict[str, str]) -> list[Choice]:
    """The choices of a record: its `choices` field, else (a job of n 1) the one its text
    fields hold once it is final."""
    listed = _json(h, "choices")
    if listed is None:
        if "final" not in h:
            return []
        ids, reason = _json(h, "token_ids") or [], h.get("finish_reason") or None
        return [Choice(0, h.get("text") or "", ids, reason, _json(h, "logprobs"))]
    try:
        out = [Choice(**c) for c in listed]
    except TypeError:
        out = []
    if not out or any(
        c.index != i
        or not isinstance(c.text, str)
        or not isinstance(c.token_ids, list)
        or not isinstance(c.finish_reason, (str, type(None)))
        for i, c in enumerate(out)
    ):
        raise BadRecord(f"record field 'choices' is not a list of choices: {h['choices'][:40]!r}")
    for c in out:
        c.finish_reason = c.finish_reason or None
    return out


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
    tenant: str | None = None  # written when a worker starts the job
    worker: str | None = None
    created_ms: int | None = None
    started_ms: int | None = None
    first_token_ms: int | None = None  # when the worker had the run's first token
    finished_ms: int | None = None
    # unix µs, each on its writer's clock: the queue hop of the run that ended the job
    # (HOPS: received by a front, submitted, taken, added to the engine, first token)
    hops_us: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] | None = None
    logprobs: list[dict[str, Any]] | None = None
    # every choice, in index order (the first is text, token_ids, ...); none before final
    choices: list[Choice] = field(default_factory=list)
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
            tenant=h.get("tenant") or None,
            worker=h.get("worker"),
            created_ms=_int(h, "created_ms"),
            started_ms=_int(h, "started_ms"),
            first_token_ms=_int(h, "first_token_ms"),
            finished_ms=_int(h, "finished_ms"),
            hops_us={k: v for k in HOPS if (v := _int(h, k))},
            metadata=_json(h, "metadata"),
            logprobs=_json(h, "logprobs"),
            choices=_choices(h),
            raw=h,
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set; `choices` only for a job of n > 1 (the others' one
        choice is text, token_ids, ...)."""
        d = {
            k: v for k, v in self.__dict__.items() if k not in ("raw", "choices") and v is not None
        }
        if "choices" in self.raw:
            d["choices"] = [asdict(c) for c in self.choices]
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
    hops_us: list[int] | None = None,
    error_code: str = "",
    error_message: str = "",
    logprobs: list[dict[str, Any]] | None = None,
    choices: list[Choice] | None = None,
) -> list[str | int]:
    """Field/value pairs of a final result, flat, for the FINALIZE script. `text`,
    `token_ids` and `logprobs` are the first choice's; `choices`: every choice of a job of
    n > 1 (their tokens are its output_tokens); `hops_us`: when the run's worker took the
    entry, added its job to the engine and had its first token (unix µs, 0: not)."""
    ids = token_ids or []
    made = sum(len(c.token_ids) for c in choices) if choices else len(ids)
    out: list[str | int] = [
        "text",
        text,
        "token_ids",
        json_ids(ids),
        "prompt_tokens",
        prompt_tokens,
        "output_tokens",
        made,
        "cached_tokens",
        cached_tokens,
        "worker",
        worker,
        "finished_ms",
        finished_ms,
    ]
    if first_token_ms:  # only where the run made a token
        out += ["first_token_ms", first_token_ms]
    for name, us in zip(HOPS[2:], hops_us or [], strict=False):
        if us:
            out += [name, us]
    if spec_proposed:  # only where the run speculated
        out += ["spec_proposed", spec_proposed, "spec_accepted", spec_accepted]
    if error_code:
        out += ["error_code", error_code, "error_message", error_message]
    if logprobs is not None:
        out += ["logprobs", json.dumps(logprobs, separators=(",", ":"))]
    if choices:
        listed = [asdict(c) for c in choices]
        out += ["choices", json.dumps(listed, separators=(",", ":"), ensure_ascii=False)]
    return out
