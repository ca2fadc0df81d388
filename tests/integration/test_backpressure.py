"""Backpressure: a lane holds at most PLURAI_MAX_QUEUED_PER_LANE waiting jobs; past it
submit raises QueueFull with a retry-after hint, or waits for room when asked. The check
and the enqueue are one script, so concurrent producers never overshoot the limit."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from plurai.broker_config import keys
from plurai.broker_config.groups import ensure_groups
from plurai.broker_config.settings import Settings
from plurai.producer import AsyncClient, Client, QueueFull

LIMIT = 5


def test_queue_full(shared_redis_url, r):
    client = Client(
        shared_redis_url, settings=Settings(max_queued_per_lane=LIMIT, queue_full_retry_s=2)
    )
    first = client.submit_many([{"prompt": "x", "lane": "batch"}] * LIMIT)
    with pytest.raises(QueueFull) as full:
        client.submit("one too many", lane="batch", idempotency_key="k1")
    assert (full.value.lane, full.value.queued, full.value.retry_after) == ("batch", LIMIT, 2)
    assert "retry after 2s" in str(full.value)
    assert client.redis.get(keys.idempotency("k1")) is None  # refused: nothing claimed

    client.submit("other lanes have room", lane="interactive")
    with pytest.raises(QueueFull) as full:
        client.submit_many([{"prompt": "w", "lane": "standard"}] * (LIMIT + 3))
    assert len(full.value.accepted) == LIMIT  # those were queued; the rest were not
    assert client.redis.xlen(keys.request_stream("standard")) == LIMIT

    # An entry a worker has taken no longer counts as waiting.
    ensure_groups(r, [keys.request_stream("batch")])
    r.xreadgroup(keys.GROUP, "w", {keys.request_stream("batch"): ">"}, count=1)
    client.submit("room again", lane="batch", idempotency_key="k2")
    with pytest.raises(QueueFull):
        client.submit("waits, then gives up", lane="batch", queue_timeout=0.3)
    # A resubmit with a known idempotency key returns the earlier job, full or not.
    again = client.submit("room again", lane="batch", idempotency_key="k2")
    assert again.id == r.get(keys.idempotency("k2")).decode()
    assert first[0].status() == "queued"

    async def use_async() -> None:
        async with AsyncClient(shared_redis_url, settings=client.settings) as aclient:
            with pytest.raises(QueueFull):
                await aclient.submit("async too", lane="batch")
            with pytest.raises(QueueFull) as afull:
                await aclient.submit_many([{"prompt": "a", "lane": "interactive"}] * LIMIT)
            assert len(afull.value.accepted) == LIMIT - 1

    asyncio.run(use_async())
    client.close()


def test_blocking_submit_waits_for_room(shared_redis_url, r):
    client = Client(shared_redis_url, settings=Settings(max_queued_per_lane=1))
    client.submit("fills the lane", lane="batch")
    ensure_groups(r, [keys.request_stream("batch")])

    def take_later() -> None:
        time.sleep(0.3)
        r.xreadgroup(keys.GROUP, "w", {keys.request_stream("batch"): ">"}, count=1)

    with ThreadPoolExecutor(1) as pool:
        taker = pool.submit(take_later)
        job = client.submit("waits for room", lane="batch", queue_timeout=60)
        taker.result()
    assert job.status() == "queued"


def test_concurrent_producers_never_overshoot(shared_redis_url, r):
    settings = Settings(max_queued_per_lane=50)

    def produce(_i: int) -> int:
        c = Client(shared_redis_url, settings=settings)
        ok = 0
        for _ in range(20):
            try:
                c.submit("race", lane="standard")
                ok += 1
            except QueueFull:
                pass
        c.close()
        return ok

    with ThreadPoolExecutor(8) as pool:
        accepted = sum(pool.map(produce, range(8)))
    assert accepted == 50
    assert r.xlen(keys.request_stream("standard")) == 50
