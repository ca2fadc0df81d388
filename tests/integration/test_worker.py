"""What one message or one stored value can do to a worker: nothing but end its own job.
A worker driven in-process on the tiny model against a real redis-server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest
import redis

from plurai.broker_config import keys, protocol
from plurai.broker_config.groups import ensure_groups
from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.engine import Engine
from plurai.gpu_workers.worker import Worker
from plurai.producer.client import Client
from plurai.results import records
from tests.helpers import driven_worker, turn_until


@pytest.fixture
def engine(tiny_model) -> Iterator[Engine]:
    e = Engine(EngineConfig(model=str(tiny_model), kv_cache_bytes=8 << 20, threads=1, dtype="fp32"))
    yield e
    e.close()


@contextmanager
def serving(url: str, engine: Engine, **settings: object) -> Iterator[tuple[Worker, Client]]:
    """A started worker (driven by the test through `iterate`) and a client."""
    worker = driven_worker(url, engine, **settings)
    client = Client(url)
    try:
        yield worker, client
    finally:
        worker.cancels.close()
        client.close()


def stream(r: redis.Redis, job_id: str) -> list[dict[bytes, bytes]]:
    return [f for _, f in r.xrange(keys.output(job_id))]


def test_cancel_channel_takes_any_bytes(redis_url, engine):
    with serving(redis_url, engine) as (worker, client):
        r = worker.r
        job = client.submit("cancel noise", max_tokens=300, ignore_eos=True)
        turn_until(worker, lambda: job.id in worker.running)
        for junk in (b"\xff", b"\x00" * 100_000, "é".encode(), b"", job.id.encode() + b"\xff"):
            r.publish(keys.CANCEL_CHANNEL, junk)
        time.sleep(0.2)
        turn_until(worker, lambda: job.record().final)
        assert job.record().state == records.COMPLETED  # none of it named the job


def test_wrong_type_keys_end_only_their_job(redis_url, engine):
    with serving(redis_url, engine) as (worker, client):
        r = worker.r
        a, b, c = (client.submit(f"typed {i}", max_tokens=4) for i in range(3))
        r.delete(keys.job(a.id))
        r.set(keys.job(a.id), "not a hash")  # the record itself: no result can be written
        r.set(keys.output(b.id), "not a stream")  # the stream: the record says why
        turn_until(worker, lambda: b.record().final and c.record().final)
        rb = b.record()
        assert rb.state == records.FAILED and rb.error_code == protocol.Code.BAD_RECORD
        assert c.record().state == records.COMPLETED
        dead = [f for _, f in r.xrange(keys.DEAD_LETTER)]
        assert [f[b"job_id"] for f in dead] == [a.id.encode()]
        assert b"bad_record" in dead[0][b"error"]
        assert r.get(keys.job(a.id)) == b"not a hash"  # left as it was found
        streams = worker.intake.streams()  # every entry acked, just after its result
        turn_until(worker, lambda: not any(r.xpending(s, keys.GROUP)["pending"] for s in streams))

        # A record replaced while its job runs: the job ends at the next heartbeat.
        d = client.submit("replaced", max_tokens=2000, ignore_eos=True)
        turn_until(worker, lambda: d.id in worker.running)
        r.delete(keys.job(d.id))
        r.set(keys.job(d.id), "x")
        worker._next_beat = 0
        turn_until(worker, lambda: d.id not in worker.running)
        assert not engine.has_unfinished()
        assert [f[b"job_id"] for _, f in r.xrange(keys.DEAD_LETTER)][-1] == d.id.encode()
        e = client.submit("still serving", max_tokens=4)
        turn_until(worker, lambda: e.record().final)
        assert e.record().state == records.COMPLETED


def test_msgpack_bin_metadata_is_a_bad_field(redis_url, engine):
    with serving(redis_url, engine) as (worker, client):
        r = worker.r
        ensure_groups(r, worker.intake.streams())
        body = msgpack.packb({"prompt": "hi", "metadata": {"blob": b"\x00"}}, use_bin_type=True)
        r.xadd(
            keys.request_stream("standard"),
            {
                "v": "1",
                "id": "binmeta-0001",
                "max_tokens": "4",
                "content_type": protocol.MSGPACK,
                "body": body,
            },
        )
        turn_until(worker, lambda: r.hget(keys.job("binmeta-0001"), "final"))
        rec = records.get(r, "binmeta-0001")
        assert rec.error_code == "bad_field" and "bytes" in rec.error_message


def test_lost_cancel_message_is_honoured_at_the_heartbeat(redis_url, engine):
    with serving(redis_url, engine, heartbeat_interval_s=0.2) as (worker, client):
        job = client.submit("cancel me quietly", max_tokens=3000, ignore_eos=True)
        turn_until(worker, lambda: job.id in worker.running)
        worker.r.hset(keys.job(job.id), "cancel", "1")  # the flag, without the message
        turn_until(worker, lambda: job.record().final, timeout=30)
        rec = job.record()
        assert rec.state == records.CANCELLED and rec.output_tokens < 3000
        assert not engine.has_unfinished()


def test_reclaimed_entry_is_dropped_unwritten(redis_url, engine):
    """Another worker took the entry over while this one stalled: this one stops the job at
    its next heartbeat and never writes to the new run's stream."""
    with serving(redis_url, engine) as (worker, client):
        r = worker.r
        job = client.submit("stalled", max_tokens=3000, ignore_eos=True)
        turn_until(worker, lambda: job.id in worker.running)
        entry = worker.running[job.id].entry
        # What a second worker's reclaim and BEGIN do:
        r.xclaim(keys.request_stream(entry.lane), keys.GROUP, "w2", 0, [entry.entry_id])
        r.hset(keys.job(job.id), "worker", "w2")
        r.xadd(keys.output(job.id), {"type": "reset"})
        r.xadd(keys.output(job.id), {"type": "start", "worker": "w2"})
        worker.iterate()
        worker.writer.collect()
        mark = len(stream(r, job.id))
        for _ in range(5):
            worker.iterate()  # deltas of these steps are fenced off by the record
        worker._next_beat = 0
        worker.iterate()
        assert job.id not in worker.running and not engine.has_unfinished()
        worker.writer.collect()
        assert len(stream(r, job.id)) == mark  # nothing written after the takeover
        assert not job.record().final
        pend = r.xpending_range(keys.request_stream(entry.lane), keys.GROUP, "-", "+", 10)
        assert [p["consumer"] for p in pend] == [b"w2"]  # the lease was not taken back


