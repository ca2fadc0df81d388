"""Blocking waits for final results, by pub/sub on each job's done channel.

Subscribing before reading the record closes the race with a job that finishes in between.
`Waiter` is the wait without its I/O; `wait_many` and `wait_many_async` run it.
"""

from __future__ import annotations

import time
from typing import Any

import redis
import redis.asyncio

from broker_config import keys
from broker_config.text import text
from results import records

_SUBSCRIBE_CHUNK = 1000  # channels per SUBSCRIBE
_QUIET_S = 1.0  # after this long without a message, the records are read again


class Waiter:
    """The state of one wait for jobs' final results.

    Subscribe to `channels()`, then `read` the records; while `wait_s()` is not None, wait
    that long for a message and give it to `heard`, or, when none came, `read` the records
    of `unsettled()` again (pub/sub is not durable: a message may have been lost)."""

    def __init__(self, job_ids: list[str], timeout: float | None) -> None:
        self.job_ids = list(job_ids)
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self._by_channel = {keys.done_channel(j): j for j in self.job_ids}
        self._pending = set(self.job_ids)

    def channels(self) -> list[list[str]]:
        """The done channels to subscribe to, in chunks of one SUBSCRIBE each."""
        names = list(self._by_channel)
        return [names[i : i + _SUBSCRIBE_CHUNK] for i in range(0, len(names), _SUBSCRIBE_CHUNK)]

    def unsettled(self) -> list[str]:
        return sorted(self._pending)

    def read(self, recs: list[records.JobRecord]) -> None:
        self._pending -= {rec.id for rec in recs if rec.final}

    def heard(self, message: dict[str, Any]) -> None:
        self._pending.discard(self._by_channel.get(text(message["channel"]), ""))

    def wait_s(self) -> float | None:
        """How long to wait for the next message; None: stop (every job is final, or the
        time is up)."""
        if not self._pending:
            return None
        if self.deadline is None:
            return _QUIET_S
        left = self.deadline - time.monotonic()
        return None if left <= 0 else min(left, _QUIET_S)


def wait(r: redis.Redis, job_id: str, timeout: float | None) -> records.JobRecord:
    """The record once final, or as it stands when `timeout` seconds have passed."""
    return wait_many(r, [job_id], timeout)[0]


def wait_many(r: redis.Redis, job_ids: list[str], timeout: float | None) -> list[records.JobRecord]:
    w = Waiter(job_ids, timeout)
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    try:
        for chunk in w.channels():
            pubsub.subscribe(*chunk)
        w.read(records.get_many(r, w.job_ids))
        while (wait_s := w.wait_s()) is not None:
            msg = pubsub.get_message(timeout=wait_s)
            if msg is None:
                w.read(records.get_many(r, w.unsettled()))
            else:
                w.heard(msg)
        return records.get_many(r, w.job_ids)
    finally:
        pubsub.close()


async def wait_many_async(
    r: redis.asyncio.Redis, job_ids: list[str], timeout: float | None
) -> list[records.JobRecord]:
    """`wait_many`, awaited."""
    w = Waiter(job_ids, timeout)
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    try:
        for chunk in w.channels():
            await pubsub.subscribe(*chunk)
        w.read(await records.get_many_async(r, w.job_ids))
        while (wait_s := w.wait_s()) is not None:
            msg = await pubsub.get_message(timeout=wait_s)
            if msg is None:
                w.read(await records.get_many_async(r, w.unsettled()))
            else:
                w.heard(msg)
        return await records.get_many_async(r, w.job_ids)
    finally:
        await pubsub.aclose()
