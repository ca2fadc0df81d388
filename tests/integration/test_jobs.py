"""Every typed call of results/jobs.py against a real redis-server: each named parameter
lands where its script reads it (the record, the token stream, the request stream, the
dead-letter stream, the channels, the TTLs).

One file, though long: a test or two per typed call, in the order of results/jobs.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis
import redis.asyncio

from plurai.broker_config import keys
from plurai.broker_config.groups import ensure_groups
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.writer import Writer
from plurai.results import jobs, records, tokens

LANE = "standard"


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def submit(
    r: redis.Redis, job_id: str, split: bool = False, received_us: int | None = None, **over
) -> str:
    """As the SDK sends a submit: ENQUEUE on one Redis; with `split` (a Cluster), QUEUED then
    SUBMIT, the record written for nothing deleted. `received_us`: as the gateway marks it."""
    named = dict(
        lane=LANE,
        model=keys.DEFAULT_MODEL,
        shard=0,
        job_id=job_id,
        fields=["v", "1", "id", job_id, "body", "x"],
        created_ms=1234,
        priority=-3,
        metadata_json='{"m":1}',
        stream_maxlen=1000,
        queued_ttl_s=500,
        idempotency_ttl_s=700,
        max_queued=0,
    )
    sub = jobs.submit(**{**named, **over})
    if received_us is not None:
        sub.received(received_us)
    if not split:
        return jobs.run(r, sub.whole)
    record = jobs.run(r, sub.record)
    try:
        reply = jobs.run(r, sub.queue)
    except redis.ResponseError as e:
        reply = e
    drop = sub.cleanup(record, reply)
    if drop is not None:
        r.execute_command(*drop)
    if isinstance(reply, Exception):
        raise reply
    return reply


SUBMIT = dict(
    lane=LANE,
    model=keys.DEFAULT_MODEL,
    shard=0,
    job_id="",
    fields=["v", "2"],
    created_ms=1,
    priority=0,
    metadata_json=None,
    stream_maxlen=1000,
    queued_ttl_s=500,
    idempotency_ttl_s=700,
    max_queued=0,
)


def take(r: redis.Redis, consumer: str = "w1") -> str:
    """The oldest waiting entry of LANE, read by `consumer`: its entry id."""
    ensure_groups(r, [keys.request_stream(LANE)])
    got = r.xreadgroup(keys.GROUP, consumer, {keys.request_stream(LANE): ">"}, count=1)
    return got[0][1][0][0]


def begin(r: redis.Redis, job_id: str, **over) -> str:
    named = dict(
        job_id=job_id,
        worker="w1",
        now_ms=int(time.time() * 1000),
        ttl_s=900,
        deadline_ms=None,
        lane=LANE,
        priority=-3,
        metadata_json=None,
    )
    return jobs.run(r, jobs.begin(**{**named, **over}))


def finalize(r: redis.Redis, job_id: str, entry_id: str, **over) -> int:
    """FINALIZE, then what its reply makes due (as the worker's writer does); with
    `ack_inside=True`, the script acks the entry itself (a single Redis)."""
    named = dict(
        job_id=job_id,
        lane=LANE,
        entry=(keys.request_stream(LANE), entry_id),
        state=records.COMPLETED,
        finish_reason="length",
        fields=records.final_fields(
            text="hello", token_ids=[7, 8], prompt_tokens=3, worker="w1", finished_ms=99
        ),
        ttl_s=800,
        stream_ttl_s=300,
        stream_maxlen=100,
    )
    writer = Writer(r, Settings(dead_letter_maxlen=50), "w1")
    call = jobs.finalize(**{**named, **over})
    reply = jobs.run(r, call)
    writer.replied(call, reply)
    writer.execute(writer.acks)
    return reply


def message(pubsub) -> dict:
    """The next published message (past the subscribe confirmations)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=0.5)
        if msg is not None:
            return msg
    raise AssertionError("no message")


