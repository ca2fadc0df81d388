"""Token stream parsing and the restart-aware text follower."""

from __future__ import annotations

import pytest

from plurai.results import tokens, wait
from plurai.results.records import BadRecord, JobRecord


def ev(type_: str, text: str = "") -> tokens.Event:
    return tokens.Event(type=type_, text=text)


def test_follower_passes_deltas() -> None:
    f = tokens.TextFollower()
    assert [f.feed(e) for e in (ev("start"), ev("delta", "ab"), ev("delta", "c"), ev("end"))] == [
        "",
        "ab",
        "c",
        "",
    ]


def test_follower_skips_a_repeated_run_after_reset() -> None:
    f = tokens.TextFollower()
    out = [
        f.feed(e)
        for e in (
            ev("delta", "abc"),
            ev("reset"),
            ev("start"),
            ev("delta", "ab"),
            ev("delta", "cd"),
            ev("delta", "e"),
        )
    ]
    assert "".join(out) == "abcde"


def test_follower_raises_when_the_rerun_differs() -> None:
    f = tokens.TextFollower()
    f.feed(ev("delta", "abc"))
    f.feed(ev("reset"))
    with pytest.raises(tokens.JobRestarted):
        f.feed(ev("delta", "x"))


def test_parse_and_record() -> None:
    e = tokens.parse({b"type": b"delta", b"text": b"hi", b"token_ids": b"[1,2]"})
    assert (e.type, e.text, e.token_ids) == ("delta", "hi", [1, 2])
    rec = JobRecord.from_hash(
        "j",
        {
            b"state": b"completed",
            b"final": b"1",
            b"token_ids": b"[3]",
            b"output_tokens": b"1",
            b"metadata": b'{"a": 1}',
        },
    )
    assert (
        rec.final and rec.token_ids == [3] and rec.output_tokens == 1 and rec.metadata == {"a": 1}
    )
    assert JobRecord.from_hash("j", {}).state == "unknown"
    for bad in (b"[1,", b"[" * 5000):  # not JSON, or nested past the parser's depth
        with pytest.raises(BadRecord, match="token_ids is not JSON"):
            tokens.parse({b"type": b"delta", b"text": b"hi", b"token_ids": bad})


def test_reader_follows_ids_and_stops_at_end() -> None:
    reader = tokens.Reader("j")
    assert reader.request() == {"plurai:out:{j}": "0-0"}
    reply = [
        [
            b"plurai:out:{j}",
            [
                (b"1-0", {b"type": b"start"}),
                (b"2-0", {b"type": b"end", b"state": b"completed"}),
                (b"3-0", {b"type": b"delta", b"text": b"never"}),
            ],
        ]
    ]
    got = [e.type for e in reader.feed(reply)]
    assert got == ["start", "end"] and reader.ended and reader.last_id == b"2-0"
    resp3 = {"plurai:out:{j}": [("4-0", {"type": "delta", "text": "x"})]}
    assert [e.text for e in tokens.Reader("j").feed(resp3)] == ["x"]


