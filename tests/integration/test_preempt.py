"""Preemption across the fleet: a worker whose KV cache is full of batch work takes a
top-lane arrival at once; its engine preempts a batch job for it, and the worker hands that
job over with its progress. The entry keeps its place in the lane (taken before newer
entries), no attempt is counted, and the worker that takes it resumes it to the tokens of an
uninterrupted run. Workers run in-process on the tiny model (fp32)."""

from __future__ import annotations

import time

import pytest

from plurai.broker_config import keys, stats
from plurai.broker_config.connection import connect
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.engine import Engine
from plurai.producer.client import Client
from plurai.results import records
from tests.helpers import driven_worker
from tests.integration.test_resume import finish, resumed, run_until, stream_text, stream_types
from tests.integration.test_resume import worker as make_worker
from tests.integration.test_worker_intake import Recorder

BATCH = dict(lane="batch", max_tokens=64, ignore_eos=True)
QUESTION = "a quick question about the river and the stone " * 3  # 3 blocks' prompt


@pytest.fixture(scope="module")
def engines(tiny_model):
    def engine(**kw: object) -> Engine:
        return Engine(EngineConfig(model=str(tiny_model), threads=1, dtype="fp32", **kw))

    # six blocks of 16: one batch job (5 blocks to its max_tokens) leaves no room for more
    made = [engine(num_kv_blocks=6, block_size=16), engine(kv_cache_bytes=8 << 20)]
    yield made
    for e in made:
        e.close()


def handed_over(w) -> int:
    return sum(int(w.metrics.jobs_handed_over.labels(lane)._value.get()) for lane in w.lanes)


def test_a_preempted_batch_job_is_handed_over_and_resumed_elsewhere(redis_url, engines):
    r = connect(redis_url)
    client = Client(redis_url)
    small = make_worker(redis_url, engines[0], "small", stream_flush_tokens=1)
    big = make_worker(redis_url, engines[1], "big")
    ref = finish(big, client.submit("a long batch document", **BATCH).id, r)
    assert ref.output_tokens == 64

    job = client.submit("a long batch document", **BATCH)
    run_until(small, job.id, 40)  # it holds 4 of the 6 blocks
    top = client.submit(QUESTION, lane="interactive", max_tokens=16, ignore_eos=True)
    give_up = time.monotonic() + 30
    while job.id in small.running:
        assert time.monotonic() < give_up, "the batch job was not preempted"
        small.iterate()
    assert top.id in small.running  # taken at once, not left waiting for the batch job
    assert handed_over(small) == 1

    # the entry waits, pending to the hand-over consumer, with no delivery counted
    stream = keys.request_stream("batch")
    (p,) = r.xpending_range(stream, keys.GROUP, "-", "+", 10)
    assert p["consumer"].decode() == keys.HANDED_OVER and p["times_delivered"] == 0
    assert records.get(r, job.id).state == records.QUEUED
    snap = stats.snapshot(r, small.lanes)
    lane = next(x for x in snap.lanes if x.name == "batch")
    assert (lane.waiting, lane.pending) == (1, 0)

    # it keeps its place: taken before a newer batch entry
    newer = client.submit("a newer batch document", **BATCH)
    got = big.intake.take(False, True, count=1)
    assert [e.job_id for e in got] == [job.id]
    big.held[:] = got
    rec = finish(big, job.id, r)
    assert rec.state == records.COMPLETED
    assert rec.token_ids == ref.token_ids and rec.text == ref.text
    assert resumed(big) == 1 and big.metrics.resumed_tokens._value.get() >= 10
    assert b"reset" not in stream_types(r, job.id)
    assert stream_text(r, job.id) == (rec.text, rec.token_ids)
    assert int(r.hget(keys.job(job.id), "attempts") or 0) == 0  # a preemption is no failure

    done = finish(small, top.id, r)
    assert done.state == records.COMPLETED and done.prompt_tokens > 32
    assert finish(big, newer.id, r).state == records.COMPLETED
    client.close()


def test_without_preemption_the_arrival_waits_and_nothing_is_handed_over(redis_url, engines):
    r = connect(redis_url)
    client = Client(redis_url)
    small = make_worker(redis_url, engines[0], "small", preempt=False)
    job = client.submit("a long batch document", **BATCH)
    run_until(small, job.id, 4)
    top = client.submit("a quick question", lane="interactive", max_tokens=16, ignore_eos=True)
    for _ in range(5):
        small.iterate()
    assert top.id not in small.running and job.id in small.running
    assert finish(small, top.id, r).state == records.COMPLETED
    assert records.get(r, job.id).final  # the batch job ran to its end first
    assert handed_over(small) == 0
    client.close()


def test_a_handed_over_entry_keeps_its_count_of_failures(redis_url):
    """An entry reclaimed from a dead worker (one failure) and then preempted keeps that
    failure: the worker that takes it next sees attempts 1, and the preemption adds none."""
    s = Settings(redis_url=redis_url, reclaim_idle_ms=100, reclaim_interval_s=0, fair_every=0)
    a, b, c = (driven_worker(redis_url, Recorder(), n, settings=s) for n in "abc")
    with Client(redis_url) as client:
        job = client.submit("x", **BATCH)
        (taken,) = a.intake.take(False, True, count=1)  # a takes it, then dies
        assert taken.req.envelope.attempts == 0
        time.sleep(0.2)
        (reclaimed,) = b.intake.take(False, True, count=1)
        assert reclaimed.job_id == job.id and reclaimed.req.envelope.attempts == 1
        assert b.intake.hand_over(reclaimed)  # preempted on b
        (again,) = c.intake.take(False, True, count=1)
        assert again.job_id == job.id and again.req.envelope.attempts == 1
