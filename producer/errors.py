"""Exceptions a client sees when a job did not complete, and the checks (shared by the sync
and async clients) that raise them."""

from __future__ import annotations

import time
from typing import Any

from broker_config.text import text
from results import records
from results.records import JobRecord
from results.tokens import JobRestarted


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

    def __init__(self, lane: str, queued: int, retry_after: float, accepted: list | None = None):
        super().__init__(
            f"lane {lane!r} is full ({queued} jobs waiting); retry after {retry_after:g}s"
        )
        self.lane = lane
        self.queued = queued
        self.retry_after = retry_after
        self.accepted = accepted or []


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


def queue_full(error: Exception, lane: str, retry_after: float) -> QueueFull | None:
    """The QueueFull that a SUBMIT error reply stands for, or None for any other error."""
    text = str(error)
    if not text.startswith("QUEUEFULL"):
        return None
    return QueueFull(lane, int(text.split()[1]), retry_after)


def retry_pause(error: Exception, lane: str, retry_after: float, give_up: float) -> float:
    """After a SUBMIT error reply: the seconds to wait before trying again. Raises `error`
    itself when it is not QUEUEFULL, and QueueFull once time.monotonic() passes `give_up`."""
    full = queue_full(error, lane, retry_after)
    if full is None:
        raise error
    left = give_up - time.monotonic()
    if left <= 0:
        raise full from None
    return min(0.1, left)


def submitted(replies: list[Any], lanes: list[str], retry_after: float) -> list[str]:
    """The job ids of a chunk of SUBMIT replies (one per call, in order, an error reply as
    its exception). If a lane was full, raises QueueFull after the chunk, its `accepted`
    holding the ids queued; any other error reply is raised as it is."""
    ids: list[str] = []
    full: QueueFull | None = None
    for reply, lane in zip(replies, lanes, strict=True):
        if not isinstance(reply, Exception):
            ids.append(text(reply))
            continue
        full = queue_full(reply, lane, retry_after)
        if full is None:
            raise reply
    if full is not None:
        full.accepted = ids
        raise full
    return ids


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
    "JobCancelled",
    "JobFailed",
    "JobRestarted",
    "QueueFull",
    "final",
    "queue_full",
    "retry_pause",
    "submitted",
]