def test_waiter_settles_by_record_or_message(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(wait.time, "monotonic", lambda: now[0])
    w = wait.Waiter([f"j{i}" for i in range(1500)], timeout=2.5)
    assert [len(c) for c in w.channels()] == [1000, 500]
    w.read([JobRecord(id=f"j{i}", state="completed", final=True) for i in range(1498)])
    assert w.unsettled() == ["j1498", "j1499"] and w.wait_s() == 1.0
    w.heard({"channel": b"plurai:done:j1498", "data": b"completed"})
    w.heard({"channel": b"plurai:done:other", "data": b"completed"})  # an earlier wait's
    now[0] += 0.4  # a wait that returned early (a confirmation consumed) is not quiet
    assert not w.quiet() and w.wait_s() == pytest.approx(0.6)
    now[0] += 1.6  # nothing for a second: read the records again
    assert w.unsettled() == ["j1499"] and w.quiet() and w.wait_s() == 0.0
    w.read([])
    assert not w.quiet() and w.wait_s() == pytest.approx(0.5)
    now[0] += 1.0
    assert w.wait_s() is None  # the time is up
    forever = wait.Waiter(["a"], timeout=None)
    assert forever.wait_s() == 1.0
    forever.heard({"channel": "plurai:done:a", "data": "failed"})
    assert forever.wait_s() is None


@pytest.mark.timeout(20)
def test_stream_of_a_final_job_whose_stream_expired_ends() -> None:
    """The token stream expires long before the record (PLURAI_OUTPUT_TTL_S 1 h, the result
    24 h): streaming such a job gives the record's text and ends, not a wait forever."""
    import asyncio

    import fakeredis
    import fakeredis.aioredis

    from plurai.broker_config import keys
    from plurai.producer import AsyncClient, Client
    from plurai.results import records

    done = {"state": "completed", "final": "1", "text": "hello", "finish_reason": "stop"}
    r = fakeredis.FakeRedis(decode_responses=True)
    r.hset(keys.job("expired01"), mapping=done)
    r.hset(keys.job("queued001"), mapping={"state": "queued"})
    client = Client(redis=r)
    assert list(client.job("expired01").stream(block_ms=10)) == ["hello"]
    got = list(tokens.events(r, "expired01", block_ms=10))
    assert [e.type for e in got] == ["reset", "delta", "end"] and got[-1].state == "completed"
    # not final: the stream may be yet to come, so the read goes on
    reader = tokens.Reader("queued001")
    assert list(reader.gone(records.get(r, "queued001"))) == [] and not reader.ended

    async def aio() -> list[str]:
        ar = fakeredis.aioredis.FakeRedis(decode_responses=True)
        await ar.hset(keys.job("expired01"), mapping=done)
        return [t async for t in AsyncClient(redis=ar).job("expired01").stream(block_ms=10)]

    assert asyncio.run(aio()) == ["hello"]


@pytest.mark.timeout(20)
def test_a_job_with_no_record_yet_is_waited_for() -> None:
    """A raw-protocol client queues an entry and writes no record (the worker writes it when
    it starts the job): a wait and a stream must go on until it comes, not end at the
    missing record; with a timeout, a job whose record never comes is a TimeoutError."""
    import asyncio
    import threading
    import time

    import fakeredis
    import fakeredis.aioredis

    from plurai.broker_config import keys
    from plurai.producer import AsyncClient, Client
    from plurai.results import records

    r = fakeredis.FakeRedis(decode_responses=True)
    done = {"state": "completed", "final": "1", "text": "hi", "finish_reason": "stop"}

    def worker() -> None:
        time.sleep(0.3)
        r.hset(keys.job("rawjob001"), mapping=done)

    threading.Thread(target=worker, daemon=True).start()
    client = Client(redis=r)
    assert client.job("rawjob001").result().text == "hi"
    assert list(client.job("rawjob001").stream(block_ms=10)) == ["hi"]
    with pytest.raises(TimeoutError, match="nosuchjob is unknown"):
        client.job("nosuchjob").result(timeout=0.2)
    assert client.wait_all(["nosuchjob"], timeout=0.2)[0].state == records.UNKNOWN

    async def aio() -> None:
        c = AsyncClient(redis=fakeredis.aioredis.FakeRedis(decode_responses=True))
        with pytest.raises(TimeoutError):
            await c.job("nosuchjob").result(timeout=0.2)

    asyncio.run(aio())


def test_a_record_key_of_another_type_is_a_bad_record_not_a_redis_error() -> None:
    """Something else wrote the job's record key (a string): the SDK says which key is
    damaged (BadRecord, code bad_record), not a raw WRONGTYPE. (The token stream's key:
    tests/integration/test_producer_client.py, since fakeredis's XREAD does not check.)"""
    import asyncio

    import fakeredis
    import fakeredis.aioredis

    from plurai.broker_config import keys
    from plurai.producer import AsyncClient, Client
    from plurai.results import records

    r = fakeredis.FakeRedis(decode_responses=True)
    r.set(keys.job("strjob001"), "oops")
    r.hset(keys.job("done00001"), mapping={"state": "completed", "final": "1", "text": "x"})
    client = Client(redis=r)
    for call in (
        lambda: client.job("strjob001").status(),
        lambda: client.job("strjob001").result(timeout=1),
        lambda: client.wait_all(["done00001", "strjob001"], timeout=1),
    ):
        with pytest.raises(records.BadRecord, match="job strjob001: its record key holds"):
            call()

    async def aio() -> None:
        ar = fakeredis.aioredis.FakeRedis(decode_responses=True)
        await ar.set(keys.job("strjob001"), "oops")
        with pytest.raises(records.BadRecord, match="its record key"):
            await AsyncClient(redis=ar).job("strjob001").result(timeout=1)

    asyncio.run(aio())
