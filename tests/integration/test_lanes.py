"""Lane controls as an operator uses them (`plurai lane pause|resume|purge`): a paused lane
keeps its jobs and gets new ones but no worker takes from it until it is resumed; a purge
ends every waiting job of a lane cancelled, at once, and leaves running jobs alone; a lane
or model that does not exist is refused with its code."""

from __future__ import annotations

import time

import pytest

from plurai.broker_config import keys, stats
from plurai.broker_config.connection import connect
from plurai.broker_config.settings import Settings
from plurai.gateway import dashboard
from plurai.producer import lanes
from plurai.producer.client import Client
from plurai.results import records
from tests.helpers import driven_worker, plurai, turn_until

from .recorder import Recorder


def test_a_paused_lane_is_not_taken_from_until_resumed(redis_url) -> None:
    r = connect(redis_url)
    engine = Recorder()
    w = driven_worker(redis_url, engine, heartbeat_interval_s=0.05, fair_every=0)
    assert lanes.pause(r, "standard") and not lanes.pause(r, "standard")
    turn_until(w, lambda: w.intake.paused == {"standard"})  # read at its next heartbeat
    with Client(redis_url) as client:
        low = client.submit("waits", lane="standard")
        other = client.submit("runs", lane="batch")  # a lane below it, not paused
        turn_until(w, lambda: len(engine.added) == 1)
        for _ in range(3):
            w.taker.fill()
        assert [job_id for job_id, _ in engine.added] == [other.id]
        assert low.record().state == records.QUEUED
        lane = {(q.model, q.name): q for q in stats.snapshot(r, Settings().lanes).lanes}
        assert lane[("default", "standard")].paused and lane[("default", "standard")].waiting == 1
        assert not lane[("default", "batch")].paused
        assert lanes.paused(r) == [("default", "standard")]
        _, page = dashboard.read(r, Settings())  # what the dashboard shows
        shown = {q["name"]: q["paused"] for q in page["snapshot"]["lanes"]}
        assert shown == {"interactive": False, "standard": True, "batch": False}

        assert lanes.resume(r, "standard") and not lanes.resume(r, "standard")
        turn_until(w, lambda: len(engine.added) == 2)  # (its next poll of the lane)
        assert not w.intake.paused
        assert [job_id for job_id, _ in engine.added] == [other.id, low.id]
    w.cancels.close()


def test_a_purge_cancels_what_waits_and_not_what_runs(redis_url) -> None:
    r = connect(redis_url)
    engine = Recorder()
    w = driven_worker(redis_url, engine, fair_every=0)
    with Client(redis_url) as client:
        running = client.submit("taken first", lane="batch")
        preempted = client.submit("handed back", lane="batch")
        turn_until(w, lambda: len(engine.added) == 2)
        # preempted: handed back with its place in the lane kept, so it waits again
        assert w.intake.hand_over(w.running.pop(preempted.id).entry)
        engine.added.remove((preempted.id, engine.added[1][1]))
        assert preempted.record().state == records.QUEUED
        waiting = [client.submit(f"waits {i}", lane="batch") for i in range(4)]
        waiting.append(client.submit("later", lane="batch", not_before=time.time() + 60))
        other = client.submit("another lane", lane="standard")
        later = client.submit("later, elsewhere", lane="standard", not_before=time.time() + 60)

        assert lanes.purge(r, "batch") == 6
        assert r.zcard(keys.delayed()) == 1  # the standard lane's delayed job is left
        assert later.record().state == records.QUEUED
        for job in [preempted, *waiting]:
            record = job.record()
            assert (record.state, record.final, record.finish_reason) == (
                records.CANCELLED,
                True,
                "abort",
            )
            with pytest.raises(Exception, match="cancelled"):
                job.result(timeout=5)
        assert running.record().state == records.RUNNING
        assert other.record().state == records.QUEUED
        assert lanes.purge(r, "batch") == 0  # nothing waits now
        lane = {(q.model, q.name): q for q in stats.snapshot(r, Settings().lanes).lanes}
        # the new entries are gone; the handed-back one is acked by the worker that takes it
        assert lane[("default", "batch")].waiting == 1
        assert lane[("default", "batch")].pending == 1  # the running job's
        assert lane[("default", "standard")].waiting == 1

        # the worker goes on with what is left and runs none of the purged jobs (the
        # handed-back one it reads, begins not and answers: BEGIN finds it cancelled)
        turn_until(w, lambda: stats.snapshot(r, Settings().lanes).totals["waiting"] == 0)
        runs = [job_id for job_id, _ in engine.added if job_id not in engine.aborted]
        assert runs == [running.id, other.id]
        assert preempted.record().state == records.CANCELLED
    w.cancels.close()


def test_an_unknown_lane_or_model_is_refused(redis_url) -> None:
    r = connect(redis_url)
    for call in (lanes.pause, lanes.resume, lanes.purge):
        with pytest.raises(lanes.LaneError) as e:
            call(r, "nowhere")
        assert e.value.code == lanes.LaneCode.UNKNOWN_LANE and "interactive" in e.value.message
        with pytest.raises(lanes.LaneError) as e:
            call(r, "batch", model="no spaces allowed")
        assert e.value.code == lanes.LaneCode.BAD_MODEL
    assert r.scard("plurai:paused") == 0

    refused = plurai(redis_url, "lane", "purge", "nowhere")
    assert refused.returncode == 2 and "unknown_lane" in refused.stderr
    missing = plurai(redis_url, "lane", "pause")
    assert missing.returncode == 2 and "needs a lane" in missing.stderr
    done = plurai(redis_url, "lane", "pause", "batch")
    assert done.returncode == 0 and "batch: paused" in done.stdout
    listed = plurai(redis_url, "lane", "list")
    assert listed.stdout.split() == ["default", "batch", "paused"]


def test_a_hostile_paused_key_pauses_nothing_it_does_not_name(redis_url) -> None:
    """plurai:paused written by something else: members that name no lane of the model
    (bytes that are not text, no model, another model, a huge one) pause nothing; a key of
    another type pauses nothing either, and a pause then says what is wrong."""
    r = connect(redis_url)
    engine = Recorder()
    w = driven_worker(redis_url, engine, heartbeat_interval_s=0.05, fair_every=0)
    junk = [b"\xff\xfe:standard", "standard", "x" * 100_000, "default:", "other:standard"]
    r.sadd(keys.PAUSED, *junk)
    with Client(redis_url) as client:
        first = client.submit("runs", lane="standard")
        turn_until(w, lambda: [j for j, _ in engine.added] == [first.id])
        assert not w.intake.paused & set(Settings().lanes)
        listed = plurai(redis_url, "lane", "list")
        assert listed.returncode == 0 and "other  standard  paused" in listed.stdout
        assert len(max(listed.stdout.splitlines(), key=len)) < 400  # the huge one cut short
        assert stats.snapshot(r, Settings().lanes).lanes  # status reads on
        dashboard.read(r, Settings())

        r.delete(keys.PAUSED)
        r.set(keys.PAUSED, "not a set")
        turn_until(w, lambda: not w.intake.paused)
        second = client.submit("runs too", lane="standard")
        turn_until(w, lambda: len(engine.added) == 2)
        assert engine.added[1][0] == second.id
        out = plurai(redis_url, "lane", "pause", "standard")
        assert out.returncode == 1 and "WRONGTYPE" in out.stderr, out.stderr
        assert lanes.paused(r) == []
    w.cancels.close()
