"""Submitting through the sync and async clients on a real redis-server: URLs, requests
checked before any is queued, refused submits (QueueFull, BadIdempotencyKey) that leave no
record and list the jobs queued all the same, and a connection lost midway.

A submit the lane refuses leaves no job record behind: QUEUED writes the record before
SUBMIT is refused, and the client deletes it. An idempotency key whose Redis key holds
something other than a job id is refused, not taken for the id of an earlier job."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest
import redis

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.broker_config.embedded import find_binary
from plurai.broker_config.settings import Settings
from plurai.producer import QueueFull, aio
from plurai.producer import client as sync_client
from plurai.producer.aio import AsyncClient
from plurai.producer.client import Client
from plurai.producer.errors import BadIdempotencyKey

LANES = ("interactive", "standard", "batch")


def queued(url: str) -> int:
    r = connect(url)
    try:
        return sum(r.xlen(keys.request_stream(lane, keys.DEFAULT_MODEL)) for lane in LANES)
    finally:
        r.close()


def test_a_unix_socket_url_reaches_redis(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    server = subprocess.Popen(
        [find_binary(), "--port", "0", "--unixsocket", str(sock), "--requirepass", "pw"]
        + ["--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        give_up = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < give_up:
            time.sleep(0.05)
        url = f"unix://:pw@{sock}?db=0"
        with Client(url) as client:
            job = client.submit("hello", max_tokens=2)
            assert job.status() == "queued"

        async def run() -> str:
            async with AsyncClient(url) as aclient:
                ajob = await aclient.submit("hello", max_tokens=2)
                return await ajob.status()

        assert asyncio.run(run()) == "queued"
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_submit_many_checks_every_request_before_queueing_any(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync_client, "_CHUNK", 2)
    monkeypatch.setattr(aio, "_CHUNK", 2)
    reqs = [{"prompt": f"doc {i}", "max_tokens": 2} for i in range(4)]
    reqs.append({"prompt": "bad", "lane": "nope"})
    with Client(redis_url) as client, pytest.raises(ValueError, match="unknown lane 'nope'"):
        client.submit_many(reqs)
    assert queued(redis_url) == 0

    async def run() -> None:
        async with AsyncClient(redis_url) as aclient:
            await aclient.submit_many(reqs)

    with pytest.raises(ValueError, match="unknown lane 'nope'"):
        asyncio.run(run())
    assert queued(redis_url) == 0
    # a value only the body's encoder refuses is found before anything is queued too
    # (submit_many builds the submissions while Redis runs the first ones)
    reqs[-1] = {"prompt": "bad", "metadata": {"tags": {"a", "b"}}}
    with Client(redis_url) as client, pytest.raises(TypeError):
        client.submit_many(reqs)
    assert queued(redis_url) == 0


def test_an_error_reply_in_submit_many_lists_the_jobs_queued(redis_url: str) -> None:
    r = connect(redis_url)
    r.set(keys.idempotency("held", keys.DEFAULT_MODEL), "not a job id!")
    reqs = [{"prompt": "a"}, {"prompt": "b", "idempotency_key": "held"}, {"prompt": "c"}]
    with Client(redis_url) as client:
        with pytest.raises(BadIdempotencyKey) as e:
            client.submit_many(reqs)
        accepted = e.value.accepted
        assert len(accepted) == 2 and queued(redis_url) == 2
        assert {j.status() for j in accepted} == {"queued"}

    async def run() -> list[str]:
        async with AsyncClient(redis_url) as aclient:
            with pytest.raises(BadIdempotencyKey) as e:
                await aclient.submit_many(reqs)
            return [await j.status() for j in e.value.accepted]

    assert asyncio.run(run()) == ["queued", "queued"]
    assert queued(redis_url) == 4


def test_submit_many_lists_the_jobs_queued_before_redis_failed(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync_client, "_CHUNK", 2)
    client = Client(redis_url)
    send = client.send
    calls: list[int] = []

    def lost(subs: list, before: list | None = None) -> list:
        calls.append(len(subs))
        if len(calls) == 2:
            raise redis.ConnectionError("Connection closed by server.")
        return send(subs, before)

    monkeypatch.setattr(client, "send", lost)
    with pytest.raises(redis.ConnectionError) as e:
        client.submit_many([{"prompt": f"doc {i}"} for i in range(4)])
    assert [j.status() for j in e.value.accepted] == ["queued", "queued"]
    client.close()


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


def test_a_submit_after_redis_lost_its_scripts_loads_them_and_queues_once(
    redis_url: str,
) -> None:
    client = Client(redis_url)
    client.submit("first")  # the scripts are loaded
    client.redis.script_flush()  # a restarted or failed-over Redis
    client.submit_many([{"prompt": "a"}, {"prompt": "b"}])

    async def use_async() -> None:
        async with AsyncClient(redis_url) as aclient:
            await aclient.submit("c")  # loaded by the sync client's retry
            await aclient.redis.script_flush()
            await aclient.submit("d")

    asyncio.run(use_async())
    assert client.redis.xlen(keys.request_stream("standard")) == 5
    assert states(client) == ["queued"] * 5
    client.close()
