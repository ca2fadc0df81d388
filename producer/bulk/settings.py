"""Settings of bulk batches: environment variables PLURAI_BATCH_*."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class BulkSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PLURAI_BATCH_", extra="ignore")

    window: int = 256  # input lines with requests in flight at once, per batch
    max_line_bytes: int = 1 << 20  # a longer input line is refused
    default_max_tokens: int = 256  # when a chat request gives none
    pass_s: float = 5.0  # one step task drives its batch this long, then re-queues itself
    poll_s: float = 0.2  # longest wait for a job's done message before looking again
    look_s: float = 1.0  # how often a pass reads the status and every in-flight job's state
    completion_window_s: int = 24 * 3600  # an unfinished batch expires after this
    ttl_s: int = 7 * 24 * 3600  # a finished batch's keys expire after this
    # An unfinished batch's keys expire this long after they were last written or renewed
    # (every pass of its driver renews them): a safety net for a batch nobody drives any
    # more. Keep it above completion_window_s.
    running_ttl_s: int = 14 * 24 * 3600
    stale_s: float = 60.0  # maintenance re-kicks a running batch silent for this long
    maintain_interval_s: float = 30.0  # celery beat period of the maintenance task
    # Celery's redelivery time for unacknowledged tasks; far longer than any task (pass_s).
    visibility_timeout_s: int = 3600