def stream(r: redis.Redis, job_id: str) -> list[dict[str, str]]:
    return [f for _, f in r.xrange(keys.output(job_id))]


@pytest.mark.parametrize("split", [False, True], ids=["enqueue", "queued-submit"])
def test_submit(r, split):
    arrivals = r.pubsub(ignore_subscribe_messages=True)
    arrivals.subscribe(keys.arrivals(keys.DEFAULT_MODEL))
    before = time.time_ns() // 1000
    assert submit(r, "j1", split, idempotency_key="k", received_us=before - 5) == "j1"
    ((_, entry),) = r.xrange(keys.request_stream(LANE))
    assert entry == {"v": "1", "id": "j1", "body": "x"}
    # the entry announced to busy workers: its stream on the model's arrivals channel
    msgs = [arrivals.get_message(timeout=1) for _ in range(3)]  # the first: the subscribe
    assert [m["data"] for m in msgs if m] == [keys.request_stream(LANE)]
    arrivals.close()
    rec = records.get(r, "j1")
    assert (rec.state, rec.lane, rec.priority, rec.created_ms) == ("queued", LANE, -3, 1234)
    assert rec.hops_us["received_us"] == before - 5
    assert before <= rec.hops_us["queued_us"] <= time.time_ns() // 1000
    assert r.hget(keys.job("j1"), "model") == keys.DEFAULT_MODEL
    assert rec.metadata == {"m": 1} and 490 < r.ttl(keys.job("j1")) <= 500
    assert r.get(keys.idempotency("k")) == "j1" and 690 < r.ttl(keys.idempotency("k")) <= 700
    assert submit(r, "j2", split, idempotency_key="k") == "j1"  # the earlier job; nothing added
    assert r.xlen(keys.request_stream(LANE)) == 1 and not r.exists(keys.job("j2"))
    submit(r, "j3", split, metadata_json=None)
    assert records.get(r, "j3").metadata is None
    fields = ["state", "lane", "priority", "created_ms", "model", "queued_us"]
    assert r.hkeys(keys.job("j3")) == fields
    with pytest.raises(redis.ResponseError, match="QUEUEFULL 2"):
        submit(r, "j4", split, max_queued=2)
    assert not r.exists(keys.job("j4"))  # refused: no record left behind
    assert r.xlen(keys.request_stream(LANE)) == 2
    take(r)  # a taken entry no longer waits
    assert submit(r, "j4", split, max_queued=2) == "j4"
    if split:
        # a worker that took the entry first (on a Cluster the two calls may cross): QUEUED
        # leaves its record alone
        r.delete(keys.job("j4"))
        begin(r, "j4")
        assert jobs.run(r, jobs.submit(**{**SUBMIT, "job_id": "j4"}).record) == 0
        rec = records.get(r, "j4")  # still running; what BEGIN does not write is filled in
        assert (rec.state, rec.created_ms) == ("running", 1)
        assert r.hget(keys.job("j4"), "model") == keys.DEFAULT_MODEL


def test_enqueue_queues_a_job_whose_record_key_has_another_type(r):
    """As on a Cluster, where QUEUED fails alone: the job is queued all the same, the key
    is left as it is, and the worker that takes the job reports bad_record."""
    r.set(keys.job("j1"), "not a hash")
    assert submit(r, "j1") == "j1"
    assert r.xlen(keys.request_stream(LANE)) == 1
    assert r.get(keys.job("j1")) == "not a hash" and r.ttl(keys.job("j1")) == -1
    assert begin(r, "j1") == "badkey"


def test_enqueue_writes_the_entry_and_record_of_queued_and_submit(r):
    """A worker of today reads the same entry whichever way it was queued."""
    for split, job_id in ((True, "split-1"), (False, "whole-1")):
        submit(r, job_id, split, fields=["v", "2", "id", job_id, "priority", "-3", "body", "x"])
    (_, a), (_, b) = r.xrange(keys.request_stream(LANE))
    assert a == {**b, "id": "split-1"}
    ra, rb = r.hgetall(keys.job("split-1")), r.hgetall(keys.job("whole-1"))
    assert ra.pop("queued_us") <= rb.pop("queued_us")  # when each was sent
    assert ra == rb and r.ttl(keys.job("whole-1")) == r.ttl(keys.job("split-1"))


