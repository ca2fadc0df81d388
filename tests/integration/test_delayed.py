"""Delayed jobs (`not_before`): a job submitted to run later waits in its shard's delayed
set, its record saying when, and no worker starts it before then; then a worker moves it to
its lane and it runs as any other. A cancel, an idempotency key, a time already past and
hostile input (a bad time, bytes that are no entry in the set) each behave as a user
relies on."""

from __future__ import annotations

import time

import msgpack
import pytest

from plurai.broker_config import keys, stats
from plurai.broker_config.connection import connect
from plurai.broker_config.settings import Settings
from plurai.producer import dead_letters as dead
from plurai.producer.client import Client
from plurai.producer.errors import JobFailed
from plurai.results import records
from tests.helpers import driven_worker, turn_until

from .recorder import Recorder


def test_a_delayed_job_starts_no_sooner_than_asked(redis_url) -> None:
    r = connect(redis_url)
    engine = Recorder()
    w = driven_worker(redis_url, engine)
    with Client(redis_url) as client:
        at = time.time() + 1.5
        later = client.submit("later", not_before=at, idempotency_key="k-later")
        again = client.submit("later", not_before=at, idempotency_key="k-later")
        assert again.id == later.id  # the key holds the delayed job
        record = later.record()
        assert record.state == records.QUEUED and record.raw["not_before_ms"] == str(int(at * 1000))
        assert stats.snapshot(r, Settings().lanes).totals["scheduled"] == 1
        now = client.submit("now", not_before=time.time() - 10)  # past: queued at once
        turn_until(w, lambda: now.id in [j for j, _ in engine.added])
        while time.time() < at - 0.2:
            w.iterate()
            assert later.id not in [j for j, _ in engine.added], "started before its time"
        turn_until(w, lambda: later.id in [j for j, _ in engine.added], timeout=10)
        started = time.time()
        assert at <= started < at + 3  # within a move's period (intake.DUE_S) of its time
        assert later.record().state == records.RUNNING
        assert stats.snapshot(r, Settings().lanes).totals["scheduled"] == 0
    w.cancels.close()


def test_a_cancelled_delayed_job_never_runs(redis_url) -> None:
    engine = Recorder()
    w = driven_worker(redis_url, engine)
    with Client(redis_url) as client:
        job = client.submit("never", not_before=time.time() + 0.5)
        assert job.cancel() == "cancelled"
        assert job.record().state == records.CANCELLED
        time.sleep(0.6)
        r = connect(redis_url)
        turn_until(
            w, lambda: r.zcard(keys.delayed()) == 0 and r.xlen(keys.request_stream("standard")) == 0
        )
        assert job.id not in [j for j, _ in engine.added if j not in engine.aborted]
        assert job.record().state == records.CANCELLED
    w.cancels.close()


def test_hostile_times_and_entries(redis_url) -> None:
    r = connect(redis_url)
    with Client(redis_url) as client:
        for bad in ("soon", float("nan"), float("inf"), -1, True, time.time() + 31 * 86400):
            with pytest.raises(ValueError, match="not_before"):
                client.submit("x", not_before=bad)
    assert r.zcard(keys.delayed()) == 0
    # bytes in the set that are no entry, and one for a lane no worker has: dead-lettered,
    # and a good one beside them still runs
    r.zadd(keys.delayed(), {b"\xc1junk": 1, b"\x93\xa7nowhere\xa2id\xa8job-cccc": 2})
    engine = Recorder()
    w = driven_worker(redis_url, engine)
    with Client(redis_url) as client:
        # a real job whose entry names a lane this deployment does not have: it fails, with
        # what to fix, rather than reading "queued" until its record expires
        lost = client.submit("lost", not_before=time.time() + 60)
        (member,) = r.zrange(keys.delayed(), 0, -1, withscores=False)[-1:]
        items = msgpack.unpackb(member, raw=True)
        r.zrem(keys.delayed(), member)
        r.zadd(keys.delayed(), {msgpack.packb([b"nowhere", *items[1:]]): 3})
        good = client.submit("good", not_before=time.time() + 0.2)
        turn_until(w, lambda: good.id in [j for j, _ in engine.added], timeout=10)
        turn_until(w, lambda: lost.record().final)
        with pytest.raises(JobFailed) as failed:
            lost.result(timeout=5)
        assert failed.value.record.error_code == "bad_field"
        assert "'nowhere'" in failed.value.record.error_message
    assert r.zcard(keys.delayed()) == 0
    letters = dead.list_dead(r)
    assert len(letters) == 3 and all("delayed entry" in d.error for d in letters)
    assert {d.job_id for d in letters} == {None, "job-cccc", lost.id}
    assert records.get(r, "job-cccc").error_code == "bad_field"
    with pytest.raises(dead.DeadLetterError, match="lane 'nowhere'"):  # not as it is
        dead.requeue(r, next(d.id for d in letters if d.job_id == lost.id))
    w.cancels.close()
