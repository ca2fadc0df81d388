"""Blocking waits for final results, by pub/sub on each job's done channel.

Subscribing before reading the record closes the race with a job that finishes in between.
"""

from __future__ import annotations

import time

import redis

from broker_config import keys
from results import records


def wait(r: redis.Redis, job_id: str, timeout: float | None) -> records.JobRecord:
    """The record once final, or as it stands when `timeout` seconds have passed."""
    return wait_many(r, [job_id], timeout)[0]


def wait_many(r: redis.Redis, job_ids: list[str], timeout: float | None) -> list[records.JobRecord]:
    deadline = None if timeout is None else time.monotonic() + timeout
    by_channel = {keys.done_channel(j): j for j in job_ids}
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    try:
        channels = list(by_channel)
        for i in range(0, len(channels), 1000):
            pubsub.subscribe(*channels[i : i + 1000])
        recs = records.get_many(r, job_ids)
        pending = {rec.id for rec in recs if not rec.final}
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            msg = pubsub.get_message(timeout=1.0 if left is None else min(left, 1.0))
            if msg is None:  # quiet for a second: look again, in case a message was lost
                ids = sorted(pending)
                pending -= {rec.id for rec in records.get_many(r, ids) if rec.final}
                continue
            channel = msg["channel"]
            pending.discard(by_channel[channel.decode() if isinstance(channel, bytes) else channel])
        return records.get_many(r, job_ids)
    finally:
        pubsub.close()
