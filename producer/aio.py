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
from typing import Any

import redis.asyncio

from broker_config import keys
from broker_config.connection import connect_async, resolve_url
from broker_config.settings import Settings
from producer.client import _final, _s
from producer.errors import queue_full
from producer.request import prepare
from results import scripts, tokens
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
        self._submit = self.redis.register_script(scripts.SUBMIT)
        self._cancel = self.redis.register_script(scripts.CANCEL)

    async def submit(
        self, prompt: str | None = None, *, queue_timeout: float = 0.0, **options: Any
    ) -> AsyncJob:
        _job_id, key_list, args = prepare(self.settings, prompt=prompt, **options)
        give_up = time.monotonic() + queue_timeout
        while True:
            try:
                return AsyncJob(self, _s(await self._submit(keys=key_list, args=args)))
            except redis.ResponseError as e:
                full = queue_full(e, args[5], self.settings.queue_full_retry_s)
                if full is None:
                    raise
                left = give_up - time.monotonic()
                if left <= 0:
                    raise full from None
                await asyncio.sleep(min(0.1, left))

    async def submit_many(self, requests: list[dict[str, Any]]) -> list[AsyncJob]:
        sha = await self.redis.script_load(scripts.SUBMIT)
        jobs: list[AsyncJob] = []
        for i in range(0, len(requests), 5000):
            pipe = self.redis.pipeline(transaction=False)
            lanes = []
            for req in requests[i : i + 5000]:
                _job_id, key_list, args = prepare(self.settings, **req)
                pipe.execute_command("EVALSHA", sha, len(key_list), *key_list, *args)
                lanes.append(args[5])
            replies = await pipe.execute(raise_on_error=False)
            full = None
            for reply, lane in zip(replies, lanes, strict=True):
                if isinstance(reply, Exception):
                    full = queue_full(reply, lane, self.settings.queue_full_retry_s)
                    if full is None:
                        raise reply
                else:
                    jobs.append(AsyncJob(self, _s(reply)))
            if full is not None:
                full.accepted = jobs
                raise full
        return jobs

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, job_id)

    async def records(self, job_ids: list[str]) -> list[JobRecord]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        return [
            JobRecord.from_hash(j, h) for j, h in zip(job_ids, await pipe.execute(), strict=True)
        ]

    async def wait_all(
        self, jobs: list[AsyncJob] | list[str], timeout: float | None = None
    ) -> list[JobRecord]:
        """Block until every job is final (or timeout); subscribe first, then read."""
        ids = [j.id if isinstance(j, AsyncJob) else j for j in jobs]
        by_channel = {keys.done_channel(j): j for j in ids}
        deadline = None if timeout is None else time.monotonic() + timeout
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(*by_channel)
            pending = {r.id for r in await self.records(ids) if not r.final}
            while pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                msg = await pubsub.get_message(timeout=1.0 if left is None else min(left, 1.0))
                if msg is None:  # quiet for a second: look again, in case a message was lost
                    pending -= {r.id for r in await self.records(sorted(pending)) if r.final}
                    continue
                pending.discard(by_channel[_s(msg["channel"])])
            return await self.records(ids)
        finally:
            await pubsub.aclose()

    async def aclose(self) -> None:
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
        return JobRecord.from_hash(self.id, await self.client.redis.hgetall(keys.job(self.id)))

    async def status(self) -> str:
        return (await self.record()).state

    async def result(self, timeout: float | None = None) -> JobRecord:
        """Wait for the final result. Raises TimeoutError, JobFailed or JobCancelled."""
        (rec,) = await self.client.wait_all([self.id], timeout)
        return _final(rec, timeout)

    async def stream(self, block_ms: int = 1000) -> AsyncIterator[str]:
        follower = tokens.TextFollower()
        key, last = keys.output(self.id), "0-0"
        while True:
            reply = await self.client.redis.xread({key: last}, count=256, block=block_ms)
            for _stream, entries in tokens.stream_items(reply):
                for entry_id, fields in entries:
                    last = entry_id
                    ev = tokens.parse(fields)
                    text = follower.feed(ev)
                    if text:
                        yield text
                    if ev.type == tokens.END:
                        _final(await self.record(), None)
                        return

    async def cancel(self) -> str:
        return _s(
            await self.client._cancel(
                keys=[keys.job(self.id), keys.output(self.id)],
                args=[
                    self.client.settings.result_ttl_s,
                    keys.done_channel(self.id),
                    keys.CANCEL_CHANNEL,
                    self.id,
                    int(time.time() * 1000),
                ],
            )
        )


__all__ = ["AsyncClient", "AsyncJob"]
