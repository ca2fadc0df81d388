"""Gateway quotas in a real redis-server (the QUOTA_ADMIT script): exact counts under concurrent
callers in two processes, a sliding minute, tokens, concurrent jobs and their leases,
revocation at once, damaged records, and no secret in Redis or in logs."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio

from plurai.broker_config import keys
from plurai.broker_config.settings import Settings
from plurai.gateway import apikeys, keys_cli, lease, quota

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = Settings(lanes=["interactive", "standard", "batch"], default_lane="standard")


@pytest.fixture
def url(module_redis_url: str) -> Iterator[str]:
    r = redis.Redis.from_url(module_redis_url)
    r.flushall()
    r.script_flush()
    yield module_redis_url
    r.close()


def run(url: str, fn, *args, decode: bool = False, **kw):
    """fn(async client, *args) in a fresh event loop."""

    async def go():
        r = redis.asyncio.Redis.from_url(url, decode_responses=decode)
        try:
            return await fn(r, *args, **kw)
        finally:
            await r.aclose()

    return asyncio.run(go())


def new_key(url: str, **limits) -> tuple[str, apikeys.Key]:
    with redis.Redis.from_url(url) as r:
        return apikeys.create_key(r, "acme", settings=SETTINGS, **limits)


def job(i: int | str) -> str:
    return f"test-job-{i}"


# Each process authenticates, says it is ready, waits for the go, then admits 10 requests at
# once on 10 connections.
CHILD = r"""
import asyncio, json, sys
import redis.asyncio
from plurai.gateway import apikeys, quota

url, secret, tag = sys.argv[1:4]

async def main():
    r = redis.asyncio.Redis.from_url(url)
    key = await apikeys.authenticate(r, secret)
    assert key is not None
    await r.rpush("test:ready", tag)
    assert await r.blpop(["test:go"], timeout=60)
    got = await asyncio.gather(*(quota.admit(r, key, 7, f"{tag}-job-{i:04d}") for i in range(10)))
    print(json.dumps([[v.admitted, v.limit, v.retry_after_s] for v in got]))
    await r.aclose()

