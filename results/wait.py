"""Blocking waits for final results, by pub/sub on each job's done channel.

Subscribing before reading the record closes the race with a job that finishes in between.
`Waiter` is the wait without its I/O; `wait_many` and `wait_many_async` run it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import redis
import redis.asyncio

from plurai.broker_config import keys
from plurai.broker_config.text import text
from plurai.results import records

_SUBSCRIBE_CHUNK = 1000  # channels per SUBSCRIBE
_QUIET_S = 1.0  # after this long without a message, the records are read again


class Waiter:
    """The state of one wait for jobs' final results.

    Subscribe to `channels()`, then `read` the records; while `wait_s()` is not None, wait
    that long for a message and give it to `heard`; when `quiet()` (nothing read or heard
    for a second), `read` the records of `unsettled()` again (pub/sub is not durable: a
    message may have been lost). A wait that returns no message is not always quiet: the
    client library returns none when it consumed a (un)subscribe confirmation."""

    def __init__(self, job_ids: list[str], timeout: float | None) -> None:
        self.job_ids = list(job_ids)
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self._by_channel = {keys.done_channel(j): j for j in self.job_ids}
        self._pending = set(self.job_ids)
        self._quiet_at = time.monotonic() + _QUIET_S

    def channels(self) -> list[list[str]]:
        """The done channels to subscribe to, in chunks of one SUBSCRIBE each."""
        names = list(self._by_channel)
        return [names[i : i + _SUBSCRIBE_CHUNK] for i in range(0, len(names), _SUBSCRIBE_CHUNK)]

    def unsettled(self) -> list[str]:
        return sorted(self._pending)

    def read(self, recs: list[records.JobRecord]) -> None:
        self._pending -= {rec.id for rec in recs if rec.final}
        self._quiet_at = time.monotonic() + _QUIET_S

    def heard(self, message: dict[str, Any]) -> None:
        job_id = self._by_channel.get(text(message["channel"]))
        if job_id is not None:
            self._pending.discard(job_id)
            self._quiet_at = time.monotonic() + _QUIET_S

    def quiet(self) -> bool:
        return time.monotonic() >= self._quiet_at

    def wait_s(self) -> float | None:
        """How long to wait for the next message; None: stop (every job is final, or the
        time is up)."""
        if not self._pending:
            return None
        now = time.monotonic()
        quiet = max(0.0, self._quiet_at - now)
        if self.deadline is None:
            return quiet
        left = self.deadline - now
        return None if left <= 0 else min(left, quiet)


_KEPT = 8  # idle pub/sub connections a client keeps for its next waits


class Listeners:
    """Pub/sub connections kept between waits: a wait borrows one and gives it back
    unsubscribed, so a client's waits do not each open a connection (a HELLO and CLIENT
    calls on the server, a TCP handshake here). A message for a channel of an earlier wait
    that arrives late is ignored (Waiter.heard knows only its own channels)."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    def take(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self.r.pubsub(ignore_subscribe_messages=True)

    def give(self, pubsub: Any, ok: bool) -> None:
        """Back after a wait; `ok`: it ended without an error (else it is closed)."""
        if ok:
            try:
                pubsub.unsubscribe()
            except redis.RedisError:
                ok = False
        with self._lock:
            if ok and len(self._idle) < _KEPT:
                self._idle.append(pubsub)
                return
        pubsub.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for pubsub in idle:
            pubsub.close()


class AsyncListeners:
    """`Listeners` for the asyncio client."""

    def __init__(self, r: redis.asyncio.Redis) -> None:
        self.r = r
        self._idle: list[Any] = []

    def take(self) -> Any:
        return self._idle.pop() if self._idle else self.r.pubsub(ignore_subscribe_messages=True)

    async def give(self, pubsub: Any, ok: bool) -> None:
        if ok:
            try:
                await pubsub.unsubscribe()
            except redis.RedisError:
                ok = False
        if ok and len(self._idle) < _KEPT:
            self._idle.append(pubsub)
        else:
            await pubsub.aclose()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for pubsub in idle:
            await pubsub.aclose()


