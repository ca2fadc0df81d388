"""The gateway's shared token-stream reader (gateway/streams.py) against a real
redis-server, and the SSE response that releases what a stream holds (gateway/app.py): a
stream followed while the reader waits is picked up at once, even before the reader's
first XREAD has reached Redis; a damaged entry or a failing reader never leaves a follower
waiting forever; a response whose client left before its body started still runs its
close."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis
import redis.asyncio

from plurai.broker_config import keys
from plurai.gateway import sse, streams
from plurai.results import records, tokens


def run(coro, timeout: float = 20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def started(s: streams.Streams, job_id: str):
    """A follower of `job_id`, already waiting for its first event."""
    it = s.batches(job_id)
    first = asyncio.ensure_future(anext(it))
    await asyncio.sleep(0.05)
    return it, first


def test_a_stream_followed_before_the_first_xread_lands_is_picked_up(redis_url) -> None:
    async def go():
        r = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)  # as the gateway's
        s = streams.Streams(r)
        xread = r.xread

        async def late_xread(*a, **kw):  # the XREAD reaches Redis late (a new connection)
            await asyncio.sleep(0.3)
            return await xread(*a, **kw)

        r.xread = late_xread
        try:
            _, _a = await started(s, "job-a-idle")  # the reader starts, to block on a
            assert s.blocked
            b, b_first = await started(s, "job-b-busy")  # its wake-up lands first
            await r.xadd(keys.output("job-b-busy"), {"type": tokens.START})
            t0 = time.monotonic()
            (ev,) = await asyncio.wait_for(b_first, 2)  # not after a whole BLOCK_MS
            assert ev.type == tokens.START and time.monotonic() - t0 < 2
            await b.aclose()
        finally:
            await s.close()
            await r.aclose()

    run(go())


def test_a_damaged_entry_fails_its_stream_and_the_reader_goes_on(redis_url) -> None:
    async def go():
        r = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)  # as the gateway's
        s = streams.Streams(r)
        try:
            bad, bad_first = await started(s, "job-damaged")
            good, good_first = await started(s, "job-good")
            await r.xadd(keys.output("job-damaged"), {"type": "delta", "token_ids": "[1,"})
            with pytest.raises(ValueError):
                await asyncio.wait_for(bad_first, 2)
            await r.xadd(keys.output("job-good"), {"type": tokens.END, "state": "completed"})
            assert (await asyncio.wait_for(good_first, 2))[0].type == tokens.END
            await good.aclose()
            assert not s.followed
        finally:
            await s.close()
            await r.aclose()

    run(go())


def test_a_deeply_nested_entry_fails_only_its_own_stream(redis_url) -> None:
    async def go():
        r = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)  # as the gateway's
        s = streams.Streams(r)
        try:
            bad, bad_first = await started(s, "job-nested")
            good, good_first = await started(s, "job-good")
            deep = "[" * 100_000  # json.loads: RecursionError, which parse makes a BadRecord
            await r.xadd(keys.output("job-nested"), {"type": "delta", "token_ids": deep})
            with pytest.raises(records.BadRecord, match="token_ids is not JSON"):
                await asyncio.wait_for(bad_first, 2)
            await r.xadd(keys.output("job-good"), {"type": tokens.END, "state": "completed"})
            assert (await asyncio.wait_for(good_first, 2))[0].type == tokens.END
            await good.aclose()
        finally:
            await s.close()
            await r.aclose()

    run(go())


def test_a_reader_error_reaches_every_follower_and_nothing_spins_after(
    redis_url, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(streams, "BLOCK_MS", 100)
    # unlogged: formatting the traceback trips CPython 3.11.7's ast (gh-106905) in pytest
    caplog.set_level(logging.CRITICAL, logger="plurai.gateway")

    async def go():
        r = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)  # as the gateway's
        s = streams.Streams(r)
        xread = r.xread
        calls = []

        async def failing_xread(*a, **kw):
            calls.append(a)
            if len(calls) == 1:  # while both streams are followed
                await asyncio.sleep(0.2)
                raise RuntimeError("a bug")
            return await xread(*a, **kw)

        r.xread = failing_xread
        try:
            followers = [await started(s, f"job-{i}-xxxx") for i in range(2)]
            for _, first in followers:
                with pytest.raises(RuntimeError):
                    await asyncio.wait_for(first, 2)
            assert not s.followed
            await asyncio.sleep(0.5)  # every follower left: the reader waits for one
            before = len(calls)
            await asyncio.sleep(0.5)
            assert len(calls) == before
            it, first = await started(s, "job-later")  # and serves the next at once
            await r.xadd(keys.output("job-later"), {"type": tokens.START})
            assert (await asyncio.wait_for(first, 2))[0].type == tokens.START
            await it.aclose()
        finally:
            await s.close()
            await r.aclose()

    run(go())


def test_an_event_stream_whose_client_left_before_it_started_still_closes() -> None:
    async def go():
        began, closed = [], []

        async def body():
            began.append(True)
            yield b"data: x\n\n"

        async def close(complete: bool) -> None:
            closed.append(complete)

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            await asyncio.sleep(0)

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await sse.EventStream(body(), close)(scope, receive, send)
        assert closed == [False] and not began

        sent = []

        async def receive_nothing():
            await asyncio.sleep(10)

        async def record(message):
            sent.append(message)

        await sse.EventStream(body(), close)(scope, receive_nothing, record)
        assert closed == [False, True] and sent[-1]["more_body"] is False

    run(go())


def test_a_client_that_leaves_while_a_read_holds_its_cancel_is_still_let_go() -> None:
    """The client leaves while the read of its first token holds the cancel for longer
    than `unless_gone` waits (redis-py finishing a command): closing the reader must not
    fail the request ("asynchronous generator is already running": a 500, and the job not
    cancelled); the reader's own cleanup runs once the read returns."""

    async def go():
        cleaned = []

        async def batches():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await asyncio.sleep(1.5)  # the read finishes its command first
                raise
            finally:
                cleaned.append(True)
            yield []

        class Left:
            async def receive(self):
                return {"type": "http.disconnect"}

        gen = batches()
        with pytest.raises(sse.Gone):
            await sse.unless_gone(Left(), sse.head(gen, tokens.TextFollower()))  # type: ignore[arg-type]
        await sse.close_reader(gen)
        assert not cleaned  # still in the read
        await asyncio.sleep(1)
        assert cleaned

    run(go())


