"""A worker under a top-lane target (PLURAI_TOP_LANE_TPOT_MS): new work held while the top
lane's tokens are slow, the top lane's arrivals beside lower-lane jobs, the wait bound and
the lower lanes' fair turn in the hold."""

from __future__ import annotations

import time
from typing import Any

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.backend import StepOutput
from plurai.gpu_workers.worker import Worker
from plurai.producer.client import Client
from tests.helpers import driven_worker

from .recorder import Recorder, token


def over_target(redis_url: str, client: Client, **settings: Any) -> tuple[Worker, Recorder, str]:
    """A started worker (top_lane_tpot_ms=100) running one top-lane job whose tokens come
    300 ms apart: over its target."""
    s = Settings(redis_url=redis_url, top_lane_reserve=0, top_lane_tpot_ms=100, **settings)
    engine = Recorder()
    w = driven_worker(redis_url, engine, "w1", settings=s)
    first = client.submit("i", lane="interactive").id
    w.taker.fill()
    w.publisher.step([token(first, 1)])
    time.sleep(0.3)
    w.publisher.step([token(first, 2)])
    return w, engine, first


def test_a_top_lane_over_its_target_time_per_token_stops_new_work(redis_url):
    """top_lane_tpot_ms: while the top lane's tokens come slower than the target, the
    worker starts nothing new (of any lane): it stays in the queue; once they are fast
    again, the worker takes it."""
    with Client(redis_url) as client:
        w, engine, first = over_target(redis_url, client)
        assert [j for j, _ in engine.added] == [first]
        waiting = [client.submit("i", lane="interactive").id, client.submit("b", lane="batch").id]
        w.taker.fill()
        assert [j for j, _ in engine.added] == [first]  # both wait in the queue
        r = connect(redis_url)
        assert r.xlen(keys.request_stream("interactive")) == 2
        w.admission.pace.tokens(0.05, 20, time.monotonic() + 1.5)  # the old arrivals age out: 50 ms
        assert not w.admission.pace.over_target()
        w.taker.fill()
        # the batch prompt waits for the new top-lane prompt's first token
        assert [j for j, _ in engine.added] == [first, waiting[0]]
        w.publisher.step([StepOutput(waiting[0], [5], "a", False, None, 1, 1, 0)])
        w.taker.fill()
        assert [j for j, _ in engine.added] == [first, *waiting]


def test_over_the_target_beside_lower_lane_jobs_the_top_lane_still_starts(redis_url):
    """A worker over the top lane's target while a batch job runs on it: the batch job
    slows the top lane too, so the lower lanes wait and a top-lane arrival starts at once
    (held, it would wait behind batch work it outranks)."""
    with Client(redis_url) as client:
        w, engine, first = over_target(redis_url, client, top_lane_slowdown=0)
        now = time.monotonic()
        w.admission.pace.tokens(0.05, 20, now + 1.5)  # fast for a while: a batch job starts
        running = client.submit("b", lane="batch").id
        w.taker.fill()
        w.admission.pace.tokens(3.0, 1, now + 1.6)  # the top lane is slow again
        assert w.admission.pace.over_target()
        assert [j for j, _ in engine.added] == [first, running]
        batch = client.submit("b", lane="batch").id
        top = client.submit("i", lane="interactive").id
        w.taker.fill()
        assert [j for j, _ in engine.added] == [first, running, top]
        r = connect(redis_url)
        assert [f[b"id"].decode() for _, f in r.xrange(keys.request_stream("batch"))][-1] == batch
        assert batch not in [j for j, _ in engine.added]
        w.running.pop(running)  # the batch job ended: over the target, the top lane waits
        later = client.submit("i", lane="interactive").id
        w.taker.fill()
        assert later not in [j for j, _ in engine.added]


def test_in_a_hold_the_lower_lanes_keep_their_fair_turn(redis_url):
    """Over the target, a worker that takes top-lane entries only because they waited past
    their bound is not getting the top lane under it by holding work: after fair_every - 1
    such takes, the next is the lower lanes' oldest entry, started over the target."""
    with Client(redis_url) as client:
        w, engine, first = over_target(
            redis_url, client, top_lane_wait_ms=200, fair_every=2, top_lane_slowdown=0
        )
        batch = client.submit("b", lane="batch").id
        late = client.submit("i", lane="interactive").id
        time.sleep(0.25)
        w.publisher.step([token(first, 3)])  # still slow
        assert w.admission.pace.over_target()
        w.taker.fill()
        assert [j for j, _ in engine.added] == [first, late]  # waited 250 ms: taken
        w.admission.next_waited = 0.0
        w.taker.fill()
        assert [j for j, _ in engine.added] == [first, late, batch]  # the fair turn


def test_a_top_lane_entry_waits_for_the_target_no_longer_than_its_bound(redis_url):
    """top_lane_wait_ms: a worker over the target still takes the top lane's entry once it
    has waited that long in the queue (every worker may be over it), and only that one:
    younger top-lane entries and the lower lanes' wait on."""
    with Client(redis_url) as client:
        w, engine, first = over_target(redis_url, client, top_lane_wait_ms=400)
        late = client.submit("i", lane="interactive").id
        batch = client.submit("b", lane="batch").id
        w.taker.fill()
        assert [j for j, _ in engine.added] == [first]  # younger than 400 ms: it waits
        time.sleep(0.45)
        w.publisher.step([token(first, 3)])  # still slow: 450 ms since the last token
        assert w.admission.pace.over_target()
        younger = client.submit("i", lane="interactive").id
        w.taker.fill()
        assert [j for j, _ in engine.added] == [first, late]
        w.admission.next_waited = 0.0  # the next look, however soon: the younger one is too young
        w.taker.fill()
        assert [j for j, _ in engine.added] == [first, late]
        r = connect(redis_url)
        waiting = r.xrange(keys.request_stream("interactive"), count=10)
        assert younger in {f[b"id"].decode() for _, f in waiting}
        assert r.xlen(keys.request_stream("batch")) == 1
        assert batch not in [j for j, _ in engine.added]