def test_stream_and_dead_letter_bounds(redis_url, engine):
    with serving(
        redis_url,
        engine,
        output_ttl_s=120,
        output_maxlen=16,
        max_tokens_limit=32,
        dead_letter_maxlen=5,
    ) as (worker, client):
        r = worker.r
        assert worker.writer.out_maxlen == 32 + 64  # never below one run's deltas
        job = client.submit("bounded", max_tokens=20, ignore_eos=True)
        for _ in range(400):  # earlier runs' entries (here: written by hand)
            r.xadd(keys.output(job.id), {"type": "delta", "text": "old", "token_ids": "[]"})
        turn_until(worker, lambda: job.record().final)
        assert 0 < r.ttl(keys.output(job.id)) <= 120  # the stream expires before the record
        assert r.ttl(keys.job(job.id)) > 3600
        entries = stream(r, job.id)
        assert len(entries) < 300  # capped, at about out_maxlen entries
        last_reset = max(i for i, f in enumerate(entries) if f[b"type"] == b"reset")
        after = [f for f in entries[last_reset:] if f[b"type"] == b"delta"]
        assert "".join(f[b"text"].decode() for f in after) == job.record().text
        for i in range(300):
            r.xadd(keys.request_stream("standard"), {"id": "x", "n": str(i)})
        turn_until(worker, lambda: r.xlen(keys.request_stream("standard")) == 0)
        assert r.xlen(keys.DEAD_LETTER) < 300  # capped, about dead_letter_maxlen entries
        raw = [f for _, f in r.xrange(keys.DEAD_LETTER)][-1]
        assert json.loads(raw[b"fields"])["n"] == "299"


def test_engine_fault_is_retried_then_dead_lettered(redis_url, tiny_model):
    """The engine raises on one job: that job is handed back with its attempt count and
    dead-lettered at the limit; a job beside it in the same steps completes."""
    engine = Engine(
        EngineConfig(
            model=str(tiny_model),
            kv_cache_bytes=8 << 20,
            threads=1,
            dtype="fp32",
            fault_token_id=7,
        )
    )
    with serving(redis_url, engine, max_deliveries=3) as (worker, client):
        try:
            bad = client.submit(token_ids=[5, 7, 9], max_tokens=8)
            good = client.submit(token_ids=[5, 6, 9], max_tokens=8, ignore_eos=True)
            turn_until(worker, lambda: bad.record().final and good.record().final)
            rb, rg = bad.record(), good.record()
            assert rb.error_code == "too_many_deliveries" and "failed 3 times" in rb.error_message
            assert "injected" in rb.error_message
            assert rg.state == records.COMPLETED and len(rg.token_ids) == 8
            dead = [f for _, f in worker.r.xrange(keys.DEAD_LETTER)]
            assert len(dead) == 1 and json.loads(dead[0][b"fields"])["attempts"] == "2"
            assert not engine.has_unfinished()
        finally:
            engine.close()