def test_redis_errors_reach_followers_after_the_outage_window(redis_url, monkeypatch) -> None:
    monkeypatch.setattr(streams, "OUTAGE_S", 0.6)

    async def go():
        r = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)  # as the gateway's
        s = streams.Streams(r)

        async def broken(*a, **kw):
            raise redis.ConnectionError("gone")

        r.xread = broken
        try:
            _, first = await started(s, "job-redis-down")
            t0 = time.monotonic()
            with pytest.raises(redis.ConnectionError):
                await asyncio.wait_for(first, 3)
            assert time.monotonic() - t0 >= 0.4  # retried through the window first
        finally:
            await s.close()
            await r.aclose()

    run(go())


def test_a_redis_blip_loses_no_token(redis_url) -> None:
    """Reads that fail for a moment are retried from the same positions: the follower gets
    every event once, in order, and no error."""

    async def go():
        r = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)  # as the gateway's
        s = streams.Streams(r)
        xread, failures = r.xread, [2]

        async def flaky(*a, **kw):
            if failures[0]:
                failures[0] -= 1
                raise redis.TimeoutError("Timeout reading from socket")
            return await xread(*a, **kw)

        key = keys.output("job-blip")
        await r.xadd(key, {"type": tokens.START})
        await r.xadd(key, {"type": tokens.DELTA, "text": "hello", "token_ids": "[5]"})
        r.xread = flaky
        try:
            it = s.batches("job-blip")
            got = list(await asyncio.wait_for(anext(it), 5))
            await r.xadd(key, {"type": tokens.END, "state": records.COMPLETED})
            async for batch in it:
                got += batch
            assert [e.type for e in got] == [tokens.START, tokens.DELTA, tokens.END]
            assert got[1].text == "hello" and failures == [0]
        finally:
            await s.close()
            await r.aclose()

    run(go())


def test_entries_read_together_come_as_one_batch(redis_url) -> None:
    async def go():
        r = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)  # as the gateway's
        s = streams.Streams(r)
        try:
            it, first = await started(s, "job-batched")
            pipe = r.pipeline(transaction=True)  # lands at once: one XREAD reads it all
            key = keys.output("job-batched")
            pipe.xadd(key, {"type": tokens.DELTA, "text": "a", "token_ids": "[1]"})
            pipe.xadd(key, {"type": tokens.DELTA, "text": "b", "token_ids": "[2]"})
            pipe.xadd(key, {"type": tokens.END, "state": "completed", "finish_reason": "stop"})
            await pipe.execute()
            batch = await asyncio.wait_for(first, 2)
            assert [(e.type, e.text) for e in batch] == [
                (tokens.DELTA, "a"),
                (tokens.DELTA, "b"),
                (tokens.END, ""),
            ]
            assert await anext(it, None) is None  # the end closes it
            assert not s.followed
        finally:
            await s.close()
            await r.aclose()

    run(go())


def test_a_stream_that_cannot_be_read_fails_only_itself(redis_url) -> None:
    """The gateway's connection decodes replies: bytes that are not UTF-8 in one stream's
    entry, or a stream key of another type, fail that stream (BadRecord), not every stream
    read with it."""

    async def go():
        r = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        raw = redis.asyncio.Redis.from_url(redis_url)
        s = streams.Streams(r)
        try:
            good, good_first = await started(s, "job-good")
            bad, bad_first = await started(s, "job-not-utf8")
            await raw.set(keys.output("job-wrong-type"), "x")
            wrong, wrong_first = await started(s, "job-wrong-type")
            pipe = raw.pipeline(transaction=True)  # one XREAD reads both
            pipe.xadd(keys.output("job-not-utf8"), {"type": "delta", "text": b"\xff\xfe"})
            pipe.xadd(keys.output("job-good"), {"type": tokens.END, "state": "completed"})
            await pipe.execute()
            for first in (bad_first, wrong_first):
                with pytest.raises(records.BadRecord):
                    await asyncio.wait_for(first, 2)
            assert (await asyncio.wait_for(good_first, 2))[0].type == tokens.END
            await good.aclose()
            assert not s.followed
        finally:
            await s.close()
            await r.aclose()
            await raw.aclose()

    run(go())