class SharedDone:
    """Listeners (the `listeners` of wait_many_async) by which many concurrent waits of one
    asyncio process share one pub/sub connection (the gateway's: a connection per waiting
    request would be thousands under load, each a handshake on both sides). Each wait gets
    a `_Share` in place of a connection; one reader task hands each message to the shares
    of its channel. Pub/sub is not durable (a message is lost while the connection
    reconnects): each wait reads its records again when quiet, as Waiter says."""

    def __init__(self, r: redis.asyncio.Redis) -> None:
        self.r = r
        self.pubsub: Any = None
        self.shares: dict[str, set[_Share]] = {}  # channel -> the waits on it
        self.reader: asyncio.Task | None = None

    def take(self) -> _Share:
        return _Share(self)

    async def give(self, share: _Share, ok: bool) -> None:
        gone = []
        for c in share.channels:
            waits = self.shares.get(c, set())
            waits.discard(share)
            if not waits:
                self.shares.pop(c, None)
                gone.append(c)
        if gone and self.pubsub is not None:
            try:
                await self.pubsub.unsubscribe(*gone)
            except (redis.RedisError, OSError):  # it reconnects with the channels left
                pass

    async def subscribe(self, share: _Share, channels: tuple[str, ...]) -> None:
        if self.pubsub is None:
            self.pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        new = [c for c in channels if c not in self.shares]
        for c in channels:
            self.shares.setdefault(c, set()).add(share)
        if new:
            await self.pubsub.subscribe(*new)
        if self.reader is None or self.reader.done():
            self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        """Hand each message to its channel's waits, while any wait is on."""
        while self.shares:
            try:
                msg = await self.pubsub.get_message(timeout=1.0)
            except (redis.RedisError, OSError):  # the waits read their records meanwhile
                await asyncio.sleep(0.5)
                continue
            if msg is not None and msg.get("type") == "message":
                for share in self.shares.get(text(msg["channel"]), ()):
                    share.queue.put_nowait(msg)

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)
        if self.pubsub is not None:
            await self.pubsub.aclose()


class _Share:
    """One wait's part of a SharedDone: what wait_many_async asks of a pub/sub connection."""

    def __init__(self, hub: SharedDone) -> None:
        self.hub = hub
        self.channels: list[str] = []
        self.queue: asyncio.Queue = asyncio.Queue()

    async def subscribe(self, *channels: str) -> None:
        self.channels += channels
        await self.hub.subscribe(self, channels)

    async def get_message(self, timeout: float) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None


def wait(
    r: redis.Redis, job_id: str, timeout: float | None, listeners: Listeners | None = None
) -> records.JobRecord:
    """The record once final, or as it stands when `timeout` seconds have passed."""
    return wait_many(r, [job_id], timeout, listeners)[0]


def wait_many(
    r: redis.Redis, job_ids: list[str], timeout: float | None, listeners: Listeners | None = None
) -> list[records.JobRecord]:
    """`listeners`: where the pub/sub connection comes from and goes back to (None: one of
    its own, closed after)."""
    w = Waiter(job_ids, timeout)
    pubsub = listeners.take() if listeners else r.pubsub(ignore_subscribe_messages=True)
    ok = False
    try:
        for chunk in w.channels():
            pubsub.subscribe(*chunk)
        w.read(records.get_many(r, w.job_ids))
        while (wait_s := w.wait_s()) is not None:
            msg = pubsub.get_message(timeout=wait_s)
            if msg is not None:
                w.heard(msg)
            elif w.quiet():
                w.read(records.get_many(r, w.unsettled()))
        out = records.get_many(r, w.job_ids)
        ok = True
        return out
    finally:
        if listeners:
            listeners.give(pubsub, ok)
        else:
            pubsub.close()


async def wait_many_async(
    r: redis.asyncio.Redis,
    job_ids: list[str],
    timeout: float | None,
    listeners: AsyncListeners | SharedDone | None = None,
) -> list[records.JobRecord]:
    """`wait_many`, awaited."""
    w = Waiter(job_ids, timeout)
    pubsub = listeners.take() if listeners else r.pubsub(ignore_subscribe_messages=True)
    ok = False
    try:
        for chunk in w.channels():
            await pubsub.subscribe(*chunk)
        w.read(await records.get_many_async(r, w.job_ids))
        while (wait_s := w.wait_s()) is not None:
            msg = await pubsub.get_message(timeout=wait_s)
            if msg is not None:
                w.heard(msg)
            elif w.quiet():
                w.read(await records.get_many_async(r, w.unsettled()))
        out = await records.get_many_async(r, w.job_ids)
        ok = True
        return out
    finally:
        if listeners:
            await listeners.give(pubsub, ok)
        else:
            await pubsub.aclose()
