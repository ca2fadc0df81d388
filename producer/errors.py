"""Exceptions a client sees when a job did not complete."""

from __future__ import annotations

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


def queue_full(error: Exception, lane: str, retry_after: float) -> QueueFull | None:
    """The QueueFull that a SUBMIT error reply stands for, or None for any other error."""
    text = str(error)
    if not text.startswith("QUEUEFULL"):
        return None
    return QueueFull(lane, int(text.split()[1]), retry_after)


__all__ = ["JobCancelled", "JobFailed", "JobRestarted", "QueueFull", "queue_full"]
