"""Concurrent submits on one AsyncClient (a gateway's burst of requests) go to Redis
together, in a few pipelines on one connection, and each call still gets its own jobs or
its own refusal; the readings a burst needs first (the model directory, whether API keys
exist) are read once for all of it."""

from __future__ import annotations

import asyncio

from redis import Redis, RedisError

from plurai.broker_config import keys
from plurai.broker_config.settings import Settings
from plurai.producer import AsyncClient, QueueFull
from plurai.producer.errors import NotReplicated


def test_a_burst_of_submits_shares_round_trips_and_a_connection(shared_redis_url, r):
    async def burst() -> list[str]:
        async with AsyncClient(shared_redis_url) as client:
            await client.submit("warm: scripts loaded, routes read")
            opened = int(r.info("stats")["total_connections_received"])
            jobs = await asyncio.gather(
                *(client.submit(f"request {i}", lane="interactive") for i in range(300))
            )
            # one submit at a time in flight: a connection each would be ~300 here
            assert int(r.info("stats")["total_connections_received"]) - opened <= 3
            return [j.id for j in jobs]

    ids = asyncio.run(burst())
    assert len(set(ids)) == 300
    queued = r.xrange(keys.request_stream("interactive"))
    assert len(queued) == 300  # every one queued, in the order the calls were made
    for i, (_, fields) in enumerate(queued):
        assert r.hget(keys.job(ids[i]), "state") == b"queued"
        assert fields  # an entry of its own


def test_a_burst_that_finds_the_routes_stale_reads_them_once(shared_redis_url, r):
    async def burst() -> None:
        async with AsyncClient(shared_redis_url) as client:
            await client.submit("warm: scripts loaded, routes read")
            client.routes._read_at -= 60  # the reading has aged past REFRESH_S
            before = int(r.info("commandstats")["cmdstat_hgetall"]["calls"])
            opened = int(r.info("stats")["total_connections_received"])
            await asyncio.gather(
                *(client.submit(f"request {i}", lane="interactive") for i in range(300))
            )
            assert int(r.info("commandstats")["cmdstat_hgetall"]["calls"]) - before == 1
            assert int(r.info("stats")["total_connections_received"]) - opened <= 3

    asyncio.run(burst())
    assert r.xlen(keys.request_stream("interactive")) == 300


def test_a_call_refused_in_a_shared_pipeline_leaves_the_others_queued(shared_redis_url, r):
    limit = 5
    settings = Settings(max_queued_per_lane=limit, queue_full_retry_s=2)

    async def burst() -> list[object]:
        async with AsyncClient(shared_redis_url, settings=settings) as client:
            await client.submit("warm", lane="standard")
            calls = [client.submit(f"b{i}", lane="batch") for i in range(2 * limit)]
            calls += [client.submit("other lane", lane="interactive")]
            return await asyncio.gather(*calls, return_exceptions=True)

    out = asyncio.run(burst())
    queued, refused = out[: 2 * limit], out[-1:]
    full = [x for x in queued if isinstance(x, QueueFull)]
    assert len(full) == limit and len(queued) - len(full) == limit
    assert all(f.accepted == [] for f in full)  # each refusal is its own call's alone
    assert not isinstance(refused[0], BaseException)  # the other lane's call is queued
    assert r.xlen(keys.request_stream("batch")) == limit
    assert r.xlen(keys.request_stream("interactive")) == 1


def test_redis_down_fails_every_waiting_call(redis_url):

    async def burst() -> list[object]:
        async with AsyncClient(redis_url) as client:
            await client.submit("warm")
            Redis.from_url(redis_url).shutdown(nosave=True)
            calls = [client.submit(f"x{i}") for i in range(20)]
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)

    out = asyncio.run(burst())
    assert all(isinstance(x, RedisError) for x in out)  # none hangs, none is a job


def test_calls_sharing_a_pipeline_share_its_one_wait_for_replicas(shared_redis_url, r):
    # no replica: each WAIT waits its whole timeout, so one a call would add up per call
    settings = Settings(submit_replicas=1, submit_replicas_timeout_ms=200)

    def waits() -> int:
        return int(r.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))

    async def burst() -> list[object]:
        async with AsyncClient(shared_redis_url, settings=settings) as client:
            await asyncio.gather(client.submit("warm"), return_exceptions=True)
            before = waits()
            out = await asyncio.gather(
                *(client.submit(f"r{i}") for i in range(20)), return_exceptions=True
            )
            assert waits() - before <= 2  # one per pipeline, not one per call
            return out

    out = asyncio.run(burst())
    assert all(isinstance(x, NotReplicated) for x in out)  # every call learns it
    assert r.xlen(keys.request_stream("standard")) == 21  # queued all the same


def test_a_gateways_burst_reads_whether_keys_exist_once(shared_redis_url, r):
    """The gateway reads whether API keys exist at most once a second: a burst that finds
    that reading old waits for one read, not one each."""
    from starlette.requests import Request

    from plurai.gateway import auth
    from plurai.gateway.app import Gateway

    async def burst() -> None:
        gw = Gateway(Settings(redis_url=shared_redis_url), shared_redis_url)
        gw.client = AsyncClient(shared_redis_url)
        gw.guard = auth.Guard(gw.client.redis, "127.0.0.1")  # as its lifespan sets it
        try:
            scope = {"type": "http", "headers": [], "method": "POST", "path": "/"}
            before = int(r.info("commandstats").get("cmdstat_exists", {"calls": 0})["calls"])
            keys_found = await asyncio.gather(*(gw.authorize(Request(scope)) for _ in range(200)))
            assert keys_found == [None] * 200  # an open gateway on loopback: no key needed
            after = int(r.info("commandstats")["cmdstat_exists"]["calls"])
            assert after - before == 1
        finally:
            await gw.client.aclose()

    asyncio.run(burst())