asyncio.run(main())
"""


def test_rpm_is_exact_across_two_processes(url):
    secret, key = new_key(url, rpm=10)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, url, secret, tag],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for tag in ("p1", "p2")
    ]
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + 60
    while r.llen("test:ready") < 2:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r.rpush("test:go", 1, 1)
    verdicts = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
        verdicts += json.loads(out)
    admitted = [v for v in verdicts if v[0]]
    refused = [v for v in verdicts if not v[0]]
    assert len(admitted) == 10 and len(refused) == 10
    assert all(v[1] == "rpm" and 0 < v[2] <= 60 for v in refused)
    assert r.zcard(keys.quota_window(key.id)) == 10
    assert int(r.get(keys.quota_tokens(key.id))) == 70
    # the 11th from a third client, within the minute: refused too
    eleventh = run(url, quota.admit, key, 1, job("p3"))
    assert not eleventh.admitted and eleventh.limit == "rpm" and eleventh.retry_after >= 1
    r.close()


def test_refusals_count_nothing_and_retries_count_once(url):
    _, key = new_key(url, rpm=3, tpm=100)
    r = redis.Redis.from_url(url)

    async def go(ar):
        v1 = await quota.admit(ar, key, 30, job(1))
        assert v1.admitted and v1.remaining_requests == 2 and v1.remaining_tokens == 70
        again = await quota.admit(ar, key, 30, job(1))  # the same admission, retried
        assert again.admitted and again.remaining_requests == 2
        assert (await quota.admit(ar, key, 80, job(2))).limit == "tpm"
        assert (await quota.admit(ar, key, 80, job(2))).limit == "tpm"
        assert (await quota.admit(ar, key, 70, job(3))).admitted
        assert (await quota.admit(ar, key, 0, job(4))).admitted
        refused = await quota.admit(ar, key, 0, job(5))
        assert refused.limit == "rpm" and refused.remaining_requests == 0

    run(url, go)
    assert r.zcard(keys.quota_window(key.id)) == 3
    assert int(r.get(keys.quota_tokens(key.id))) == 100
    assert 0 < r.pttl(keys.quota_window(key.id)) <= quota.WINDOW_MS
    r.close()


def test_tokens_per_minute(url):
    _, key = new_key(url, tpm=100)

    async def go(ar):
        first = await quota.admit(ar, key, 60, job(1))
        assert first.admitted and first.remaining_tokens == 40 and first.remaining_requests is None
        over = await quota.admit(ar, key, 50, job(2))
        assert not over.admitted and over.limit == "tpm" and 0 < over.retry_after_s <= 60
        assert over.remaining_tokens == 40
        assert (await quota.admit(ar, key, 40, job(3))).remaining_tokens == 0
        assert (await quota.admit(ar, key, 1, job(4))).limit == "tpm"
        huge = await quota.admit(ar, key, 101, job(5))  # can never fit
        assert huge.limit == "tpm" and "more than the key's 100 tokens" in huge.message

    run(url, go)


def test_the_minute_slides(url, monkeypatch):
    window = 2.0  # each step below keeps about half of it to spare, for a loaded machine
    monkeypatch.setattr(quota, "WINDOW_MS", int(window * 1000))
    _, key = new_key(url, rpm=2, tpm=10)

    async def go(ar):
        async def admit(tokens: int, i: int) -> tuple[quota.Verdict, float, float]:
            """The verdict, and the wall-clock times (Redis' clock) it was asked within."""
            asked = time.time()
            verdict = await quota.admit(ar, key, tokens, job(i))
            return verdict, asked, time.time()

        assert (await admit(4, 1))[0].admitted
        await asyncio.sleep(window / 2)
        second, _, second_by = await admit(4, 2)
        assert second.admitted
        refused = (await admit(1, 3))[0]
        # the first admission leaves the window half a window after the second: the wait
        assert refused.limit == "rpm" and 0 < refused.retry_after_s <= window / 2
        await asyncio.sleep(refused.retry_after_s + 0.05)
        fourth, fourth_asked, fourth_by = await admit(4, 4)
        assert fourth.admitted  # job 1 left the window
        assert (await admit(1, 5))[0].limit == "rpm"  # job 2 has not yet
        await asyncio.sleep(second_by + window + 0.05 - time.time())  # now it has
        # only job 4 (4 tokens) is left: 7 more are too many until it leaves as well
        tpm, asked, answered = await admit(7, 6)
        assert tpm.limit == "tpm"
        ms = 0.002  # Redis' clock counts whole ms
        assert fourth_asked + window - answered - ms <= tpm.retry_after_s  # when job 4 leaves
        assert tpm.retry_after_s <= fourth_by + window - asked + ms
        assert (await quota.admit(ar, key, 6, job(7))).admitted

    run(url, go)


def test_concurrent_jobs_release_and_renew(url):
    _, key = new_key(url, concurrent=2)
    r = redis.Redis.from_url(url)

    async def go(ar):
        assert (await quota.admit(ar, key, 10, job("a"))).admitted
        assert (await quota.admit(ar, key, 10, job("b"))).admitted
        full = await quota.admit(ar, key, 10, job("c"))
        assert full.limit == "concurrent" and 0 < full.retry_after_s <= 1
        assert r.zcard(keys.quota_running(key.id)) == 2  # the refusal took no slot
        assert await quota.release(ar, key, job("a"))
        assert not await quota.release(ar, key, job("a"))
        assert (await quota.admit(ar, key, 10, job("c"))).admitted
        assert await quota.renew(ar, key, job("b"), 120)
        assert not await quota.renew(ar, key, job("a"), 120)  # released: no slot to renew
        assert r.zscore(keys.quota_running(key.id), job("a")) is None
        assert r.pttl(keys.quota_running(key.id)) > 60_000  # the longest lease keeps the set

    run(url, go)
    r.close()


def test_leases_expire_unless_renewed(url):
    _, key = new_key(url, concurrent=1)

    async def go(ar):
        assert (await quota.admit(ar, key, 1, job("crashed"), lease_s=0.6)).admitted
        assert (await quota.admit(ar, key, 1, job("next"), lease_s=0.6)).limit == "concurrent"
        await asyncio.sleep(0.7)  # its gateway died: the lease ends, the slot is free again
        assert (await quota.admit(ar, key, 1, job("next"), lease_s=0.6)).admitted
        assert not await quota.renew(ar, key, job("crashed"), 10)
        assert await quota.renew(ar, key, job("next"), 10)
        await asyncio.sleep(0.4)
        assert (await quota.admit(ar, key, 1, job("third"))).limit == "concurrent"  # renewed
        assert await quota.release(ar, key, job("next"))
        assert (await quota.admit(ar, key, 1, job("third"))).admitted

    run(url, go)


def test_revoked_key_is_refused_at_once(url):
    secret, key = new_key(url, rpm=5, concurrent=1)
    r = redis.Redis.from_url(url)

    async def use(ar):
        assert await apikeys.authenticate(ar, secret) == key
        assert (await quota.admit(ar, key, 1, job(1))).admitted

    run(url, use)
    assert apikeys.revoke(r, key.id)
    assert run(url, apikeys.authenticate, secret) is None
    assert run(url, apikeys.authenticate, secret, decode=True) is None
    assert r.keys("*") == []  # record, index entry and counters all gone
    assert not apikeys.any_keys(r)
    r.close()


def test_damaged_records_and_counters(url, caplog):
    secret, key = new_key(url, rpm=2, tpm=50, concurrent=1)
    h = apikeys.hash_secret(secret)
    r = redis.Redis.from_url(url)
    with caplog.at_level(logging.DEBUG):
        r.hset(keys.api_key(h), "lanes", "")
        assert run(url, apikeys.authenticate, secret) is None
        r.hset(keys.api_key(h), mapping={"lanes": "standard", "tpm": b"\xff"})
        assert run(url, apikeys.authenticate, secret) is None
        assert run(url, apikeys.authenticate, secret, decode=True) is None
        r.delete(keys.api_key(h))
        r.rpush(keys.api_key(h), "x")
        assert run(url, apikeys.authenticate, secret) is None
        r.delete(keys.api_key(h))
        assert run(url, apikeys.authenticate, secret) is None  # unknown: nothing logged
        # counters of the wrong type, or a wrong total, are reset, not fatal
        r.set(keys.quota_window(key.id), "x")
        r.hset(keys.quota_running(key.id), "a", "b")
        r.set(keys.quota_tokens(key.id), "many")
        assert run(url, quota.admit, key, 10, job(1)).admitted
        assert int(r.get(keys.quota_tokens(key.id))) == 10
        assert run(url, quota.release, key, job(1))
        r.set(keys.quota_tokens(key.id), "-5")  # recounted from the window
        assert run(url, quota.admit, key, 10, job(2)).remaining_tokens == 30
    assert caplog.text.count("treated as unknown") == 4
    assert secret not in caplog.text and h not in caplog.text
    r.close()


def test_scripts_reload_after_a_flush(url):
    _, key = new_key(url, rpm=5, concurrent=1)
    r = redis.Redis.from_url(url)
    assert run(url, quota.admit, key, 1, job(1)).admitted
    r.script_flush()  # e.g. a restarted or failed-over Redis
    assert run(url, quota.renew, key, job(1), 5)
    r.script_flush()
    assert not run(url, quota.admit, key, 1, job(2)).admitted
    r.close()


def cli(url: str, *argv: str, capsys) -> tuple[int, str, str]:
    p = argparse.ArgumentParser(prog="plurai keys")
    keys_cli.add_arguments(p)
    code = keys_cli.main(p.parse_args([*argv, "--url", url]))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_and_no_secret_anywhere(url, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    code, out, err = cli(
        url,
        "create",
        "--tenant",
        "acme",
        "--lanes",
        "interactive,standard",
        "--rpm",
        "3",
        "--concurrent",
        "2",
        capsys=capsys,
    )
    assert code == 0
    secret = out.strip()
    assert apikeys._SECRET.fullmatch(secret) and secret not in err
    h = apikeys.hash_secret(secret)
    kid = h[:12]
    assert f"created key {kid} for tenant acme" in err

    code, out, err = cli(url, "create", "--tenant", "globex", "--lanes", "gold", capsys=capsys)
    assert code == 2 and "unknown lane" in err and out == ""
    code, out, err = cli(url, "create", "--tenant", "bad:name", capsys=capsys)
    assert code == 2 and "tenant" in err

    key = run(url, apikeys.authenticate, secret)
    assert key.lanes == ("interactive", "standard") and key.rpm == 3 and key.concurrent == 2

    async def use(ar):
        assert (await quota.admit(ar, key, 12, job(1))).admitted
        assert await quota.renew(ar, key, job(1), 30)
        assert (await quota.admit(ar, key, 12, job(2))).admitted
        assert await quota.release(ar, key, job(2))

    run(url, use)

    code, out, err = cli(url, "list", capsys=capsys)
    assert code == 0 and kid in out and "acme" in out and "interactive,standard" in out
    code, listed, _ = cli(url, "list", "--json", capsys=capsys)
    assert json.loads(listed)[0] == {
        "id": kid,
        "tenant": "acme",
        "lanes": ["interactive", "standard"],
        "default_lane": "standard",
        "rpm": 3,
        "tpm": 0,
        "concurrent": 2,
        "created_ms": key.created_ms,
        "admin": False,
    }
    for text in (out, listed):
        assert secret not in text and h not in text

    # nowhere in Redis: no key name, no value (the hash names the record, nothing more)
    r = redis.Redis.from_url(url)
    dump = []
    for name in r.scan_iter("*"):
        kind = r.type(name).decode()
        value = {
            "string": r.get,
            "hash": r.hgetall,
            "zset": lambda n: r.zrange(n, 0, -1, withscores=True),
            "list": lambda n: r.lrange(n, 0, -1),
            "set": r.smembers,
        }[kind](name)
        dump.append(repr((name, value)))
    blob = "\n".join(dump)
    assert keys.api_key(h) in blob
    assert secret not in blob and secret[3:] not in blob and secret[3:20] not in blob
    assert secret not in caplog.text

    code, out, err = cli(url, "revoke", kid, capsys=capsys)
    assert code == 0 and f"revoked key {kid}" in err
    assert run(url, apikeys.authenticate, secret) is None
    code, out, err = cli(url, "revoke", kid, capsys=capsys)
    assert code == 1 and "no key" in err
    code, out, err = cli(url, "list", "--json", capsys=capsys)
    assert json.loads(out) == []
    r.close()


def test_cli_reports_an_unreachable_redis(capsys):
    code, out, err = cli("redis://:hunter2@127.0.0.1:1/0", "list", capsys=capsys)
    assert code == 1 and "Redis error" in err and "hunter2" not in err


def test_cli_empty_lanes_are_refused_not_all_lanes(url, capsys):
    """`--lanes "$LANES"` with LANES unset must not make a key of every lane."""
    for lanes in ("", " , "):
        code, out, err = cli(url, "create", "--tenant", "acme", "--lanes", lanes, capsys=capsys)
        assert code == 2 and "lanes" in err and out == ""
    with redis.Redis.from_url(url) as r:
        assert not apikeys.any_keys(r)


def test_a_slot_whose_admission_reply_was_lost_is_given_back(url) -> None:
    """QUOTA_ADMIT ran, but its reply was lost to a Redis error: the request ends (503),
    and its close gives the slot back rather than locking a concurrent=1 key out for a
    lease."""
    _, key = new_key(url, concurrent=1)
    running = keys.quota_running(key.id)

    async def go():
        ar = redis.asyncio.Redis.from_url(url, decode_responses=True)
        evalsha = ar.evalsha

        async def lost(*a, **kw):
            await evalsha(*a, **kw)
            raise redis.ConnectionError("connection reset")

        ar.evalsha = lost
        try:
            held = lease.Lease(ar, key, "job-reply-lost")
            with pytest.raises(redis.ConnectionError):
                await held.admit(10)
            assert await ar.zcard(running) == 1  # the script ran
            await held.close()
            assert await ar.zcard(running) == 0
        finally:
            await ar.aclose()

    asyncio.run(go())


def test_cli_makes_and_lists_admin_keys(url, capsys):
    code, out, err = cli(url, "create", "--tenant", "ops", "--admin", capsys=capsys)
    assert code == 0 and ", admin." in err
    key = run(url, apikeys.authenticate, out.strip())
    assert key.admin and key.tenant == "ops"
    code, out, err = cli(url, "create", "--tenant", "acme", capsys=capsys)
    assert code == 0 and "admin" not in err
    code, listed, _ = cli(url, "list", "--json", capsys=capsys)
    assert {k["tenant"]: k["admin"] for k in json.loads(listed)} == {"ops": True, "acme": False}
    code, out, _ = cli(url, "list", capsys=capsys)
    rows = {line.split()[1]: line.split()[7] for line in out.splitlines()[1:]}
    assert rows == {"ops": "yes", "acme": "-"}
