"""The SDK against a real worker: submit, status, result, stream, cancel, idempotency,
many results at once, the asyncio twin; and a worker's SIGTERM hand-back."""

from __future__ import annotations

import asyncio
import signal

import pytest
import redis

from plurai.broker_config import keys, stats
from plurai.producer import AsyncClient, Client, JobCancelled, JobFailed
from plurai.results import records, tokens

from .faults import drained


def wait_running(client: Client, job) -> None:
    for ev in tokens.events(client.redis, job.id, block_ms=60000):
        if ev.type == tokens.DELTA:
            return
    raise AssertionError("job ended before it produced a token")


def test_client_calls(redis_url, workers):
    client = Client(redis_url)
    queued = client.submit("cancel me before any worker runs", max_tokens=4)
    assert queued.status() == records.QUEUED
    assert queued.cancel() == records.CANCELLED
    workers.start(1)

    job = client.submit("a river stone", max_tokens=8, lane="interactive", metadata={"k": 1})
    text = "".join(job.stream())
    rec = job.result(timeout=60)
    assert rec.state == records.COMPLETED and job.status() == records.COMPLETED
    assert rec.text == text and rec.output_tokens == 8 and rec.finish_reason == "length"
    assert rec.metadata == {"k": 1}

    again = client.submit("a river stone", max_tokens=8, idempotency_key="once")
    same = client.submit("something else", max_tokens=8, idempotency_key="once")
    assert same.id == again.id
    assert again.result(timeout=60).text == rec.text  # greedy: the same request, the same text

    with pytest.raises(JobFailed) as failed:
        client.submit("x", max_tokens=8, top_p=7.0).result(timeout=60)
    assert failed.value.code == "invalid_params" and "top_p" in failed.value.message

    long = client.submit("keep going", max_tokens=4000, ignore_eos=True)
    wait_running(client, long)
    assert long.cancel() == "cancelling"
    with pytest.raises(JobCancelled):
        long.result(timeout=60)
    cancelled = long.record()
    assert cancelled.finish_reason == "abort" and 0 < cancelled.output_tokens < 4000

    with pytest.raises(JobCancelled):
        queued.result(timeout=5)  # its entry was acked by the worker without running it
    r = redis.Redis.from_url(redis_url)
    assert drained(r)

    many = client.submit_many([{"prompt": f"doc {i}", "max_tokens": 3} for i in range(30)])
    recs = client.wait_all(many, timeout=120)
    assert [x.state for x in recs] == [records.COMPLETED] * 30
    assert client.records([j.id for j in many]) == recs

    async def use_async() -> None:
        async with AsyncClient(redis_url) as aclient:
            ajob = await aclient.submit("a river stone", max_tokens=8)
            streamed = "".join([t async for t in ajob.stream()])
            arec = await ajob.result(timeout=60)
            assert streamed == arec.text == rec.text
            ajobs = await aclient.submit_many([{"prompt": "q", "max_tokens": 2}] * 5)
            assert {x.state for x in await aclient.wait_all(ajobs, 60)} == {records.COMPLETED}
            along = await aclient.submit("on and on", max_tokens=4000, ignore_eos=True)
            async for _ in along.stream():
                break
            assert await along.cancel() == "cancelling"
            with pytest.raises(JobCancelled):
                await along.result(timeout=60)

    asyncio.run(use_async())
    client.close()


def test_sigterm_hands_running_jobs_back(redis_url, workers):
    client = Client(redis_url)
    (first,) = workers.start(1, "--grace", "0")
    job = client.submit("a long one", max_tokens=2500, ignore_eos=True, lane="batch")
    wait_running(client, job)
    r = redis.Redis.from_url(redis_url)
    stream = keys.request_stream("batch")
    (entry_id, _), *_ = r.xrange(stream)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0

    assert job.status() == records.QUEUED
    # the same entry, in its place in the lane, waits for the next worker: no attempt counted
    (pending,) = r.xpending_range(stream, keys.GROUP, "-", "+", 10)
    assert pending["message_id"] == entry_id and pending["consumer"] == keys.HANDED_OVER.encode()
    assert pending["times_delivered"] == 0 and r.xlen(stream) == 1
    assert stats.lane(r, "batch", stats.redis_now_ms(r), keys.DEFAULT_MODEL).waiting == 1

    workers.start(1)
    text = "".join(job.stream())
    rec = job.result(timeout=120)
    assert rec.output_tokens == 2500 and rec.text == text
    types = [f[b"type"] for _, f in r.xrange(keys.output(job.id))]
    # the second worker resumed it where the first stopped: its stream goes on, no reset
    assert types.count(b"start") == 2 and types.count(b"reset") == 0 and types[-1] == b"end"


def test_a_token_stream_key_of_another_type_is_a_bad_record(redis_url):
    """A job whose token stream key holds a list (written by something else): stream()
    raises BadRecord naming the key, not a raw WRONGTYPE; sync and asyncio."""
    r = redis.Redis.from_url(redis_url)
    r.hset(keys.job("listout01"), mapping={"state": "running"})
    r.rpush(keys.output("listout01"), "x")
    with pytest.raises(records.BadRecord, match="job listout01: its token stream key holds"):
        list(Client(redis_url).job("listout01").stream(block_ms=10))

    async def aio() -> None:
        async with AsyncClient(redis_url) as c:
            with pytest.raises(records.BadRecord, match="its token stream key"):
                async for _ in c.job("listout01").stream(block_ms=10):
                    pass

    asyncio.run(aio())


def test_bytes_that_are_not_utf8_in_a_record_or_stream_are_a_bad_record(redis_url):
    """A record or token stream holding bytes that are not UTF-8 (not written by a worker):
    BadRecord naming the job, not a UnicodeDecodeError; the client reads on after it."""
    r = redis.Redis.from_url(redis_url)
    r.hset(keys.job("badutf001"), mapping={"state": "completed", "final": "1", "text": b"a\xff"})
    r.hset(keys.job("badutf002"), mapping={"state": "running"})
    r.xadd(keys.output("badutf002"), {"type": "delta", "text": b"\xfe", "token_ids": "[1]"})
    r.hset(keys.job("good00001"), mapping={"state": "completed", "final": "1", "text": "ok"})
    client = Client(redis_url)
    with pytest.raises(records.BadRecord, match="job badutf001: its record holds bytes"):
        client.job("badutf001").result()
    with pytest.raises(records.BadRecord, match="job badutf002: its token stream holds bytes"):
        list(client.job("badutf002").stream(block_ms=10))
    assert client.job("good00001").result().text == "ok"

    async def aio() -> str | None:
        async with AsyncClient(redis_url) as c:
            with pytest.raises(records.BadRecord, match="its record holds bytes"):
                await c.job("badutf001").result()
            return (await c.job("good00001").result()).text

    assert asyncio.run(aio()) == "ok"
