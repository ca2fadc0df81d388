"""The gateway's keys, quotas and worker list under damaged Redis content and faults
(Starlette's test client against a real redis-server; heartbeats written by hand)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio
from starlette.testclient import TestClient

from broker_config import keys
from broker_config.settings import Settings
from gateway import app, auth
from gateway.serve import create_app


def beat(r: redis.Redis, worker: bytes, **fields) -> None:
    r.sadd(keys.WORKERS, worker)
    name = keys.worker("").encode() + worker
    now = int(time.time() * 1000)
    base = {"model": "m", "max_model_len": 256, "state": "serving", "beat_ms": now}
    r.hset(name, mapping={**base, "served_model": "m", **fields})


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url)
    beat(r, b"w1")
    yield r
    r.close()


@pytest.fixture
def api(redis_url: str, r: redis.Redis) -> Iterator[TestClient]:
    app = create_app(Settings(redis_url=redis_url), redis_url)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_models_skip_heartbeats_that_are_not_utf8(api, r) -> None:
    """A heartbeat (or a worker id) holding bytes that are not UTF-8 is no worker's: the
    others' models are listed and served, never a 500 for every request."""
    beat(r, b"w2", model=b"m2\xff", served_model=b"m2\xff")
    beat(r, b"w3\xfe", model="m3", served_model="m3")
    resp = api.get("/v1/models")
    assert resp.status_code == 200, resp.text
    assert [m["id"] for m in resp.json()["data"]] == ["m"]
    body = {"model": "nope", "prompt": "hi", "max_tokens": 2}
    resp = api.post("/v1/completions", json=body)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_a_slot_whose_admission_reply_was_lost_is_given_back(redis_url, r) -> None:
    """ADMIT ran, but its reply was lost to a Redis error: the request ends (503), and its
    close gives the slot back rather than locking a concurrent=1 key out for a lease."""
    _, key = auth.create_key(r, "acme", concurrent=1)
    running = keys.quota_running(key.id)

    async def go():
        ar = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        evalsha = ar.evalsha

        async def lost(*a, **kw):
            await evalsha(*a, **kw)
            raise redis.ConnectionError("connection reset")

        ar.evalsha = lost
        try:
            lease = app.Lease(ar, key, "job-reply-lost")
            with pytest.raises(redis.ConnectionError):
                await lease.admit(10)
            assert await ar.zcard(running) == 1  # the script ran
            await lease.close()
            assert await ar.zcard(running) == 0
        finally:
            await ar.aclose()

    asyncio.run(go())
