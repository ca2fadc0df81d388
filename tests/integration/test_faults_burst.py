"""A 5,000-job burst of mixed lanes and priorities on two workers: all complete, each once;
higher lanes go first, yet every lane progresses while the higher ones still have work."""

from __future__ import annotations

import random
import statistics

import redis

from plurai.producer.client import Client
from plurai.results import records

from .faults import LANES, drained, end_entries, final_records


def test_burst_of_5000_mixed_priorities(redis_url, workers):
    workers.start(2)
    rng = random.Random(0)
    reqs = [
        {
            "prompt": f"burst {i}",
            "max_tokens": rng.randint(1, 3),
            "ignore_eos": True,
            "lane": rng.choice(LANES),
            "priority": rng.randint(0, 3),
        }
        for i in range(5000)
    ]
    jobs = Client(redis_url).submit_many(reqs)
    ids = [j.id for j in jobs]
    assert len(set(ids)) == 5000
    recs = final_records(redis_url, ids, timeout=240)
    assert [rec.state for rec in recs] == [records.COMPLETED] * 5000
    r = redis.Redis.from_url(redis_url)
    assert end_entries(r, ids) == [1] * 5000  # no job answered twice
    assert drained(r)

    done = {lane: [rec.finished_ms for rec in recs if rec.lane == lane] for lane in LANES}
    last_interactive = max(done["interactive"])
    for lane in ("standard", "batch"):  # not starved: served while interactive still waited
        assert min(done[lane]) < last_interactive
        assert statistics.median(done["interactive"]) < statistics.median(done[lane])
