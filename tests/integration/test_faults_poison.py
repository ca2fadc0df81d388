"""Poison entries: one delivered more than PLURAI_MAX_DELIVERIES times (its consumers keep
dying on it) goes to the dead-letter stream with a too_many_deliveries result; one
delivered fewer times is reclaimed and run; a pending entry deleted from its stream is
acked. The worker keeps serving beside them."""

from __future__ import annotations

import json
import time

import pytest
import redis

from plurai.broker_config import keys
from plurai.broker_config.groups import ensure_groups
from plurai.producer.client import Client
from plurai.results import jobs, records

from .faults import FAST, LANES, drained, final_records


def deliver(r: redis.Redis, lane: str, times: int) -> bytes:
    """Take the lane's next entry as a consumer that then 'dies', `times` deliveries in all."""
    stream = keys.request_stream(lane)
    ((_, [(entry_id, _fields)]),) = r.xreadgroup(keys.GROUP, "doomed", {stream: ">"}, count=1)
    for _ in range(times - 1):
        r.xclaim(stream, keys.GROUP, "doomed", 0, [entry_id])  # each claim is a delivery
    return entry_id


def test_poison_entry_dead_lettered(redis_url, workers):
    r = redis.Redis.from_url(redis_url)
    ensure_groups(r, [keys.request_stream(lane) for lane in LANES])
    client = Client(redis_url)
    poison = client.submit("poison", max_tokens=4, lane="batch")
    poison_entry = deliver(r, "batch", 3)
    retried = client.submit("second try", max_tokens=4, lane="standard")
    deliver(r, "standard", 2)
    client.submit("trimmed away while pending", max_tokens=4, lane="interactive")
    r.xdel(keys.request_stream("interactive"), deliver(r, "interactive", 1))

    (proc,) = workers.start(1, env={**FAST, "PLURAI_MAX_DELIVERIES": "3"})
    good = client.submit("fine", max_tokens=4, lane="interactive")
    bad, again, fine = final_records(redis_url, [poison.id, retried.id, good.id], timeout=60)

    assert bad.state == records.FAILED and bad.error_code == "too_many_deliveries"
    assert "delivered 4 times" in bad.error_message
    assert again.state == records.COMPLETED and again.worker != "doomed"
    assert fine.state == records.COMPLETED
    ((_, dead),) = r.xrange(keys.DEAD_LETTER)
    assert dead[b"lane"] == b"batch" and dead[b"entry_id"] == poison_entry
    assert json.loads(dead[b"fields"])["id"] == poison.id
    assert drained(r)  # the deleted entry's delivery was acked too
    assert proc.poll() is None  # unaffected
    assert client.submit("after", max_tokens=2).result(timeout=60).state == records.COMPLETED


@pytest.mark.parametrize("advanced", [False, True])
def test_a_run_that_advanced_is_no_failure(redis_url, workers, advanced: bool):
    """A job whose third run began and then lost its worker, at a limit of 3: where that
    run had made the job's progress grow, the worker was not stopped by the job (killed at
    random, or stalled) and the job runs again; where it had not, the job is dead-lettered,
    as a poison job that kills its worker before any progress is."""
    r = redis.Redis.from_url(redis_url)
    ensure_groups(r, [keys.request_stream(lane) for lane in LANES])
    job = Client(redis_url).submit("its worker died while it ran", max_tokens=4, lane="batch")
    deliver(r, "batch", 3)
    began = jobs.begin(
        job_id=job.id,
        worker="doomed",
        now_ms=int(time.time() * 1000),
        ttl_s=3600,
        deadline_ms=None,
        lane="batch",
        priority=0,
        metadata_json=None,
    )
    assert jobs.run(r, began) == b"run"
    if advanced:
        r.append(keys.progress(job.id), b"tokens")  # not a model's progress: run again whole

    workers.start(1, env={**FAST, "PLURAI_MAX_DELIVERIES": "3"})
    (rec,) = final_records(redis_url, [job.id], timeout=60)
    if advanced:
        assert rec.state == records.COMPLETED and rec.output_tokens == 4
        assert not r.xrange(keys.DEAD_LETTER)
    else:
        assert rec.state == records.FAILED and rec.error_code == "too_many_deliveries"
        assert "delivered 4 times" in rec.error_message
    assert drained(r)
