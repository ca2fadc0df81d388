"""The asyncio client: the same calls as producer.client, awaited.

async with AsyncClient(url) as client:
    job = await client.submit("Summarize: ...", max_tokens=64)
    async for text in job.stream():
        print(text, end="")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import redis.asyncio
from redis.exceptions import NoScriptError

from broker_config.connection import connect_async, resolve_url
from broker_config.settings import Settings
from broker_config.text import text
from producer.client import _CHUNK, cancel_call
from producer.errors import NotReplicated, QueueFull, final, retry_pause, submitted
from producer.request import prepare
from results import jobs, records, tokens, wait
from results.records import JobRecord


class AsyncClient:
    def __init__(
        self,
        url: str | None = None,
        *,
        settings: Settings | None = None,
        redis: redis.asyncio.Redis | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.redis = (
            redis
            if redis is not None
            else connect_async(resolve_url(url, self.settings), decode=True)
        )
        self.listeners = wait.AsyncListeners(self.redis)  # pub/sub connections kept for waits

    async def submit(
        self, prompt: str | None = None, *, queue_timeout: float = 0.0, **options: Any
    ) -> AsyncJob:
        """As Client.submit."""
        call = prepare(self.settings, prompt=prompt, **options)
        give_up = time.monotonic() + queue_timeout
        while True:
            try:
                if self.settings.submit_replicas:
                    return (await self._send([call], []))[0]
                return AsyncJob(self, text(await jobs.run_async(self.redis, call)))
            except QueueFull:  # from the path that waits for replicas
                left = give_up - time.monotonic()
                if left <= 0:
                    raise
                await asyncio.sleep(min(self.settings.queue_full_retry_s, left))
            except redis.ResponseError as e:
                retry = self.settings.queue_full_retry_s
                await asyncio.sleep(retry_pause(e, call.lane, retry, give_up))

    async def submit_many(self, requests: list[dict[str, Any]]) -> list[AsyncJob]:
        """As Client.submit_many."""
        await jobs.load_async(self.redis, "SUBMIT")
        out: list[AsyncJob] = []
        for i in range(0, len(requests), _CHUNK):
            calls = [prepare(self.settings, **req) for req in requests[i : i + _CHUNK]]
            out += await self._send(calls, out)
        return out

    async def _send(self, calls: list[jobs.Call], before: list[AsyncJob]) -> list[AsyncJob]:
        """As Client._send: SUBMIT calls in one pipeline, then (PLURAI_SUBMIT_REPLICAS) a
        WAIT on the same connection."""
        s = self.settings
        replies = await self._pipeline(calls)
        missing = [i for i, x in enumerate(replies[: len(calls)]) if isinstance(x, NoScriptError)]
        if missing:  # Redis lost its scripts: those calls did nothing
            await jobs.load_async(self.redis, "SUBMIT")
            again = await self._pipeline([calls[i] for i in missing])
            for i, reply in zip(missing, again, strict=False):
                replies[i] = reply
            if s.submit_replicas:
                replies[-1] = again[-1]
        acked = replies.pop() if s.submit_replicas else 0
        try:
            ids = submitted(replies, [c.lane for c in calls], s.queue_full_retry_s)
        except QueueFull as full:
            full.accepted = before + [AsyncJob(self, j) for j in full.accepted]
            raise
        if s.submit_replicas and acked < s.submit_replicas:
            raise NotReplicated(ids, acked, s.submit_replicas, s.submit_replicas_timeout_ms)
        return [AsyncJob(self, j) for j in ids]

    async def _pipeline(self, calls: list[jobs.Call]) -> list[Any]:
        s = self.settings
        pipe = self.redis.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command(*call.command())
        if s.submit_replicas:
            pipe.execute_command("WAIT", s.submit_replicas, s.submit_replicas_timeout_ms)
        return await pipe.execute(raise_on_error=False)

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, job_id)

    async def records(self, job_ids: list[str]) -> list[JobRecord]:
        return await records.get_many_async(self.redis, job_ids)

    async def wait_all(
        self, jobs: list[AsyncJob] | list[str], timeout: float | None = None
    ) -> list[JobRecord]:
        """Block until every job is final (or timeout); returns their records in order."""
        ids = [j.id if isinstance(j, AsyncJob) else j for j in jobs]
        return await wait.wait_many_async(self.redis, ids, timeout, self.listeners)

    async def aclose(self) -> None:
        await self.listeners.close()
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncJob:
    def __init__(self, client: AsyncClient, job_id: str) -> None:
        self.client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"

    async def record(self) -> JobRecord:
        return await records.get_async(self.client.redis, self.id)

    async def status(self) -> str:
        return (await self.record()).state

    async def result(self, timeout: float | None = None) -> JobRecord:
        """Wait for the final result. Raises TimeoutError, JobFailed or JobCancelled."""
        (rec,) = await wait.wait_many_async(
            self.client.redis, [self.id], timeout, self.client.listeners
        )
        return final(rec, timeout)

    async def stream(self, block_ms: int = 1000) -> AsyncIterator[str]:
        """As Job.stream."""
        follower = tokens.TextFollower()
        events = tokens.events_async(self.client.redis, self.id, block_ms=block_ms)
        async with aclosing(events):
            async for ev in events:
                delta = follower.feed(ev)
                if delta:
                    yield delta
        final(await self.record(), None)

    async def cancel(self) -> str:
        return text(
            await jobs.run_async(self.client.redis, cancel_call(self.client.settings, self.id))
        )


__all__ = ["AsyncClient", "AsyncJob"]
