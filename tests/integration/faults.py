"""Helpers shared by the fault-injection tests (tests/integration/test_faults_*.py)."""

from __future__ import annotations

import time

import redis

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.results import records
from plurai.results.records import JobRecord

LANES = ("interactive", "standard", "batch")

# Short lease and reclaim times so a dead worker's entries are taken over within seconds.
FAST = {
    "PLURAI_HEARTBEAT_INTERVAL_S": "0.3",
    "PLURAI_RECLAIM_IDLE_MS": "2000",
    "PLURAI_RECLAIM_INTERVAL_S": "0.5",
}


def final_records(url: str, ids: list[str], timeout: float = 150.0) -> list[JobRecord]:
    """Poll until every job has its final result (or timeout), riding out a Redis outage."""
    r = connect(url, socket_timeout=5)
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


def streams(shards: int = 1) -> list[str]:
    """The default model's request streams, every shard."""
    return [
        keys.request_stream(lane, keys.DEFAULT_MODEL, n) for lane in LANES for n in range(shards)
    ]


def pending(r: redis.Redis, consumer: str | None = None, shards: int = 1) -> int:
    total = 0
    for stream in streams(shards):
        if consumer is None:
            total += r.xpending(stream, keys.GROUP)["pending"]
        else:
            total += len(r.xpending_range(stream, keys.GROUP, "-", "+", 1000, consumer))
    return total


def drained(r: redis.Redis, shards: int = 1, timeout: float = 10.0) -> bool:
    """Whether no entry is pending, waiting up to `timeout`: a job's entry is acked just
    after its result is stored (with its worker's next write)."""
    give_up = time.monotonic() + timeout
    while pending(r, None, shards) and time.monotonic() < give_up:
        time.sleep(0.1)
    return pending(r, None, shards) == 0
