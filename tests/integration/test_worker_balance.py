"""Workers sharing a lane: a busier worker leaves a new entry to a less loaded one for about
one of its turns, each worker records its turns' length, and a damaged loads record is
dropped."""

from __future__ import annotations

import time

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.broker_config.settings import Settings
from plurai.producer.client import Client
from tests.helpers import driven_worker

from .recorder import Recorder, Waiting


def test_a_busier_worker_leaves_a_new_entry_to_a_less_loaded_one(redis_url):
    """Two workers of one queue, each stepping its engine: a new entry goes to the one that
    runs fewer jobs, whichever reads first. The busier one leaves it until the other's next
    read: it takes the entry once the other has read without taking it, or is late for its
    next read (two of its turns and 20 ms: it may be dead, full or in a long step); a worker
    alone takes at once."""
    settings = Settings(
        redis_url=redis_url, balance_ms=5000, poll_ms=0, fair_every=0, top_lane_slowdown=0
    )
    busy, light = Recorder(), Recorder()
    w1 = driven_worker(redis_url, busy, "w1", settings=settings)
    w2 = driven_worker(redis_url, light, "w2", settings=settings)
    w2.intake.turn_ms = 150  # due to read within 320 ms of its last read

    with Client(redis_url) as client:
        first = [client.submit("a", lane="interactive").id for _ in range(2)]
        w1.taker.fill()  # alone so far: takes both at once
        assert [rid for rid, _ in busy.added] == first
        w2.taker.fill()  # finds nothing; records its load (0)
        late = client.submit("b", lane="interactive").id
        w1.taker.fill()
        assert len(busy.added) == 2  # left to w2, which runs fewer jobs
        w2.taker.fill()
        assert [rid for rid, _ in light.added] == [late]

        again = client.submit("c", lane="batch").id
        w1.taker.fill()  # 2 jobs against w2's 1, and w2 has not read since
        assert len(busy.added) == 2
        time.sleep(0.002)  # a read in the entry's own ms may have come before it
        assert w2.intake.take(False, below_top=False) == []  # w2 reads the top lane only
        w1.taker.fill()  # w2 read and left it: taken at once, long before balance_ms
        assert [rid for rid, _ in busy.added][2:] == [again]

        w2.taker.fill()  # w2 reads again (nothing there): due to read within 320 ms
        later = client.submit("d", lane="interactive").id
        w1.taker.fill()
        assert len(busy.added) == 3
        time.sleep(0.4)  # w2 did not read again when due
        w1.taker.fill()
        assert [rid for rid, _ in busy.added][3:] == [later]

        w2.beat.forget(w2.model)  # w2 stops: w1 is alone again
        alone = client.submit("e", lane="interactive").id
        w1.taker.fill()
        assert [rid for rid, _ in busy.added][4:] == [alone]
        assert client.job(late).status() == "running"
    for w in (w1, w2):
        w.intake.close()


def test_a_worker_records_the_length_of_its_turns_for_the_balance(redis_url):
    """A worker that steps its engine records, as it takes, its load, the time of its read
    and its turns' mean length (what another worker waits on before taking an entry left
    to it); an idle one's turns are not counted."""
    settings = Settings(redis_url=redis_url, fair_every=0, top_lane_slowdown=0)
    engine = Waiting()
    engine.WAIT_S = 0.05  # a step of 50 ms, unless an arrival wakes it
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    r = connect(redis_url)
    w.iterate()  # idle: nothing stepped
    assert w.intake.turn_ms == 0
    with Client(redis_url) as client:
        client.submit("a", lane="interactive")
        for _ in range(4):
            w.iterate()  # takes it, then steps
        assert 0 < w.intake.turn_ms < 1000
        client.submit("b", lane="interactive")
        w.iterate()
        turn = w.intake.turn_ms  # as recorded at this turn's read
    load, at, recorded = r.hget(keys.loads(w.model), "w1").decode().split(":")
    assert (int(load), int(recorded)) == (2, turn)
    assert abs(int(at) - time.time() * 1000) < 5000
    w.intake.close()


def test_a_damaged_loads_record_is_dropped_and_the_entry_taken(redis_url):
    """Whatever else writes to the loads hash (garbage, a turn far too long) never keeps a
    worker from taking: a record that does not parse is dropped, and an entry is left to
    another worker for at most balance_ms."""
    settings = Settings(redis_url=redis_url, balance_ms=200, fair_every=0, top_lane_slowdown=0)
    engine = Recorder()
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    r = connect(redis_url)
    loads = keys.loads(w.model)
    with Client(redis_url) as client:
        first = client.submit("a", lane="interactive").id
        w.taker.fill()
        r.hset(loads, mapping={"junk": "x:y", "bad": "1:2:3:4", "huge": "0:9999999999999:99999999"})
        w.taker.fill()
        assert r.hget(loads, "junk") is None and r.hget(loads, "bad") is None
        now_ms = int(time.time() * 1000)
        r.hset(loads, "slow", f"0:{now_ms}:99999999")  # less loaded, "due" for a day
        late = client.submit("b", lane="interactive").id
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == [first]
        time.sleep(0.25)  # balance_ms bounds the wait
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == [first, late]
    w.intake.close()
