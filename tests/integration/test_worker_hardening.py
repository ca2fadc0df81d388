"""What one message or one stored value can do to a worker: nothing but end its own job.
A worker driven in-process on the tiny model against a real redis-server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import msgpack
import pytest
import redis

from broker_config import keys, protocol
from broker_config.connection import connect
from broker_config.groups import ensure_groups
from broker_config.settings import Settings
from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.engine import Engine
from gpu_workers.worker import Worker
from producer.client import Client
from results import records


@pytest.fixture
def engine(tiny_model) -> Iterator[Engine]:
    e = Engine(EngineConfig(model=str(tiny_model), kv_cache_bytes=8 << 20, threads=1, dtype="fp32"))
    yield e
    e.close()


def make_worker(url: str, engine: Engine, worker_id: str = "w1", **settings: object) -> Worker:
    w = Worker(engine, connect(url), Settings(redis_url=url, **settings), worker_id=worker_id)
    ensure_groups(w.r, w.lanes)
    w._load_scripts()
    w._cancels.subscribe(keys.CANCEL_CHANNEL)
    return w


def run_until(worker: Worker, done, timeout: float = 60.0) -> None:
    give_up = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < give_up, "timed out"
        worker._iterate()


def stream(r: redis.Redis, job_id: str) -> list[dict[bytes, bytes]]:
    return [f for _, f in r.xrange(keys.output(job_id))]


def test_cancel_channel_takes_any_bytes(redis_url, engine):
    worker = make_worker(redis_url, engine)
    client = Client(redis_url)
    r = worker.r
    try:
        job = client.submit("cancel noise", max_tokens=300, ignore_eos=True)
        run_until(worker, lambda: job.id in worker.running)
        for junk in (b"\xff", b"\x00" * 100_000, "é".encode(), b"", job.id.encode() + b"\xff"):
            r.publish(keys.CANCEL_CHANNEL, junk)
        time.sleep(0.2)
        run_until(worker, lambda: job.record().final)
        assert job.record().state == records.COMPLETED  # none of it named the job
    finally:
        worker._cancels.close()
        client.close()


def test_wrong_type_keys_end_only_their_job(redis_url, engine):
    worker = make_worker(redis_url, engine)
    client = Client(redis_url)
    r = worker.r
    try:
        a, b, c = (client.submit(f"typed {i}", max_tokens=4) for i in range(3))
        r.delete(keys.job(a.id))
        r.set(keys.job(a.id), "not a hash")  # the record itself: no result can be written
        r.set(keys.output(b.id), "not a stream")  # the stream: the record says why
        run_until(worker, lambda: b.record().final and c.record().final)
        rb = b.record()
        assert rb.state == records.FAILED and rb.error_code == protocol.Code.BAD_RECORD
        assert c.record().state == records.COMPLETED
        dead = [f for _, f in r.xrange(keys.DEAD_LETTER)]
        assert [f[b"job_id"] for f in dead] == [a.id.encode()]
        assert b"bad_record" in dead[0][b"error"]
        assert r.get(keys.job(a.id)) == b"not a hash"  # left as it was found
        for lane in worker.lanes:
            assert r.xpending(keys.request_stream(lane), keys.GROUP)["pending"] == 0

        # A record replaced while its job runs: the job ends at the next heartbeat.
        d = client.submit("replaced", max_tokens=2000, ignore_eos=True)
        run_until(worker, lambda: d.id in worker.running)
        r.delete(keys.job(d.id))
        r.set(keys.job(d.id), "x")
        worker._next_beat = 0
        run_until(worker, lambda: d.id not in worker.running)
        assert not engine.has_unfinished()
        assert [f[b"job_id"] for _, f in r.xrange(keys.DEAD_LETTER)][-1] == d.id.encode()
        e = client.submit("still serving", max_tokens=4)
        run_until(worker, lambda: e.record().final)
        assert e.record().state == records.COMPLETED
    finally:
        worker._cancels.close()
        client.close()


def test_msgpack_bin_metadata_is_a_bad_field(redis_url, engine):
    worker = make_worker(redis_url, engine)
    r = worker.r
    try:
        ensure_groups(r, worker.lanes)
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
        run_until(worker, lambda: r.hget(keys.job("binmeta-0001"), "final"))
        rec = records.get(r, "binmeta-0001")
        assert rec.error_code == "bad_field" and "bytes" in rec.error_message
    finally:
        worker._cancels.close()


def test_lost_cancel_message_is_honoured_at_the_heartbeat(redis_url, engine):
    worker = make_worker(redis_url, engine, heartbeat_interval_s=0.2)
    client = Client(redis_url)
    try:
        job = client.submit("cancel me quietly", max_tokens=3000, ignore_eos=True)
        run_until(worker, lambda: job.id in worker.running)
        worker.r.hset(keys.job(job.id), "cancel", "1")  # the flag, without the message
        run_until(worker, lambda: job.record().final, timeout=30)
        rec = job.record()
        assert rec.state == records.CANCELLED and rec.output_tokens < 3000
        assert not engine.has_unfinished()
    finally:
        worker._cancels.close()
        client.close()


def test_reclaimed_entry_is_dropped_unwritten(redis_url, engine):
    """Another worker took the entry over while this one stalled: this one stops the job at
    its next heartbeat and never writes to the new run's stream."""
    worker = make_worker(redis_url, engine)
    client = Client(redis_url)
    r = worker.r
    try:
        job = client.submit("stalled", max_tokens=3000, ignore_eos=True)
        run_until(worker, lambda: job.id in worker.running)
        entry = worker.running[job.id].entry
        # What a second worker's reclaim and BEGIN do:
        r.xclaim(keys.request_stream(entry.lane), keys.GROUP, "w2", 0, [entry.entry_id])
        r.hset(keys.job(job.id), "worker", "w2")
        r.xadd(keys.output(job.id), {"type": "reset"})
        r.xadd(keys.output(job.id), {"type": "start", "worker": "w2"})
        worker._iterate()
        worker._collect()
        mark = len(stream(r, job.id))
        for _ in range(5):
            worker._iterate()  # deltas of these steps are fenced off by the record
        worker._next_beat = 0
        worker._iterate()
        assert job.id not in worker.running and not engine.has_unfinished()
        worker._collect()
        assert len(stream(r, job.id)) == mark  # nothing written after the takeover
        assert not job.record().final
        pend = r.xpending_range(keys.request_stream(entry.lane), keys.GROUP, "-", "+", 10)
        assert [p["consumer"] for p in pend] == [b"w2"]  # the lease was not taken back
    finally:
        worker._cancels.close()
        client.close()


