"""One reader for every token stream a gateway is sending: a single blocking XREAD over all
of them, whose entries go to each stream's queue.

Following each stream with its own blocking XREAD costs a round trip per stream per engine
step; a worker writes the deltas of all its running jobs at once, so one XREAD over every
followed stream returns them together. A stream that starts being followed while the
reader is blocked is picked up at once: the reader's XREAD also watches this gateway's
wake-up stream, which `follow` writes to.

A Redis blip (a connection lost or a read timed out) is retried for up to OUTAGE_S, from
the same positions, so the streams go on where they were; only a longer outage ends them.

A stream whose client is behind (its response waits on a slow reader) is not read while
it holds MAX_QUEUED batches, or MAX_QUEUED_CHARS of text, not yet taken: its tokens wait
in Redis, not in the gateway, and reading it resumes (with a wake-up) once its client
takes one.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import redis
import redis.asyncio

from plurai.broker_config import keys
from plurai.results import records, tokens

log = logging.getLogger("plurai.gateway")

BLOCK_MS = 5000
READ_TIMEOUT_S = BLOCK_MS / 1000 + 10  # an XREAD not back by then went to a dead connection
OUTAGE_S = 10.0  # transient read errors retried this long before the followers are failed
WAKE_TTL_S = 60
MAX_QUEUED = 4  # batches (of up to 256 entries) read ahead of a stream's client
MAX_QUEUED_CHARS = 64 << 10  # and their text


class Follow:
    """A followed token stream: its position and the events read but not yet taken."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.reader = tokens.Reader(job_id)
        self.queue: asyncio.Queue[list[tokens.Event] | BaseException] = asyncio.Queue()
        self.done = False  # its end (or an error) is delivered: no need to read it again
        self.paused = False  # left out of the reads: MAX_QUEUED batches wait for its client
        self.chars = 0  # the text of the batches queued

    def put(self, batch: list[tokens.Event]) -> None:
        self.chars += sum(len(e.text) for e in batch)
        self.queue.put_nowait(batch)

    def full(self) -> bool:
        return self.queue.qsize() >= MAX_QUEUED or self.chars >= MAX_QUEUED_CHARS