def spelled(entries: list[dict[bytes, bytes]]) -> str | None:
    """The text of the deltas after the last reset; None without an end entry."""
    text: list[str] = []
    for f in entries:
        if f[b"type"] == b"reset":
            text = []
        elif f[b"type"] == b"delta":
            text.append(f[b"text"].decode())
        elif f[b"type"] == b"end":
            return "".join(text)
    return None


def test_overwritten_shared_keys_do_not_stop_the_worker(redis_url, engine):
    """Plurai's own keys written with the wrong type by a client: the worker takes them
    back and serves on; nothing is charged to the jobs."""
    with serving(redis_url, engine, heartbeat_interval_s=0.1) as (worker, client):
        r = worker.r
        r.set(keys.WORKERS, "x")
        r.set(keys.DEAD_LETTER, "x")
        job = client.submit("serving", max_tokens=40, ignore_eos=True)
        r.xadd(keys.request_stream("standard"), {"no": "id"})  # for the dead-letter stream
        turn_until(worker, lambda: job.id in worker.running)
        r.set(keys.worker(worker.id), "x")
        turn_until(worker, lambda: job.record().final)
        assert job.record().state == records.COMPLETED
        worker._next_beat = 0
        worker.iterate()
        assert r.type(keys.WORKERS) == b"set" and r.type(keys.worker(worker.id)) == b"hash"
        assert r.xlen(keys.request_stream("standard")) == 0  # the no-id entry was acked


def test_a_result_without_text_voids_earlier_deltas(redis_url, engine):
    """A job handed back after a partial run, then cancelled while queued: its stream ends
    with a reset, so its deltas spell the record's (empty) text; by the SDK's CANCEL and by
    the worker that meets the flag."""
    with serving(redis_url, engine) as (worker, client):
        r = worker.r
        by_sdk = client.submit("partial a", max_tokens=4)
        by_worker = client.submit("partial b", max_tokens=4)
        for job in (by_sdk, by_worker):  # what a run handed back leaves behind
            r.xadd(keys.output(job.id), {"type": "start", "worker": "gone"})
            r.xadd(keys.output(job.id), {"type": "delta", "text": "hello", "token_ids": "[1]"})
        assert by_sdk.cancel() == "cancelled"
        r.hset(keys.job(by_worker.id), "cancel", "1")  # the flag alone, as if no script ran
        turn_until(worker, lambda: by_worker.record().final)
        for job in (by_sdk, by_worker):
            rec = job.record()
            assert rec.state == records.CANCELLED and rec.text in ("", None)
            assert spelled(stream(r, job.id)) == ""


def test_a_stream_at_the_largest_id_ends_only_its_job(redis_url, engine):
    with serving(redis_url, engine) as (worker, client):
        r = worker.r
        top = "18446744073709551615-18446744073709551615"
        before = client.submit("blocked before", max_tokens=4)
        r.xadd(keys.output(before.id), {"x": "y"}, id=top)
        during = client.submit("blocked during", max_tokens=60, ignore_eos=True)
        other = client.submit("bystander", max_tokens=60, ignore_eos=True)
        turn_until(worker, lambda: during.id in worker.running and other.id in worker.running)
        r.xadd(keys.output(during.id), {"x": "y"}, id=top)
        turn_until(worker, lambda: during.record().final and other.record().final)
        rb = before.record()
        assert rb.state == records.FAILED and rb.error_code == protocol.Code.BAD_RECORD
        assert during.record().state == records.COMPLETED  # its record holds the text
        ro = other.record()
        assert ro.state == records.COMPLETED and spelled(stream(r, other.id)) == ro.text
        assert [f[b"type"] for f in stream(r, other.id)].count(b"reset") == 0


def test_an_entry_deleted_while_its_job_runs_still_gets_its_result(redis_url, engine):
    with serving(redis_url, engine, heartbeat_interval_s=0.05) as (worker, client):
        job = client.submit("deleted entry", max_tokens=300, ignore_eos=True)
        turn_until(worker, lambda: job.id in worker.running)
        entry = worker.running[job.id].entry
        worker.r.xdel(keys.request_stream(entry.lane), entry.entry_id)
        turn_until(worker, lambda: job.record().final)
        assert job.record().state == records.COMPLETED
