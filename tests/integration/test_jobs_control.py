"""The typed calls of results/jobs.py that act on a job once it is queued or taken, against
a real redis-server: cancel, release and requeue, renew, check; then the batch calls and the
loading of a script Redis lost. Each named parameter lands where its script reads it (the
record, the token stream, the request stream, the channels, the TTLs). Submit, begin,
deltas and finalize: tests/integration/test_jobs.py, whose helpers these tests share.

A test or two per typed call, in the order of results/jobs.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
import redis.asyncio

from plurai.broker_config import keys
from plurai.broker_config.settings import Settings
from plurai.results import jobs, records

from .test_jobs import (
    LANE,
    begin,
    finalize,
    message,
    r_fixture,  # noqa: F401 - the `r` fixture
    stream,
    submit,
    take,
)


def test_cancel(r):
    submit(r, "queued")
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.CANCEL_CHANNEL)
    call = jobs.cancel(job_id="queued", ttl_s=600, stream_ttl_s=60, now_ms=4321)
    assert jobs.run(r, call) == "cancelled"
    rec = records.get(r, "queued")
    assert (rec.state, rec.finish_reason, rec.finished_ms, rec.final) == (
        "cancelled",
        "abort",
        4321,
        True,
    )
    assert 590 < r.ttl(keys.job("queued")) <= 600
    assert 50 < r.ttl(keys.output("queued")) <= 60  # the stream's TTL, not the record's
    assert stream(r, "queued")[-1] == {
        "type": "end",
        "state": "cancelled",
        "finish_reason": "abort",
    }
    assert jobs.run(r, call) == "cancelled"  # the final state it has
    submit(r, "running")
    begin(r, "running")
    assert (
        jobs.run(r, jobs.cancel(job_id="running", ttl_s=600, stream_ttl_s=60, now_ms=1))
        == "cancelling"
    )
    msg = message(pubsub)
    assert (msg["channel"], msg["data"]) == (keys.CANCEL_CHANNEL, "running")
    pubsub.close()


def test_the_sdks_cancel_gives_the_token_stream_the_output_ttl(r, redis_url):
    from plurai.producer.aio import AsyncClient
    from plurai.producer.client import Client

    settings = Settings(result_ttl_s=5000, output_ttl_s=300)
    with Client(redis_url, settings=settings) as client:
        job = client.submit("hello", max_tokens=4)
        assert job.cancel() == "cancelled"
    assert 4990 < r.ttl(keys.job(job.id)) <= 5000
    assert 290 < r.ttl(keys.output(job.id)) <= 300  # as a finished job's stream

    async def cancel_async() -> str:
        async with AsyncClient(redis_url, settings=settings) as client:
            job = await client.submit("hello", max_tokens=4)
            assert await job.cancel() == "cancelled"
            return job.id

    job_id = asyncio.run(cancel_async())
    assert 290 < r.ttl(keys.output(job_id)) <= 300


def test_requeue(r):
    submit(r, "j1")
    entry_id = take(r)
    begin(r, "j1")
    fields = {b"v": b"1", b"id": b"j1", b"attempts": b"2"}
    stream_key = keys.request_stream(LANE)
    assert jobs.run(r, jobs.release(job_id="j1")) == 1
    call = jobs.requeue(stream=stream_key, entry_id=entry_id, maxlen=100, again=True, fields=fields)
    assert jobs.run(r, call) == 1
    ((new_id, entry),) = r.xrange(stream_key)
    assert new_id != entry_id and entry == {"v": "1", "id": "j1", "attempts": "2"}
    rec = records.get(r, "j1")
    assert rec.state == "queued" and rec.worker is None and rec.started_ms is None
    assert r.xpending(stream_key, keys.GROUP)["pending"] == 0
    # the same call again, as a client library resends it after losing the reply: the old
    # entry is acked already, so nothing more is queued
    assert jobs.run(r, call) == 0
    assert [i for i, _ in r.xrange(stream_key)] == [new_id]
    # a Redis at maxmemory refuses the re-add before anything is acked: still pending
    entry_id = take(r)
    again = jobs.requeue(
        stream=stream_key, entry_id=entry_id, maxlen=100, again=True, fields=fields
    )
    r.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.ResponseError, match="OOM"):
            jobs.run(r, again)
    finally:
        r.config_set("maxmemory", 0)
    assert r.xpending(stream_key, keys.GROUP)["pending"] == 1
    assert jobs.run(r, again) == 1
    assert r.xpending(stream_key, keys.GROUP)["pending"] == 0 and r.xlen(stream_key) == 1
    # a job with a result is not re-added: its entry is only acked
    entry_id = take(r)
    begin(r, "j1")
    assert finalize(r, "j1", entry_id) == 1
    assert jobs.run(r, jobs.release(job_id="j1")) == 0
    r.delete(keys.job("str"))
    r.set(keys.job("str"), "x")  # the next worker reports bad_record: re-added
    assert jobs.run(r, jobs.release(job_id="str")) == 1


def test_renew_reports_entries_another_consumer_took(r):
    submit(r, "a")
    submit(r, "b")
    mine, taken = take(r, "w1"), take(r, "w1")
    r.xclaim(keys.request_stream(LANE), keys.GROUP, "w2", 0, [taken])
    call = jobs.renew(stream=keys.request_stream(LANE), consumer="w1", entry_ids=[mine, taken])
    assert jobs.run(r, call) == [taken]


def test_check(r):
    submit(r, "run")
    submit(r, "asked")
    jobs.run(r, jobs.cancel(job_id="asked", ttl_s=60, stream_ttl_s=60, now_ms=1))
    r.set(keys.job("str"), "x")
    assert jobs.run(r, jobs.check(job_ids=["run", "asked", "str"])) == [0, 1, 2]


def test_batch_calls(r):
    assert jobs.run(r, jobs.batch_gen(batch_id="b1")) is None  # no record: none created
    assert not r.exists(keys.batch("b1"))
    r.hset(keys.batch("b1"), mapping={"status": "in_progress"})
    assert jobs.run(r, jobs.batch_gen(batch_id="b1")) == 1
    line = jobs.batch_line(
        batch_id="b1",
        index=3,
        line='{"x":1}',
        ok=True,
        prompt_tokens=5,
        output_tokens=7,
        now_ms=11,
        ttl_s=100,
    )
    assert jobs.run(r, line) == 1 and jobs.run(r, line) == 0  # once
    meta = r.hgetall(keys.batch("b1"))
    assert (meta["completed"], meta["prompt_tokens"], meta["output_tokens"]) == ("1", "5", "7")
    assert meta["beat_ms"] == "11" and r.hget(keys.batch_lines("b1"), "3") == '{"x":1}'
    assert 90 < r.ttl(keys.batch_lines("b1")) <= 100
    move = jobs.batch_move(batch_id="b1", status="cancelling", allowed=["validating"])
    assert jobs.run(r, move) == "in_progress"  # not allowed: unchanged
    move = jobs.batch_move(batch_id="b1", status="cancelling", allowed=["in_progress"])
    assert jobs.run(r, move) == "cancelling"
    assert jobs.run(r, jobs.batch_move(batch_id="none", status="x", allowed=[])) is None


def test_run_loads_a_script_redis_lost(r, redis_url):
    r.script_flush()
    assert submit(r, "j1") == "j1"
    assert r.script_exists(jobs.sha("ENQUEUE")) == [True]
    r.script_flush()

    async def run_async() -> None:
        ar = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        try:
            call = jobs.check(job_ids=["j1"])
            assert await jobs.run_async(ar, call) == [0]
            r.script_flush()
            await jobs.load_async(ar, "CHECK")
            assert await ar.execute_command(*call.command()) == [0]
        finally:
            await ar.aclose()

    asyncio.run(run_async())
    r.script_flush()
    jobs.load(r, "BEGIN")
    assert r.script_exists(jobs.sha("BEGIN"), jobs.sha("SUBMIT")) == [True, False]
    assert json.loads(r.hget(keys.job("j1"), "metadata")) == {"m": 1}
