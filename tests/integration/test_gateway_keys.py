"""API keys at the gateway: two gateway processes share one key's requests/min quota (the
11th request within the minute gets 429 from either), a revoked key gets 401 at once, a
key's lanes hold, a job belongs to its key's tenant, and a gateway without keys serves no
one beyond localhost."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from plurai.broker_config import keys
from plurai.broker_config.routes import registry_value
from plurai.gateway import apikeys
from plurai.results import records, wait

from .test_gateway import Gateway


@pytest.fixture(scope="module")
def served(module_redis_url, tiny_model, tmp_path_factory, workers_class) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("logs")
    r = redis.Redis.from_url(module_redis_url)
    limited, _ = apikeys.create_key(r, "acme", rpm=10)
    batch_only, _ = apikeys.create_key(r, "bulkco", lanes=["batch"], default_lane="batch")
    w = workers_class(module_redis_url, tiny_model, logs)
    w.start(1)
    gateways = [Gateway(module_redis_url, logs / f"gateway-{i}.log") for i in range(2)]
    yield {
        "r": r,
        "gateways": gateways,
        "limited": limited,
        "batch_only": batch_only,
        "model": tiny_model.name,
    }
    for g in gateways:
        g.stop()
    w.stop()


def ask(gateway: Gateway, model: str, key: str | None, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": "hi", "max_tokens": 2, **extra}
    return httpx.post(gateway.base + "/v1/completions", json=body, headers=headers, timeout=60)


def test_a_key_is_required_once_keys_exist(served) -> None:
    g, model = served["gateways"][0], served["model"]
    for key in (None, "pk-not-a-real-key-at-all-aaaaaaaaaaaaaaaaaaaaaaaa", "sk-other"):
        resp = ask(g, model, key)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    resp = httpx.get(g.base + "/v1/models", timeout=10)
    assert resp.status_code == 401


def test_requests_per_minute_across_two_gateways(served) -> None:
    gateways, model, key = served["gateways"], served["model"], served["limited"]
    codes = [ask(gateways[i % 2], model, key).status_code for i in range(10)]
    assert codes == [200] * 10
    for g in gateways:  # the 11th, from either process
        resp = ask(g, model, key)
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(resp.headers["Retry-After"]) >= 1


def test_lanes_and_tenant_of_a_key(served) -> None:
    g, model, key = served["gateways"][1], served["model"], served["batch_only"]
    resp = ask(g, model, key)
    assert resp.status_code == 200
    job_id = resp.json()["id"].split("-", 1)[1]
    rec = records.get(served["r"], job_id)
    assert rec.lane == "batch" and rec.tenant == "bulkco"  # the key's
    resp = ask(g, model, key, lane="interactive")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "lane_not_allowed"
    # nor can a client name another tenant: the field is not one the API takes
    resp = ask(g, model, key, tenant="acme")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tenant"


def test_revoked_key_gets_401_at_once(served) -> None:
    g, model, key = served["gateways"][0], served["model"], served["batch_only"]
    assert ask(g, model, key).status_code == 200
    assert apikeys.revoke(served["r"], apikeys.key_id(apikeys.hash_secret(key)))
    for other in served["gateways"]:
        assert ask(other, model, key).status_code == 401


def test_no_keys_beyond_localhost_serves_no_one(redis_url, tmp_path) -> None:
    g = Gateway(redis_url, tmp_path / "gateway.log", host="0.0.0.0")
    try:
        resp = ask(g, "any", None)
        assert resp.status_code == 401
        assert "plurai keys create" in resp.json()["error"]["message"]
        assert "every request is refused" in (tmp_path / "gateway.log").read_text()
    finally:
        g.stop()


def slot_freed(r: redis.Redis, running: str) -> None:
    """Wait (10 s at most) until the key's concurrency slots are all given back."""
    give_up = time.monotonic() + 10
    while r.zcard(running):
        assert time.monotonic() < give_up, "the slot is still held"
        time.sleep(0.05)


def serve_idle(r: redis.Redis) -> None:
    """The model directory's entry of a worker that heartbeats but takes nothing (its beat
    a minute ahead: live for the whole test)."""
    r.hset(keys.MODELS, "idle", registry_value(1, int(time.time() * 1000) + 60_000))


def test_leaving_before_the_first_token_cancels_the_job_and_frees_its_slot(
    redis_url, tmp_path
) -> None:
    """A stream's client that leaves while its job waits in the queue (a worker that
    heartbeats but takes nothing): the job is cancelled and the key's concurrency slot
    freed at once, and a first token that comes later changes nothing."""
    r = redis.Redis.from_url(redis_url)
    serve_idle(r)
    secret, key = apikeys.create_key(r, "acme", concurrent=1)
    g = Gateway(redis_url, tmp_path / "gateway.log")
    try:
        body = json.dumps({"model": "idle", "prompt": "hi", "max_tokens": 2, "stream": True})
        s = socket.create_connection(("127.0.0.1", g.port))
        s.sendall(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {secret}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        running = keys.quota_running(key.id)
        give_up = time.monotonic() + 30
        while not r.zcard(running):  # admitted: the job is queued, holding the slot
            assert time.monotonic() < give_up
            time.sleep(0.05)
        (job_id,) = (m.decode() for m in r.zrange(running, 0, -1))
        time.sleep(0.3)  # the gateway waits for the first token
        s.close()
        rec = wait.wait(r, job_id, timeout=10)
        assert rec.state == records.CANCELLED
        r.xadd(keys.output(job_id), {"type": "delta", "text": "late"})  # too late
        slot_freed(r, running)
    finally:
        g.stop()


def test_a_background_job_whose_client_left_keeps_its_slot_until_it_ends(
    redis_url, tmp_path
) -> None:
    """`background: true`, and the client leaves: the job runs on (not cancelled) and
    still counts against the key's concurrent limit, so leaving is no way around it; the
    slot comes back once the job has ended. Streamed and not."""
    r = redis.Redis.from_url(redis_url)
    serve_idle(r)
    secret, key = apikeys.create_key(r, "acme", concurrent=1)
    running = keys.quota_running(key.id)
    g = Gateway(redis_url, tmp_path / "gateway.log")
    try:
        for stream in (True, False):
            body = {"model": "idle", "prompt": "hi", "max_tokens": 2, "background": True}
            raw = json.dumps({**body, "stream": stream})
            s = socket.create_connection(("127.0.0.1", g.port))
            s.sendall(
                (
                    f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: Bearer {secret}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(raw)}\r\n\r\n{raw}"
                ).encode()
            )
            give_up = time.monotonic() + 30
            while not r.zcard(running):  # admitted: the job is queued, holding the slot
                assert time.monotonic() < give_up
                time.sleep(0.05)
            (job_id,) = (m.decode() for m in r.zrange(running, 0, -1))
            time.sleep(0.3)
            s.close()
            time.sleep(1.5)  # the gateway has seen the client leave
            assert records.get(r, job_id).state == records.QUEUED  # not cancelled
            assert r.zcard(running) == 1
            refused = ask(g, "idle", secret)
            assert refused.status_code == 429
            assert refused.json()["error"]["param"] == "concurrent"
            # the job ends (as its worker would write it): the slot comes back
            r.hset(keys.job(job_id), mapping={"state": "completed", "final": "1", "text": "x"})
            slot_freed(r, running)
    finally:
        g.stop()