class Streams:
    """The shared reader, on the gateway's connection (`r` decodes replies)."""

    def __init__(self, r: redis.asyncio.Redis) -> None:
        self.r = r
        self.wake_key = keys.gateway_wake(secrets.token_hex(8))
        # not "$": a wake written before the reader's first XREAD reaches Redis must count
        self.wake_id: Any = "0-0"
        self.followed: dict[str, Follow] = {}  # stream key -> its follower
        self.task: asyncio.Task | None = None
        self.idle = asyncio.Event()  # set while nothing is followed
        self.blocked = False  # whether the reader waits in XREAD now
        self.woken = False  # whether a wake-up was sent during this XREAD
        self.failing_since: float | None = None  # monotonic time of the first failed read

    async def batches(self, job_id: str, new: bool = True) -> AsyncIterator[list[tokens.Event]]:
        """Every event of the job's stream from its start, until `end`, in the batches
        that were read together (what came at once can be sent on in one piece).

        A job submitted before (`new` false: an idempotency key's earlier job) is read on
        its own: a finished job whose stream has expired gets its record's text at once
        (the shared reader would wait for that stream forever)."""
        f = Follow(job_id)
        if not new and not await self.r.exists(f.reader.key):  # expired, or yet to come
            batch = list(f.reader.gone(await records.get_async(self.r, job_id)))
            if batch:
                yield batch
                return
        if not new or f.reader.key in self.followed:
            async for ev in tokens.events_async(self.r, job_id, block_ms=BLOCK_MS):
                yield [ev]
            return
        self.followed[f.reader.key] = f
        try:
            if self.task is None or self.task.done():
                self.task = asyncio.ensure_future(self._run())
            await self._wake()
            while True:
                batch = await f.queue.get()
                if isinstance(batch, BaseException):
                    raise batch
                f.chars -= sum(len(e.text) for e in batch)
                if f.paused and not f.done:  # its client caught up: read it again
                    f.paused = False
                    await self._wake()
                yield batch
                if batch[-1].type == tokens.END:
                    return
        finally:
            self.followed.pop(f.reader.key, None)

    async def _wake(self) -> None:
        """Have the reader take in the streams followed (or resumed) since its last read."""
        self.idle.set()  # a reader waiting for work takes them in its next read
        if self.blocked and not self.woken:  # a reader blocked on others must read again
            self.woken = True  # one wake-up brings in every stream followed meanwhile
            pipe = self.r.pipeline(transaction=False)
            pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
            pipe.expire(self.wake_key, WAKE_TTL_S)
            await pipe.execute()

    async def close(self) -> None:
        """Stop the reader (at shutdown). A blocked XREAD may hold the cancel until it
        returns, so this waits a second at most."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=1)

    async def _run(self) -> None:
        while True:
            for f in self.followed.values():
                f.paused = f.paused or f.full()
            request: dict[Any, Any] = {
                k: f.reader.last_id for k, f in self.followed.items() if not f.done and not f.paused
            }
            if not request:  # a stream whose end was read is not read again
                self.idle.clear()
                await self.idle.wait()
                continue
            request[self.wake_key] = self.wake_id
            try:
                self.blocked, self.woken = True, False
                try:
                    async with asyncio.timeout(READ_TIMEOUT_S):
                        reply = await self._read(request)
                finally:
                    self.blocked = False
                self.failing_since = None
                self._deliver(reply)
            except Exception as e:  # every follower learns of it: none waits forever
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # redis-py can turn a cancel
                    raise asyncio.CancelledError from e  # into a ConnectionError
                if isinstance(e, TimeoutError):  # asyncio.timeout's
                    e = redis.TimeoutError(f"no XREAD reply in {READ_TIMEOUT_S:g} s")
                elif not isinstance(e, redis.RedisError):
                    log.exception("the shared stream reader failed")
                if await self._blip(e):
                    continue  # read again from the same positions: nothing lost or repeated
                for f in self.followed.values():
                    if not f.done:
                        f.done = True
                        f.queue.put_nowait(e)
                await asyncio.sleep(0.2)

    async def _blip(self, e: Exception) -> bool:
        """Whether to retry after a transient read error: for up to OUTAGE_S since the
        first of a run of them, after a short pause."""
        if not isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
            return False
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
            log.warning("token streams: %s; reading again for up to %g s", e, OUTAGE_S)
        if now - self.failing_since >= OUTAGE_S:
            self.failing_since = None
            return False
        await asyncio.sleep(0.2)
        return True

    async def _read(self, request: dict[Any, Any]) -> Any:
        """The XREAD of every followed stream. A stream that cannot be read (its key of
        another type, or an entry that is not UTF-8 on a connection that decodes) fails the
        whole XREAD: then each stream is read on its own, and only those fail."""
        try:
            return await self.r.xread(request, count=256, block=BLOCK_MS)
        except (redis.ResponseError, UnicodeDecodeError) as e:
            if not _unreadable(e):
                raise
        reply: list[tuple[Any, list[Any]]] = []
        for key, last in request.items():
            try:
                reply += tokens.stream_items(await self.r.xread({key: last}, count=256))
            except (redis.ResponseError, UnicodeDecodeError) as e:
                f = self.followed.get(key)
                if f is None or not _unreadable(e):
                    raise
                log.warning("token stream %s: unreadable (%s)", key, e)
                f.done = True
                f.queue.put_nowait(records.damaged(e, f.job_id, "token stream"))
        return reply

    def _deliver(self, reply: Any) -> None:
        for stream, entries in tokens.stream_items(reply):
            key = stream  # the gateway's connection decodes
            if key == self.wake_key:
                self.wake_id = entries[-1][0]
                continue
            f = self.followed.get(key)
            if f is None or f.done:
                continue
            batch: list[tokens.Event] = []
            try:
                batch.extend(f.reader.feed([(stream, entries)]))
                f.done = f.reader.ended
            except records.BadRecord as e:  # a damaged entry fails its own stream
                log.warning("token stream %s: a damaged entry (%s)", key, e)
                f.done = True
                if batch:
                    f.put(batch)
                f.queue.put_nowait(e)
                continue
            if batch:
                f.put(batch)


def _unreadable(e: Exception) -> bool:
    """Whether a read failed on what a stream holds (records.damaged), not on Redis."""
    return records.damaged(e, "", "") is not e