def test_stream_and_dead_letter_bounds(redis_url, engine):
    worker = make_worker(
        redis_url, engine, output_ttl_s=120, output_maxlen=16, dead_letter_maxlen=5
    )
    client = Client(redis_url)
    r = worker.r
    try:
        job = client.submit("bounded", max_tokens=200, ignore_eos=True)
        run_until(worker, lambda: job.record().final)
        assert 0 < r.ttl(keys.output(job.id)) <= 120  # the stream expires before the record
        assert r.ttl(keys.job(job.id)) > 3600
        assert r.xlen(keys.output(job.id)) < 200  # capped, about output_maxlen entries
        for i in range(300):
            r.xadd(keys.request_stream("standard"), {"id": "x", "n": str(i)})
        run_until(worker, lambda: r.xlen(keys.request_stream("standard")) == 0)
        assert r.xlen(keys.DEAD_LETTER) < 300  # capped, about dead_letter_maxlen entries
        raw = [f for _, f in r.xrange(keys.DEAD_LETTER)][-1]
        assert json.loads(raw[b"fields"])["n"] == "299"
    finally:
        worker._cancels.close()
        client.close()


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
    worker = make_worker(redis_url, engine, max_deliveries=3)
    client = Client(redis_url)
    try:
        bad = client.submit(token_ids=[5, 7, 9], max_tokens=8)
        good = client.submit(token_ids=[5, 6, 9], max_tokens=8, ignore_eos=True)
        run_until(worker, lambda: bad.record().final and good.record().final)
        rb, rg = bad.record(), good.record()
        assert rb.error_code == "too_many_deliveries" and "failed 3 times" in rb.error_message
        assert "injected" in rb.error_message
        assert rg.state == records.COMPLETED and len(rg.token_ids) == 8
        dead = [f for _, f in worker.r.xrange(keys.DEAD_LETTER)]
        assert len(dead) == 1 and json.loads(dead[0][b"fields"])["attempts"] == "2"
        assert not engine.has_unfinished()
    finally:
        worker._cancels.close()
        client.close()
        engine.close()
