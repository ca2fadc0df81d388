"""Poison entries: one delivered more than PLURAI_MAX_DELIVERIES times (its consumers keep
dying on it) goes to the dead-letter stream with a too_many_deliveries result; one
delivered fewer times is reclaimed and run; a pending entry deleted from its stream is
acked. The worker keeps serving beside them."""

from __future__ import annotations

import json

import redis

from broker_config import keys
from broker_config.groups import ensure_groups
from producer.client import Client
from results import records

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
