"""A worker SIGKILLed in the middle of 300 jobs: the survivor reclaims its entries once
their lease lapses, and every job ends with exactly one final result."""

from __future__ import annotations

import signal
import time

import redis

from plurai.broker_config import keys
from plurai.broker_config.connection import connect
from plurai.producer.client import Client
from plurai.results import records

from .conftest import Workers
from .faults import FAST, LANES, count_final, drained, end_entries, final_records, pending, streams


def test_sigkill_worker_mid_run(redis_url, workers):
    sigkill_mid_run(redis_url, workers)


def sigkill_mid_run(url: str, workers: Workers, shards: int = 1) -> None:
    """The test above, on any Redis (tests/integration/test_cluster.py runs it on a
    Cluster); `shards`: the workers' PLURAI_SHARDS."""
    env = {**FAST, "PLURAI_SHARDS": str(shards)}
    (victim,) = workers.start(1, "--worker-id", "victim", env=env)
    workers.start(1, "--worker-id", "survivor", env=env)
    client = Client(url)
    jobs = client.submit_many(
        [
            {
                "prompt": f"job {i} of the crash test",
                "max_tokens": 12,
                "ignore_eos": True,
                "lane": LANES[i % 3],
            }
            for i in range(300)
        ]
    )
    ids = [j.id for j in jobs]
    r = connect(url)
    give_up = time.monotonic() + 120
    while not (count_final(r, ids) >= 30 and pending(r, "victim", shards) > 0):
        assert time.monotonic() < give_up, "the victim never ran jobs"
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    stranded = [  # the kill left entries behind, for the survivor to reclaim
        r.xrange(stream, p["message_id"], p["message_id"])[0][1][b"id"].decode()
        for stream in streams(shards)
        for p in r.xpending_range(stream, keys.GROUP, "-", "+", 300, "victim")
    ]
    # an entry is acked just after its result is stored: the kill may fall between the two
    unfinished = [rec.id for rec in records.get_many(r, stranded) if not rec.final]
    assert unfinished

    recs = final_records(url, ids)
    assert [rec.state for rec in recs] == [records.COMPLETED] * 300
    assert all(rec.output_tokens == 12 for rec in recs)
    assert end_entries(r, ids) == [1] * 300  # one final result each, published once
    assert drained(r, shards)
    by_id = {rec.id: rec for rec in recs}
    assert {by_id[job_id].worker for job_id in unfinished} == {"survivor"}
    assert "reclaimed entry" in workers.log(1)


def test_live_workers_keep_their_entries(redis_url, workers):
    """Jobs that run far longer than the reclaim idle time (2,500 tokens: several seconds
    here, against 2 s) are never taken over from a live worker: its lease renewals keep
    their entries fresh."""
    workers.start(2, env=FAST)
    client = Client(redis_url)
    jobs = client.submit_many(
        [{"prompt": f"long {i}", "max_tokens": 2500, "ignore_eos": True} for i in range(4)]
    )
    recs = final_records(redis_url, [j.id for j in jobs])
    assert [rec.state for rec in recs] == [records.COMPLETED] * 4
    r = redis.Redis.from_url(redis_url)
    for job in jobs:
        types = [f[b"type"] for _, f in r.xrange(keys.output(job.id))]
        assert types.count(b"start") == 1 and b"reset" not in types
    assert "reclaimed" not in workers.log(0) + workers.log(1)