def test_begin(r):
    submit(r, "j1")
    assert begin(r, "j1", metadata_json='{"late":1}', priority=5) == "run"
    rec = records.get(r, "j1")
    assert (rec.state, rec.worker, rec.lane, rec.priority) == ("running", "w1", LANE, 5)
    assert rec.started_ms is not None and rec.metadata == {"m": 1}  # HSETNX: kept
    assert stream(r, "j1") == [{"type": "start", "worker": "w1"}]
    assert 890 < r.ttl(keys.job("j1")) <= 900 and 890 < r.ttl(keys.output("j1")) <= 900
    assert begin(r, "late", now_ms=2000, deadline_ms=1000) == "expired"
    assert begin(r, "in-time", now_ms=1000, deadline_ms=2000) == "run"
    r.set(keys.job("str"), "x")
    assert begin(r, "str") == "badkey"


def test_deltas_only_for_the_named_worker(r):
    submit(r, "a")
    submit(r, "b")
    begin(r, "a")
    begin(r, "b", worker="w2")
    items = [jobs.Delta("a", "he", [1]), jobs.Delta("b", "no", [2])]
    assert jobs.run(r, jobs.deltas(worker="w1", maxlen=100, items=items)) == 1
    resync = [jobs.Delta("a", "hello", [1, 2], reset=True)]
    assert jobs.run(r, jobs.deltas(worker="w1", maxlen=100, items=resync)) == 1
    assert stream(r, "a")[1:] == [
        {"type": "delta", "text": "he", "token_ids": "[1]"},
        {"type": "reset"},
        {"type": "delta", "text": "hello", "token_ids": "[1,2]"},
    ]
    assert stream(r, "b") == [{"type": "start", "worker": "w2"}]


def test_deltas_skip_a_stream_key_of_another_type(r):
    submit(r, "a")
    begin(r, "a")
    r.delete(keys.output("a"))
    r.set(keys.output("a"), "not a stream")
    for reset in (False, True):
        items = [jobs.Delta("a", "he", [1], reset=reset)]
        assert jobs.run(r, jobs.deltas(worker="w1", maxlen=100, items=items)) == 0
    assert r.get(keys.output("a")) == "not a stream"


@pytest.mark.parametrize("ack_inside", [True, False], ids=["one-redis", "cluster"])
def test_finalize_acks_stores_and_publishes(r, ack_inside):
    submit(r, "j1")
    entry_id = take(r)
    begin(r, "j1")
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.done_channel("j1"))
    assert finalize(r, "j1", entry_id, ack_inside=ack_inside) == 1
    rec = records.get(r, "j1")
    assert (rec.state, rec.finish_reason, rec.text, rec.token_ids) == (
        "completed",
        "length",
        "hello",
        [7, 8],
    )
    assert rec.final and rec.prompt_tokens == 3 and rec.finished_ms == 99
    assert stream(r, "j1")[-1] == {"type": "end", "state": "completed", "finish_reason": "length"}
    assert 790 < r.ttl(keys.job("j1")) <= 800 and 290 < r.ttl(keys.output("j1")) <= 300
    msg = message(pubsub)
    assert msg["channel"] == keys.done_channel("j1") and msg["data"] == "completed"
    pubsub.close()
    assert r.xpending(keys.request_stream(LANE), keys.GROUP)["pending"] == 0
    assert r.xlen(keys.request_stream(LANE)) == 0
    assert finalize(r, "j1", entry_id, state="failed", ack_inside=ack_inside) == 0
    assert records.get(r, "j1").state == "completed"  # the first result stays


