"""The typed calls of results/jobs.py that run a job, against a real redis-server: submit,
begin, deltas and finalize. Each named parameter lands where its script reads it (the
record, the token stream, the request stream, the dead-letter stream, the channels, the
TTLs). The other calls (cancel, requeue, renew, check, the batch calls) and the loading of
the scripts: tests/integration/test_jobs_control.py.

A test or two per typed call, in the order of results/jobs.py.
"""

from __future__ import annotations

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


@pytest.fixture(name="r")  # imported by test_jobs_control.py
def r_fixture(redis_url: str) -> redis.Redis:
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
