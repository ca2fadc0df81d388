"""The asyncio client: the same calls as producer.client, awaited.

async with AsyncClient(url) as client:
    job = await client.submit("Summarize: ...", max_tokens=64)
    async for text in job.stream():
        print(text, end="")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from typing import Any

import redis.asyncio

from broker_config.connection import connect_async, is_cluster, resolve_url
from broker_config.routes import Routes
from broker_config.settings import Settings
from broker_config.text import text
from producer.client import _CHUNK, cancel_call
from producer.errors import QueueFull, accepting, final
from producer.request import SCRIPTS, Checked, check, prepare
from producer.submit import Plan
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
        self.routes = Routes(self.settings)
        if self.settings.submit_replicas and is_cluster(self.redis):
            raise ValueError("PLURAI_SUBMIT_REPLICAS (WAIT) is not available on a Redis Cluster")

    async def submit(
        self, prompt: str | None = None, *, queue_timeout: float = 0.0, **options: Any
    ) -> AsyncJob:
        """As Client.submit."""
        sub = prepare(self.settings, await self.fresh_routes(), prompt=prompt, **options)
        give_up = time.monotonic() + queue_timeout
        while True:
            try:
                return (await self.send([sub]))[0]
            except QueueFull:
                left = give_up - time.monotonic()
                if left <= 0:
                    raise
                await asyncio.sleep(min(0.1, left))

    async def submit_many(self, requests: list[dict[str, Any]]) -> list[AsyncJob]:
        """As Client.submit_many."""
        routes = await self.fresh_routes()
        checked = [check(self.settings, routes, **req) for req in requests]
        await jobs.load_async(self.redis, *SCRIPTS)
        out: list[AsyncJob] = []
        for i in range(0, len(checked), _CHUNK):
            with accepting(out):
                out += await self.send(checked[i : i + _CHUNK], out)
        return out

    async def fresh_routes(self) -> Routes:
        if self.routes.stale():
            self.routes.load(await self.routes.read_async(self.redis))
        return self.routes

    async def send(
        self,
        requests: list[jobs.Submission] | list[Checked],
        before: list[AsyncJob] | None = None,
    ) -> list[AsyncJob]:
        """As Client.send."""
        split = is_cluster(self.redis)
        plan = Plan(requests, self.routes, self.settings, split, before or [], self.job)
        lost = plan.lost(await self._run(plan.commands()))
        if lost:
            await jobs.load_async(self.redis, *SCRIPTS)
            plan.rerun(await self._run(lost))
        cleanup = plan.settle()
        if cleanup:
            await self._run(cleanup)
        return plan.jobs()

    async def _run(self, commands: Iterable[list[Any]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for c in commands:
            pipe.execute_command(*c)
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
        """Wait for the final result. Raises TimeoutError, JobFailed or JobCancelled. A job
        with no record (never submitted here, expired, or queued by a raw-protocol client
        that writes none) is waited for like any other: give a timeout where that matters."""
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
