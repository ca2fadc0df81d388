"""A key's tokens per minute give back what a job did not generate, in a real redis-server:
the REFUND script (once per admission, only while the admission is in the window), and
through a gateway process whose stand-in worker answers 8 tokens of any max_tokens, for
whole answers, streams and a client that leaves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
import redis.asyncio

from plurai.broker_config import keys
from plurai.broker_config.embedded import EmbeddedRedis
from plurai.gateway import apikeys, quota

from .fake_stack import TOKENS, FakeWorker, GatewayProcess


def _run(url: str, fn, *args):
    async def go():
        r = redis.asyncio.Redis.from_url(url)
        try:
            return await fn(r, *args)
        finally:
            await r.aclose()

    return asyncio.run(go())


def _key(url: str, **limits) -> tuple[str, apikeys.Key]:
    with redis.Redis.from_url(url) as r:
        return apikeys.create_key(r, "acme", **limits)


def test_refund_gives_back_once_within_the_window(redis_url: str) -> None:
    _, key = _key(redis_url, tpm=150)

    async def go(r):
        assert (await quota.admit(r, key, 100, "job-aaaaaaaa")).admitted
        refused = await quota.admit(r, key, 100, "job-bbbbbbbb")
        assert not refused.admitted and refused.limit == "tpm"
        assert await quota.refund(r, key, "job-aaaaaaaa", 100, 60) == 60
        assert await quota.refund(r, key, "job-aaaaaaaa", 100, 60) == 0  # once only
        assert await quota.refund(r, key, "job-unknown1", 100, 60) == 0
        took = await quota.admit(r, key, 100, "job-bbbbbbbb")  # 40 + 100 fit in 150
        assert took.admitted and took.remaining_tokens == 10
        assert int(await r.get(keys.quota_tokens(key.id))) == 140
        # the window's own count agrees: after the counter is lost, it is summed again
        await r.delete(keys.quota_tokens(key.id))
        assert (await quota.admit(r, key, 10, "job-cccccccc")).remaining_tokens == 0

    _run(redis_url, go)


def test_refund_is_nothing_once_the_admission_left_the_window(redis_url, monkeypatch) -> None:
    _, key = _key(redis_url, tpm=150)
    monkeypatch.setattr(quota, "WINDOW_MS", 300)

    async def go(r):
        assert (await quota.admit(r, key, 100, "job-aaaaaaaa")).admitted
        await asyncio.sleep(0.4)
        assert await quota.refund(r, key, "job-aaaaaaaa", 100, 60) == 0

    _run(redis_url, go)


def test_refund_never_gives_back_more_than_was_counted(redis_url: str) -> None:
    _, key = _key(redis_url, tpm=150)

    async def go(r):
        assert (await quota.admit(r, key, 50, "job-aaaaaaaa")).admitted
        assert await quota.refund(r, key, "job-aaaaaaaa", 50, 500) == 50
        assert int(await r.get(keys.quota_tokens(key.id))) == 0

    _run(redis_url, go)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[tuple[str, GatewayProcess, str]]:
    d = tmp_path_factory.mktemp("refund")
    server = EmbeddedRedis(d / "redis")
    url = server.start()
    worker = FakeWorker(url).start()
    # each request below counts 1 (the prompt "hi") + 150 tokens: two fit in 310 only if
    # the first gives back what its job did not generate
    secret, _ = _key(url, tpm=310)
    gw = GatewayProcess(url, d / "gateway.log")
    yield url, gw, secret
    gw.stop()
    worker.stop()
    server.stop()


def _used(url: str) -> int:
    with redis.Redis.from_url(url) as r:
        (kid,) = [k.decode() for k in r.hkeys(keys.API_KEYS)]
        return int(r.get(keys.quota_tokens(kid)) or 0)


def _until_used(url: str, want: int) -> None:
    give_up = time.monotonic() + 10
    while _used(url) != want:
        assert time.monotonic() < give_up, f"tokens counted: {_used(url)}, not {want}"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_the_gateway_gives_back_what_a_job_did_not_generate(stack, stream: bool) -> None:
    url, gw, secret = stack
    with redis.Redis.from_url(url) as r:
        (kid,) = [k.decode() for k in r.hkeys(keys.API_KEYS)]
        r.delete(*keys.quota_all(kid))
    api = httpx.Client(base_url=gw.base, headers={"Authorization": f"Bearer {secret}"}, timeout=30)
    body = {"model": "flood", "prompt": "hi", "max_tokens": 150, "stream": stream}
    first = api.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    _until_used(url, 1 + TOKENS)  # 150 counted, 150 - 8 given back
    second = api.post("/v1/completions", json=body)
    assert second.status_code == 200, second.text
    _until_used(url, 2 * (1 + TOKENS))
    # without the refunds the third would be refused (3 x 151 > 310); a fourth asking
    # more than what is left is
    assert api.post("/v1/completions", json=body).status_code == 200
    _until_used(url, 3 * (1 + TOKENS))
    over = api.post("/v1/completions", json={**body, "max_tokens": 310 - 3 * (1 + TOKENS)})
    assert over.status_code == 429 and over.json()["error"]["param"] == "tpm"
