"""Exceptions a client sees when a job did not complete, and the checks (shared by the sync
and async clients) that raise them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from plurai.broker_config.memory import is_oom
from plurai.broker_config.protocol import Code, valid_job_id
from plurai.broker_config.text import text
from plurai.results import records
from plurai.results.records import JobRecord
from plurai.results.tokens import JobRestarted

if TYPE_CHECKING:
    from plurai.results.jobs import Submission

J = TypeVar("J")


class JobFailed(RuntimeError):
    def __init__(self, record: JobRecord) -> None:
        super().__init__(f"job {record.id} failed: {record.error_code}: {record.error_message}")
        self.record = record
        self.code = record.error_code
        self.message = record.error_message


class JobCancelled(RuntimeError):
    def __init__(self, record: JobRecord) -> None:
        super().__init__(f"job {record.id} was cancelled")
        self.record = record


class QueueFull(RuntimeError):
    """The lane holds its maximum of waiting jobs (PLURAI_MAX_QUEUED_PER_LANE); nothing was
    queued for this call. Try again after `retry_after` seconds. From submit_many,
    `accepted` lists the jobs of the call that were queued all the same."""

    code = Code.QUEUE_FULL

    def __init__(self, lane: str, queued: int, retry_after: float, accepted: list | None = None):
        super().__init__(
            f"lane {lane!r} is full ({queued} jobs waiting); retry after {retry_after:g}s"
        )
        self.lane = lane
        self.queued = queued
        self.retry_after = retry_after
        self.accepted = accepted or []


class RedisFull(QueueFull):
    """Redis is at its `maxmemory` and refuses new writes (policy noeviction); nothing was
    queued for this call, and every job already queued is kept. A QueueFull, so what waits
    for room in a lane (`queue_timeout`, the bulk driver) waits for memory too; `queued`
    is 0. Try again after `retry_after` seconds, once results expire or are read and
    memory frees, or raise `maxmemory`."""

    code = Code.REDIS_OOM

    def __init__(self, lane: str, retry_after: float, accepted: list | None = None) -> None:
        super().__init__(lane, 0, retry_after, accepted)
        RuntimeError.__init__(
            self,
            "Redis is out of memory (at its maxmemory, policy noeviction) and refuses new "
            f"jobs; nothing was queued. Retry after {retry_after:g}s, or free memory or "
            'raise maxmemory (docs/operations.md, "Memory")',
        )


class NotReplicated(RuntimeError):
    """The primary queued these jobs, but fewer replicas than PLURAI_SUBMIT_REPLICAS
    acknowledged them in time: a failover now would lose them. Submitting them again with
    the same idempotency keys is safe (a repeat queues nothing twice)."""

    def __init__(self, job_ids: list[str], acked: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(
            f"{len(job_ids)} job(s) queued on the primary, but {acked} of {wanted} replicas "
            f"acknowledged them within {timeout_ms} ms (PLURAI_SUBMIT_REPLICAS): they are "
            "lost if the primary fails before they reach a replica"
        )
        self.job_ids = job_ids
        self.acked = acked
        self.wanted = wanted


class UnknownModel(LookupError):
    """No live worker serves the model and the deployment refuses such requests
    (PLURAI_UNSERVED=refuse); nothing was queued."""

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(
            f"no live worker serves the model {model!r}; served now: {served or 'none'} "
            "(PLURAI_UNSERVED=refuse)"
        )
        self.model = model
        self.served = served


class BadIdempotencyKey(ValueError):
    """The idempotency key's Redis key holds something other than a job id (written by
    something else); nothing was queued. Delete that key, or submit with another."""

    def __init__(self, key: str, owner: str) -> None:
        super().__init__(
            f"{key} holds {owner[:60]!r}, not the id of the job that owns the idempotency "
            "key; nothing was queued"
        )
        self.key = key
        self.owner = owner
        self.accepted: list = []  # from submit_many: the jobs of the call that were queued


@contextmanager
def accepting(before: list[Any]) -> Iterator[None]:
    """For submit_many: an exception that leaves without `accepted` (Redis failed) gets
    the jobs queued before it, so that the caller knows them."""
    try:
        yield
    except Exception as e:
        if not isinstance(getattr(e, "accepted", None), list):
            e.accepted = list(before)  # type: ignore[attr-defined]
        raise


def check_replicas(job_ids: list[str], acked: Any, wanted: int, timeout_ms: int) -> None:
    """Raises NotReplicated unless `wanted` replicas acknowledged the submit (`acked`:
    WAIT's reply; an error reply, e.g. WAIT refused by an ACL, counts as none)."""
    if not wanted:
        return
    got = acked if isinstance(acked, int) else 0
    if got < wanted:
        cause = acked if isinstance(acked, Exception) else None
        raise NotReplicated(job_ids, got, wanted, timeout_ms) from cause


def queue_full(error: Exception, lane: str, retry_after: float) -> QueueFull | None:
    """The QueueFull that a submit script's error reply stands for (RedisFull when Redis
    is out of memory), or None for any other error."""
    if is_oom(error):
        return RedisFull(lane, retry_after)
    text = str(error)
    if not text.startswith("QUEUEFULL"):
        return None
    return QueueFull(lane, int(text.split()[1]), retry_after)


def submitted(
    subs: list[Submission],
    replies: list[Any],
    retry_after: float,
    before: list[J],
    job: Callable[[str], J],
    split: bool = False,
) -> tuple[list[J], list[list[Any]], Exception | None]:
    """The jobs of a chunk of submissions, from their replies (ENQUEUE's for each, or with
    `split` QUEUED's then SUBMIT's; an error reply as its exception), the commands that
    delete the records written for nothing, and the error to raise once those are sent:
    any error reply but QUEUEFULL as it is, else QueueFull if a lane was full; its
    `accepted` holds `before` and the jobs queued."""
    out: list[J] = []
    cleanup: list[list[Any]] = []
    full: QueueFull | None = None
    error: Exception | None = None
    per = 2 if split else 1
    for i, sub in enumerate(subs):
        reply = replies[per * i + per - 1]
        if split:
            drop = sub.cleanup(replies[per * i], reply)
            if drop is not None:
                cleanup.append(drop)
        # The queue's reply decides: a job queued without its record (QUEUED refused) runs
        # all the same, and its worker's BEGIN writes the record.
        if not isinstance(reply, Exception):
            owner = text(reply)
            if owner == sub.job_id or valid_job_id(owner):
                out.append(job(owner))
                continue
            reply = BadIdempotencyKey(sub.keys[-1], owner)
        lane_full = queue_full(reply, sub.lane, retry_after)
        if lane_full is None:
            error = error or reply
        full = full or lane_full
    error = error or full
    if error is not None:  # the jobs of the call queued all the same
        error.accepted = before + out  # type: ignore[attr-defined]
    return out, cleanup, error


def final(rec: JobRecord, timeout: float | None) -> JobRecord:
    """`rec` if the job completed; else raises TimeoutError (not final yet), JobFailed or
    JobCancelled."""
    if not rec.final:
        raise TimeoutError(f"job {rec.id} is {rec.state} after {timeout}s")
    if rec.state == records.FAILED:
        raise JobFailed(rec)
    if rec.state == records.CANCELLED:
        raise JobCancelled(rec)
    return rec


__all__ = [
    "BadIdempotencyKey",
    "check_replicas",
    "JobCancelled",
    "JobFailed",
    "JobRestarted",
    "QueueFull",
    "RedisFull",
    "accepting",
    "UnknownModel",
    "final",
    "queue_full",
    "submitted",
]
