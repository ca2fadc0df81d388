"""The dead letters (plurai:dead): entries no worker could finish, read, queued again or
dropped (`plurai dead-letters list|requeue|drop`).

A worker dead-letters an entry with no usable job id, and a job that failed
PLURAI_MAX_DELIVERIES times (its result says `too_many_deliveries`). Each dead letter keeps
the entry as it was (`entry`, msgpack), so that once the cause is mended (a worker's bug, a
model that crashed on it) the job can run again under its own id: `requeue` checks the
entry as a worker would, then queues it at the tail of its lane with its record, token
stream and progress started over and its failures forgotten, in one step (script REVIVE).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgpack
import redis
from redis.client import NEVER_DECODE

from plurai.broker_config import keys, protocol
from plurai.broker_config.connection import is_cluster
from plurai.broker_config.errors import CodedError
from plurai.broker_config.routes import Routes
from plurai.broker_config.settings import Settings
from plurai.broker_config.text import text
from plurai.results import jobs

MAX_LIST = 10_000  # dead letters one call lists at most (the stream is capped near that)
# bytes replies whatever the connection decodes: an entry's body may not be UTF-8
_RAW: dict[str, Any] = {NEVER_DECODE: []}


class DeadCode:
    """Why a dead letter was not requeued or dropped (DeadLetterError.code)."""

    UNKNOWN = "unknown_dead_letter"  # no dead letter has that id (requeued or dropped already)
    NOT_REQUEUEABLE = "not_requeueable"  # it holds no entry to queue, or one that fails again
    JOB_ACTIVE = "job_active"  # the job is queued or runs already
    CLUSTER = "cluster_unsupported"  # requeue runs on one Redis (or Sentinel), not a Cluster


class DeadLetterError(CodedError):
    """A dead letter refused: `code` (DeadCode, or the wire's `queue_full`) and a message
    that says what to do."""


@dataclass
class DeadLetter:
    id: str  # the dead letter's own stream id (what requeue and drop take)
    lane: str
    job_id: str | None  # None: the entry carried no usable job id
    error: str
    worker: str
    requeueable: bool  # it holds the entry as it was
    fields: str  # the entry's fields as JSON, for a reader (cut at 64 KiB)

    @property
    def at_ms(self) -> int:
        """When it was dead-lettered (unix ms, from its id)."""
        return int(self.id.split("-", 1)[0])


_ID_FIELD = re.compile(rb'"id": "([A-Za-z0-9_-]{8,128})"')


def job_id_of(f: dict[bytes, bytes]) -> str | None:
    """A dead letter's job id: its own field (a result that could not be stored), else the
    one its entry's fields carried (shown as JSON, cut at 64 KiB: read by pattern); None
    when there is no valid one."""
    found = f.get(b"job_id")
    if found is None:
        m = _ID_FIELD.search(f.get(b"fields", b"")[:4096])
        found = m[1] if m else None
    job_id = text(found) if found is not None and len(found) <= 128 else None
    return job_id if job_id is not None and protocol.valid_job_id(job_id) else None


def _dead_letter(entry_id: bytes | str, f: dict[bytes, bytes]) -> DeadLetter:
    return DeadLetter(
        id=text(entry_id),
        lane=text(f.get(b"lane", b""))[:64],
        job_id=job_id_of(f),
        error=text(f.get(b"error", b"")),
        worker=text(f.get(b"worker", b""))[:256],
        requeueable=b"entry" in f,
        fields=text(f.get(b"fields", b"")),
    )


def _entry(f: dict[bytes, bytes]) -> dict[bytes, bytes] | None:
    """The entry a dead letter kept, checked to be a map of bytes to bytes; None if none."""
    packed = f.get(b"entry")
    if packed is None:
        return None
    try:
        entry = msgpack.unpackb(packed, raw=True, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise DeadLetterError(DeadCode.NOT_REQUEUEABLE, f"its entry does not decode: {e}") from e
    if not isinstance(entry, dict) or not all(
        isinstance(k, bytes) and isinstance(v, bytes) for k, v in entry.items()
    ):
        raise DeadLetterError(DeadCode.NOT_REQUEUEABLE, "its entry is not a map of fields")
    return entry


def list_dead(r: redis.Redis, count: int = 100) -> list[DeadLetter]:
    """The newest `count` dead letters, newest first."""
    if not 1 <= count <= MAX_LIST:
        raise ValueError(f"count must be 1..{MAX_LIST}, got {count}")
    rows = r.execute_command("XREVRANGE", keys.DEAD_LETTER, "+", "-", "COUNT", count, **_RAW)
    return [_dead_letter(i, f) for i, f in _pairs(rows)]


def _pairs(rows: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    out = []
    for entry_id, flat in rows or []:
        fields = flat if isinstance(flat, dict) else dict(zip(flat[::2], flat[1::2], strict=True))
        out.append((entry_id, fields))
    return out


def _one(r: redis.Redis, dead_id: str) -> dict[bytes, bytes]:
    if not isinstance(dead_id, str) or not _is_stream_id(dead_id):
        raise DeadLetterError(DeadCode.UNKNOWN, f"{dead_id!r} is not a dead letter's id (<ms>-<n>)")
    rows = _pairs(r.execute_command("XRANGE", keys.DEAD_LETTER, dead_id, dead_id, **_RAW))
    if not rows:
        raise DeadLetterError(
            DeadCode.UNKNOWN, f"no dead letter {dead_id} (requeued or dropped already?)"
        )
    return rows[0][1]


def _is_stream_id(s: str) -> bool:
    ms, _, seq = s.partition("-")
    return ms.isascii() and ms.isdigit() and seq.isascii() and seq.isdigit() and len(s) <= 41


def drop(r: redis.Redis, dead_ids: list[str]) -> int:
    """Delete these dead letters; how many there were. An id that is not a stream id is
    refused (UNKNOWN) before any is deleted."""
    for dead_id in dead_ids:
        if not _is_stream_id(dead_id):
            raise DeadLetterError(DeadCode.UNKNOWN, f"{dead_id!r} is not a dead letter's id")
    return int(r.xdel(keys.DEAD_LETTER, *dead_ids)) if dead_ids else 0


def read_routes(r: redis.Redis, settings: Settings) -> Routes:
    """The models' routes and shard counts, as workers last wrote them."""
    routes = Routes(settings)
    routes.load(routes.read(r))
    return routes


def requeue(
    r: redis.Redis, dead_id: str, settings: Settings | None = None, routes: Routes | None = None
) -> str:
    """Queue the job of dead letter `dead_id` again, as a worker would take it (the entry
    checked first: one that would fail again is refused), its failures forgotten; the dead
    letter is deleted. Returns the job id. Raises DeadLetterError. `routes`: the models'
    shards as read from Redis (`read_routes`), once for many requeues; else read here."""
    settings = settings or Settings()
    if is_cluster(r):
        raise DeadLetterError(
            DeadCode.CLUSTER,
            "requeue needs the dead letter, the job's keys and its lane in one step, which a "
            "Redis Cluster cannot run: submit the job again from its fields (`list`) instead",
        )
    f = _one(r, dead_id)
    entry = _entry(f)
    if entry is None:
        raise DeadLetterError(
            DeadCode.NOT_REQUEUEABLE,
            "it holds no entry (dead-lettered before entries were kept, or larger than "
            "PLURAI_MAX_BODY_BYTES): submit the job again from its fields (`list`)",
        )
    lane = text(f.get(b"lane", b""))
    if lane not in settings.lanes:
        raise DeadLetterError(
            DeadCode.NOT_REQUEUEABLE, f"its lane {lane!r} is not one of {list(settings.lanes)}"
        )
    try:  # as a worker reads it: an entry that would fail again is not queued again
        request = protocol.parse_request(entry, settings.limits())
    except protocol.NoJobId as e:
        raise DeadLetterError(DeadCode.NOT_REQUEUEABLE, f"it has no usable job id: {e}") from e
    except CodedError as e:
        raise DeadLetterError(
            DeadCode.NOT_REQUEUEABLE, f"its entry is refused ({e.code}): {e.message}"
        ) from e
    env = request.envelope
    routes = routes or read_routes(r, settings)
    name = request.model or settings.default_model
    model = routes.route(name) or name
    fields = {k: v for k, v in entry.items() if k != b"attempts"}  # its failures forgotten
    call = jobs.revive(
        dead_id=dead_id,
        job_id=env.job_id,
        lane=lane,
        model=model,
        shard=keys.shard_of(env.idem or env.job_id, routes.shards(model)),
        fields=fields,
        priority=env.priority,
        metadata_json=json.dumps(request.metadata, separators=(",", ":"))
        if request.metadata is not None
        else None,
        stream_maxlen=settings.stream_maxlen,
        queued_ttl_s=settings.queued_ttl_s,
        max_queued=settings.max_queued_per_lane,
    )
    try:
        answer = text(jobs.run(r, call))
    except redis.ResponseError as e:
        if str(e).startswith("QUEUEFULL"):
            raise DeadLetterError(
                protocol.Code.QUEUE_FULL,
                f"lane {lane!r} holds {str(e).split()[-1]} waiting jobs "
                "(PLURAI_MAX_QUEUED_PER_LANE): requeue it once the lane drains",
            ) from e
        raise
    if answer == "GONE":
        raise DeadLetterError(DeadCode.UNKNOWN, f"no dead letter {dead_id} (requeued already?)")
    if answer == "ACTIVE":
        raise DeadLetterError(
            DeadCode.JOB_ACTIVE,
            f"job {env.job_id} is queued or running already; drop the dead letter instead",
        )
    return env.job_id
