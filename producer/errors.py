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


__all__ = ["JobCancelled", "JobFailed", "JobRestarted"]
