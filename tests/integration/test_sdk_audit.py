"""SDK and CLI under odd input, URLs and partial failures, on a real redis-server."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest
import redis

import producer.aio
import producer.client
from broker_config import keys
from broker_config.connection import connect
from broker_config.embedded import find_binary
from producer.aio import AsyncClient
from producer.client import Client
from producer.errors import BadIdempotencyKey

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
    monkeypatch.setattr(producer.client, "_CHUNK", 2)
    monkeypatch.setattr(producer.aio, "_CHUNK", 2)
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
    monkeypatch.setattr(producer.client, "_CHUNK", 2)
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
