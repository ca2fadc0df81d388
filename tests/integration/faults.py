"""Helpers shared by the fault-injection tests (tests/integration/test_faults_*.py)."""

from __future__ import annotations

import time

import redis

from broker_config import keys
from results import records
from results.records import JobRecord

LANES = ("interactive", "standard", "batch")

# Short lease and reclaim times so a dead worker's entries are taken over within seconds.
FAST = {
    "PLURAI_HEARTBEAT_INTERVAL_S": "0.3",
    "PLURAI_RECLAIM_IDLE_MS": "2000",
    "PLURAI_RECLAIM_INTERVAL_S": "0.5",
}


def final_records(url: str, ids: list[str], timeout: float = 150.0) -> list[JobRecord]:
    """Poll until every job has its final result (or timeout), riding out a Redis outage."""
    r = redis.Redis.from_url(url, socket_timeout=5)
    give_up = time.monotonic() + timeout
    recs: list[JobRecord] = []
    while time.monotonic() < give_up:
        try:
            recs = records.get_many(r, ids)
        except (redis.ConnectionError, redis.TimeoutError):
            time.sleep(0.2)
            continue
        if all(rec.final for rec in recs):
            break
        time.sleep(0.2)
    r.close()
    return recs


def count_final(r: redis.Redis, ids: list[str]) -> int:
    return sum(rec.final for rec in records.get_many(r, ids))


def end_entries(r: redis.Redis, ids: list[str]) -> list[int]:
    """How many `end` entries each job's token stream holds: 1 means one final result."""
    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        pipe.xrange(keys.output(job_id))
    return [sum(1 for _, f in entries if f[b"type"] == b"end") for entries in pipe.execute()]


def pending(r: redis.Redis, consumer: str | None = None) -> int:
    total = 0
    for lane in LANES:
        stream = keys.request_stream(lane)
        if consumer is None:
            total += r.xpending(stream, keys.GROUP)["pending"]
        else:
            total += len(r.xpending_range(stream, keys.GROUP, "-", "+", 1000, consumer))
    return total
