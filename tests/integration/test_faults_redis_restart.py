"""Redis killed (SIGKILL) in the middle of a run and restarted on the same port from the
same append-only file: every accepted job completes, once."""

from __future__ import annotations

import time

import redis

from plurai.broker_config.embedded import EmbeddedRedis
from plurai.producer.client import Client
from plurai.results import records

from .faults import FAST, LANES, count_final, drained, end_entries, final_records


def test_redis_restart_mid_run(tmp_path, tiny_model, workers_class):
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    w = workers_class(url, tiny_model, tmp_path)
    try:
        r = redis.Redis.from_url(url)
        r.config_set("appendfsync", "always")  # an accepted job is on disk before the reply
        w.start(2, env=FAST)
        client = Client(url)
        jobs = client.submit_many(
            [
                {
                    "prompt": f"restart {i}",
                    "max_tokens": 12,
                    "ignore_eos": True,
                    "lane": LANES[i % 3],
                }
                for i in range(150)
            ]
        )
        ids = [j.id for j in jobs]
        give_up = time.monotonic() + 120
        while count_final(r, ids) < 20:
            assert time.monotonic() < give_up, "the workers never ran jobs"
            time.sleep(0.02)
        assert server.proc is not None
        server.proc.kill()  # no shutdown, no final save: only what the AOF already holds
        server.proc.wait()
        time.sleep(1.0)  # workers see the connection fail and back off
        assert server.start() == url

        recs = final_records(url, ids)
        assert [rec.state for rec in recs] == [records.COMPLETED] * 150
        assert end_entries(r, ids) == [1] * 150
        assert drained(r)
        assert all(p.poll() is None for p in w.procs)  # the workers rode it out
        assert "redis unavailable" in w.log(0) + w.log(1)
    finally:
        assert w.stop() == [0, 0]
        server.stop()