def test_finalize_resync_and_without_a_lane(r):
    submit(r, "j1")
    entry_id = take(r)
    begin(r, "j1")
    call = jobs.finalize(
        job_id="j1",  # no entry: nothing to ack, the entry stays pending
        state="completed",
        finish_reason="stop",
        fields=records.final_fields(text="whole", token_ids=[1], worker="w1", finished_ms=1),
        ttl_s=60,
        stream_ttl_s=60,
        stream_maxlen=100,
    )
    assert jobs.run(r, jobs.resynced(call)) == 1
    assert stream(r, "j1")[1:] == [
        {"type": "reset"},
        {"type": "delta", "text": "whole", "token_ids": "[1]"},
        {"type": "end", "state": "completed", "finish_reason": "stop"},
    ]
    assert r.xpending(keys.request_stream(LANE), keys.GROUP)["pending"] == 1
    assert finalize(r, "j1", entry_id, ack_inside=True) == 0  # acks it all the same
    assert r.xpending(keys.request_stream(LANE), keys.GROUP)["pending"] == 0
    assert r.xlen(keys.request_stream(LANE)) == 0


def test_a_job_of_several_choices_writes_and_rewrites_each(r):
    submit(r, "j1")
    begin(r, "j1")
    items = [jobs.Delta("j1", "a", [1], index=0), jobs.Delta("j1", "é\n", [2, 3], index=1)]
    assert jobs.run(r, jobs.deltas(worker="w1", maxlen=100, items=items)) == 2
    choices = [
        records.Choice(0, "ab", [1, 4], "length"),
        records.Choice(1, 'é\n"x"', [2, 3, 5], "stop", [{"token_id": 2, "logprob": -0.5}]),
        records.Choice(2, "", [], "stop"),  # ended at once (an EOS, whose text is none)
    ]
    call = jobs.finalize(
        job_id="j1",
        state="completed",
        finish_reason="length",
        fields=records.final_fields(
            text="ab", token_ids=[1, 4], worker="w1", finished_ms=1, choices=choices
        ),
        ttl_s=60,
        stream_ttl_s=60,
        stream_maxlen=100,
    )
    assert jobs.run(r, jobs.resynced(call)) == 1
    assert stream(r, "j1")[1:] == [
        {"type": "delta", "text": "a", "token_ids": "[1]", "index": "0"},
        {"type": "delta", "text": "é\n", "token_ids": "[2,3]", "index": "1"},
        {"type": "reset"},
        {"type": "delta", "text": "ab", "token_ids": "[1,4]", "index": "0"},
        {"type": "delta", "text": 'é\n"x"', "token_ids": "[2,3,5]", "index": "1"},
        {"type": "delta", "text": "", "token_ids": "[]", "index": "2"},
        {"type": "end", "state": "completed", "finish_reason": "length"},
    ]
    rec = records.get(r, "j1")
    assert rec.choices == choices and (rec.text, rec.output_tokens) == ("ab", 5)
    # what a reader makes of it: each choice's text, once
    follower, texts = tokens.TextFollower(), {}
    for ev in tokens.Reader("j1").feed(r.xread({keys.output("j1"): "0-0"})):
        texts[ev.index] = texts.get(ev.index, "") + follower.feed(ev)
    assert texts == {0: "ab", 1: 'é\n"x"', 2: ""}


@pytest.mark.parametrize("ack_inside", [True, False], ids=["one-redis", "cluster"])
def test_finalize_dead_letters_a_record_that_is_not_a_hash(r, ack_inside):
    submit(r, "j1")
    entry_id = take(r)
    r.delete(keys.job("j1"))
    r.set(keys.job("j1"), "not a hash")
    assert finalize(r, "j1", entry_id, resync=jobs.RESYNC_NEVER, ack_inside=ack_inside) == -1
    ((_, dead),) = r.xrange(keys.DEAD_LETTER)
    assert (dead["lane"], dead["entry_id"], dead["job_id"]) == (LANE, entry_id, "j1")
    assert dead["error"].startswith("bad_record")
    assert r.xpending(keys.request_stream(LANE), keys.GROUP)["pending"] == 0


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
