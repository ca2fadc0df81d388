"""The asyncio client: the same calls as producer.client, awaited.

async with AsyncClient(url) as client:
    job = await client.submit("Summarize: ...", max_tokens=64)
    async for text in job.stream():
        print(text, end="")

Sends that are waiting while one is in flight go to Redis together: one pipeline carries
the submits of every call that came meanwhile (a gateway's burst of requests, each a
submit of its own), each call getting its own jobs or error. A burst costs a few round
trips on one connection rather than a round trip and a connection of its own per call.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from typing import Any

import redis.asyncio

from plurai.broker_config.connection import connect_async, is_cluster, resolve_url
from plurai.broker_config.routes import Routes
from plurai.broker_config.settings import Settings
from plurai.broker_config.text import text
from plurai.producer.client import _CHUNK, cancel_call
from plurai.producer.errors import QueueFull, accepting, final
from plurai.producer.request import SCRIPTS, Checked, check, prepare
from plurai.producer.submit import Plan
from plurai.results import jobs, records, tokens, wait
from plurai.results.records import JobRecord


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
        self.reading: asyncio.Future[None] | None = None  # the routes' read in flight
        self.queued: deque[tuple[Plan, asyncio.Future]] = deque()  # sends not yet in flight
        self.sending: asyncio.Task | None = None  # the task sending them
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
        """The model directory, read again once it is REFRESH_S old: by one read at a
        time, which the calls that find it stale meanwhile wait for (a burst of requests
        had each read it, on a connection of its own)."""
        if self.routes.stale():
            if self.reading is None or self.reading.done():
                self.reading = asyncio.ensure_future(self._read_routes())
            await asyncio.shield(self.reading)  # a caller that leaves stops no one's read
        return self.routes

    async def _read_routes(self) -> None:
        self.routes.load(await self.routes.read_async(self.redis))

    async def send(
        self,
        requests: list[jobs.Submission] | list[Checked],
        before: list[AsyncJob] | None = None,
    ) -> list[AsyncJob]:
        """As Client.send; queued behind the send in flight, and sent with the others
        queued meanwhile (the module's docstring)."""
        plan = Plan(
            requests, self.routes, self.settings, is_cluster(self.redis), before or [], self.job
        )
        done: asyncio.Future[list[AsyncJob]] = asyncio.get_running_loop().create_future()
        self.queued.append((plan, done))
        if self.sending is None or self.sending.done():
            self.sending = asyncio.ensure_future(self._send_queued())
        return await done

    async def _send_queued(self) -> None:
        while self.queued:
            batch: list[tuple[Plan, asyncio.Future]] = []
            size = 0
            while self.queued and size < _CHUNK:
                plan, done = self.queued.popleft()
                if not done.done():  # else its caller gave up before it was sent
                    batch.append((plan, done))
                    size += len(plan.requests)
            if not batch:
                continue
            try:
                await self._send_plans([plan for plan, _ in batch])
            except asyncio.CancelledError:  # the client's loop is ending
                for _, done in batch:
                    done.cancel()
                raise
            except Exception as e:  # Redis failed them all, as it would have one by one
                for _, done in batch:
                    if not done.done():
                        done.set_exception(e)
                continue
            for plan, done in batch:
                if not done.done():
                    try:
                        done.set_result(plan.jobs())
                    except Exception as e:  # this call's refusal (QueueFull, ...) alone
                        done.set_exception(e)

    async def _send_plans(self, plans: list[Plan]) -> None:
        """Run the plans as producer.submit says, their commands in one pipeline a step;
        with PLURAI_SUBMIT_REPLICAS one WAIT, after them all, answers for every plan (a
        WAIT each would wait its timeout once per call while a replica is behind)."""
        for plan in plans[:-1]:
            plan.wait = False
        commands = [list(plan.commands()) for plan in plans]
        replies = iter(await self._run(c for cs in commands for c in cs))
        lost = [
            plan.lost([next(replies) for _ in cs]) for plan, cs in zip(plans, commands, strict=True)
        ]
        if any(lost):
            await jobs.load_async(self.redis, *SCRIPTS)
            again = iter(await self._run(c for cs in lost for c in cs))
            for plan, cs in zip(plans, lost, strict=True):
                if cs:
                    plan.rerun([next(again) for _ in cs])
        cleanup = [c for plan in plans for c in plan.settle()]
        for plan in plans[:-1]:
            plan.acked = plans[-1].acked
        if cleanup:
            await self._run(cleanup)

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
        choices = self.stream_choices(block_ms)
        async with aclosing(choices):
            async for index, delta in choices:
                if index == 0:
                    yield delta

    async def stream_choices(self, block_ms: int = 1000) -> AsyncIterator[tuple[int, str]]:
        """As Job.stream_choices."""
        follower = tokens.TextFollower()
        events = tokens.events_async(self.client.redis, self.id, block_ms=block_ms)
        async with aclosing(events):
            async for ev in events:
                delta = follower.feed(ev)
                if delta:
                    yield ev.index, delta
        final(await self.record(), None)

    async def cancel(self) -> str:
        return text(
            await jobs.run_async(self.client.redis, cancel_call(self.client.settings, self.id))
        )


__all__ = ["AsyncClient", "AsyncJob"]
