"""A submit the lane refuses (QueueFull) leaves no job record behind: QUEUED writes the
record before SUBMIT is refused, and the client deletes it, on the sync and async paths,
for submit and submit_many. An idempotency key whose Redis key holds something other than
a job id is refused (BadIdempotencyKey), not taken for the id of an earlier job."""

from __future__ import annotations

import asyncio

import pytest

from broker_config import keys
from broker_config.settings import Settings
from producer import AsyncClient, Client, QueueFull
from producer.errors import BadIdempotencyKey


def states(client: Client) -> list[str]:
    return sorted(client.redis.hget(k, "state") for k in client.redis.scan_iter("plurai:job:*"))


def test_a_refused_submit_leaves_no_record(redis_url: str) -> None:
    settings = Settings(max_queued_per_lane=2)
    client = Client(redis_url, settings=settings)
    queued = client.submit_many([{"prompt": "x"}] * 2)
    with pytest.raises(QueueFull):
        client.submit("refused")
    with pytest.raises(QueueFull):
        client.submit("waits, then gives up", queue_timeout=0.2)
    with pytest.raises(QueueFull) as full:
        client.submit_many([{"prompt": "y", "lane": "batch"}] * 4)
    assert len(full.value.accepted) == 2

    async def use_async() -> None:
        async with AsyncClient(redis_url, settings=settings) as aclient:
            with pytest.raises(QueueFull):
                await aclient.submit("refused too")
            with pytest.raises(QueueFull):
                await aclient.submit_many([{"prompt": "z"}] * 3)

    asyncio.run(use_async())
    assert states(client) == ["queued"] * 4  # the jobs queued, nothing else
    assert {j.status() for j in queued + full.value.accepted} == {"queued"}
    client.close()


def test_an_idempotency_key_holding_no_job_id_is_refused(redis_url: str) -> None:
    client = Client(redis_url)
    client.redis.set(keys.idempotency("inv-1"), "not a job id {x}")
    with pytest.raises(BadIdempotencyKey, match="inv-1"):
        client.submit("x", idempotency_key="inv-1")

    async def use_async() -> None:
        async with AsyncClient(redis_url) as aclient:
            with pytest.raises(BadIdempotencyKey):
                await aclient.submit_many([{"prompt": "y", "idempotency_key": "inv-1"}])

    asyncio.run(use_async())
    assert client.redis.xlen(keys.request_stream("standard")) == 0 and states(client) == []
    client.redis.set(keys.idempotency("inv-2"), "Earlier-job_0001")  # a job id: still the owner
    assert client.submit("z", idempotency_key="inv-2").id == "Earlier-job_0001"
    client.close()
